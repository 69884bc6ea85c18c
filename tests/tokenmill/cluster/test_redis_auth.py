"""A real redis-server started as tokenmill starts it, with a password (requirepass): the readiness probe
logs in, the password stays out of argv, and kvstore's start-up check tells a wrong password (exit,
naming the URL without it) from an absent Redis (carry on)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvstore.credentials import RedisCredentialsRejected, redact_url, verify_credentials
from kvstore.state_reader import RequestStateReader
from tokenmill.cluster.readiness import free_port, redis_ping_probe
from tokenmill.cluster.redis_process import REDIS_CONFIG_FILE, redis_config, redis_spec, redis_url
from tokenmill.cluster.supervisor import Supervisor

PASSWORD = "pa:ss/w@rd%"  # every character that needs percent-encoding in a URL


@pytest.fixture(scope="module")
def password_redis():
    port = free_port()
    spec = redis_spec(port, password=PASSWORD)
    assert PASSWORD not in " ".join(spec.argv)  # it is in a 0600 file in the child's temp dir instead
    # ready only if the probe sends AUTH: without it PING answers -NOAUTH
    with Supervisor([spec], echo=False, startup_timeout_s=60) as supervisor:
        config_file = Path(f"/proc/{supervisor.pid('redis')}/cwd") / REDIS_CONFIG_FILE
        assert stat.S_IMODE(os.stat(config_file).st_mode) == 0o600
        yield port


async def test_the_right_password_is_accepted_and_records_can_be_read(password_redis):
    url = redis_url(password_redis, password=PASSWORD)
    assert await verify_credentials(url) is True
    async with RequestStateReader(url) as reader:
        assert await reader.get_record("no-such-request") is None


@pytest.mark.parametrize("password", ["wrong", None])
async def test_a_wrong_or_missing_password_is_refused_naming_the_url_without_it(password_redis, password):
    url = redis_url(password_redis, password=password)
    with pytest.raises(RedisCredentialsRejected) as caught:
        await verify_credentials(url)
    message = str(caught.value)
    assert f"Redis at {redact_url(url)} " in message and "--redis-url" in message
    if password:
        assert "refused the password" in message and "invalid username-password pair" in message
        assert "wrong" not in message
    else:
        assert "requires credentials and the URL has none" in message


async def test_an_unreachable_redis_is_not_a_credentials_error():
    assert await verify_credentials(redis_url(free_port(), password="x"), timeout_s=1.0) is False


def test_the_probe_reports_a_refused_password(password_redis):
    ready, status = redis_ping_probe("127.0.0.1", password_redis, password="wrong", timeout_s=5)
    assert not ready and "WRONGPASS" in status
    assert redis_ping_probe("127.0.0.1", password_redis, password=PASSWORD, timeout_s=5) == (True, "PONG")


def test_urls_are_redacted_and_configs_checked():
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://:secret@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redis_config("app", "pw") == "user default off\nuser app on ~* &* +@all -@dangerous +info >pw\n"
    assert redis_config(None, "pw") == "requirepass pw\n" and redis_config(None, None) == ""
    with pytest.raises(ValueError, match="needs a password"):
        redis_config("app", None)
    with pytest.raises(ValueError, match="without spaces"):
        redis_config(None, "two words")
