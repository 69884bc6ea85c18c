"""Fixtures shared across the test tree; each lives in tests/helpers and is only exposed here."""
from tests.helpers.redis_server import fresh_redis, own_redis, redis_server  # noqa: F401
