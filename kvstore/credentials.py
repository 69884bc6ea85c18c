"""Redis URLs with credentials (redis://user:password@host:port/db): printing them without the
password, and refusing to start with credentials Redis rejects.

A wrong password is a configuration mistake, not an outage: the state writer would otherwise treat
it like an absent Redis (redis-py's AuthenticationError is a ConnectionError) and retry forever while
every record is lost. An unreachable Redis still only degrades bookkeeping (DESIGN.md invariant 6).
"""
from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError

from kvstore.client import connect

logger = logging.getLogger(__name__)


class RedisCredentialsRejected(Exception):
    """Redis refused the URL's user/password; the message names the URL without its password."""


def redact_url(redis_url: str) -> str:
    """redis://user:secret@host:6379/0 -> redis://user:***@host:6379/0 (anything else unchanged)."""
    parts = urlsplit(redis_url)
    if parts.password is None:
        return redis_url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


async def verify_credentials(redis_url: str, *, timeout_s: float = 2.0) -> bool:
    """True if Redis accepted the URL's credentials (PING answered), False if it could not be reached.

    Raises RedisCredentialsRejected when it answered but refused them: a wrong password or user
    (WRONGPASS), none given to a Redis that needs one (NOAUTH), or a user not allowed to PING (NOPERM).
    """
    client = connect(redis_url, socket_timeout_s=timeout_s)
    try:
        await client.ping()
    except (AuthenticationError, NoPermissionError) as error:
        raise RedisCredentialsRejected(_refused(redis_url, error)) from None
    except ResponseError as error:
        if str(error).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            raise RedisCredentialsRejected(_refused(redis_url, error)) from None
        raise
    except (RedisError, OSError, TimeoutError):
        return False
    finally:
        await client.aclose()
    return True


def _refused(redis_url: str, error: Exception) -> str:
    parts = urlsplit(redis_url)
    fix = "--redis-url (redis://USER:PASSWORD@HOST:PORT/DB)"
    if parts.password is None:
        return f"Redis at {redact_url(redis_url)} requires credentials and the URL has none ({error}); put them in {fix}"
    given = "user and password" if parts.username else "password"
    return f"Redis at {redact_url(redis_url)} refused the {given} in the URL ({error}); fix {fix}"


async def check_redis_credentials(redis_url: str, process_name: str) -> None:
    """Start-up check of a main: exits (SystemExit, status 1) naming the URL without its password when
    Redis refuses the credentials; only logs when Redis cannot be reached (that degrades, see above)."""
    try:
        reachable = await verify_credentials(redis_url)
    except RedisCredentialsRejected as error:
        raise SystemExit(f"{process_name}: {error}") from None
    if not reachable:
        logger.warning("Redis at %s is not reachable now; request records wait for it", redact_url(redis_url))
