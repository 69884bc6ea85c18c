"""A local redis-server as a supervised child: loopback only, its own temp dir (with an append-only
file, so a restart after a crash keeps its data), and
optionally a password (requirepass) or an ACL user with the unauthenticated default user switched off."""
from __future__ import annotations

import shutil
from functools import partial
from urllib.parse import quote

from tokenmill.cluster.child_process import ChildSpec
from tokenmill.cluster.readiness import redis_ping_probe

REDIS_SERVER_BINARY = "redis-server"
REDIS_CONFIG_FILE = "tokenmill-redis.conf"  # in the child's temp dir, mode 0600: secrets stay out of argv
# What tokenmill's ACL user may do: everything on its own Redis except the commands Redis itself
# calls dangerous (FLUSHALL, CONFIG, DEBUG, KEYS, ACL, SHUTDOWN, ...), plus INFO for health reports.
ACL_USER_RULES = "on ~* &* +@all -@dangerous +info"


def find_redis_server() -> str:
    binary = shutil.which(REDIS_SERVER_BINARY)
    if binary is None:
        raise FileNotFoundError(
            f"{REDIS_SERVER_BINARY} is not on PATH: install it (apt-get install redis-server) "
            f"or point tokenmill at a running Redis with --redis-url")
    return binary


def redis_url(port: int, user: str | None = None, password: str | None = None) -> str:
    """The URL of the local redis-server; credentials are percent-encoded (redis-py decodes them)."""
    credentials = ""
    if password is not None:
        credentials = f"{quote(user or '', safe='')}:{quote(password, safe='')}@"
    return f"redis://{credentials}127.0.0.1:{port}/0"


def redis_config(user: str | None, password: str | None) -> str:
    """redis.conf lines for the credentials: requirepass for a password alone; with a user, that
    user and no default user, so nothing answers without logging in."""
    if password is None:
        if user is not None:
            raise ValueError(f"redis user {user!r} needs a password")
        return ""
    for name, value in (("user", user), ("password", password)):
        if value is not None and (not value or any(c.isspace() or c in "\"'#" for c in value)):
            raise ValueError(f"redis {name} {value!r} must be non-empty without spaces, quotes or '#'")
    if user is None:
        return f"requirepass {password}\n"
    return f"user default off\nuser {user} {ACL_USER_RULES} >{password}\n"


def redis_spec(port: int, binary: str | None = None, port_hint: str = "--redis-port",
               user: str | None = None, password: str | None = None) -> ChildSpec:
    """redis-server on 127.0.0.1:port, saving to an append-only file in its temp dir, which the
    supervisor keeps when it restarts a crashed Redis: records and token streams written before a
    crash are there after it. Redis writes each command to the file before it replies, so a killed
    redis-server loses nothing it acknowledged (fsync once a second only matters if the machine
    dies). No RDB snapshots: the AOF alone is read back at start."""
    config = redis_config(user, password)
    argv = [binary or find_redis_server(), *([REDIS_CONFIG_FILE] if config else []), "--port", str(port),
            "--bind", "127.0.0.1", "--protected-mode", "yes",
            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
            "--dir", ".", "--loglevel", "warning"]
    probe = partial(redis_ping_probe, "127.0.0.1", port, user=user, password=password)
    return ChildSpec("redis", argv, None, f"127.0.0.1:{port}", probe=probe, port_hint=port_hint, use_temp_dir=True,
                     files={REDIS_CONFIG_FILE: config} if config else None)
