"""Opening a Redis client that fails fast: the one place that turns a URL into a ``redis.Redis``.

Called once by each service's entry point (and by ``pdserve status``); the client is then passed down.
A dead or unreachable Redis makes a command fail within about ``socket_connect_timeout_s`` (or
``socket_timeout_s`` for a Redis that accepted the connection and stopped answering) per attempt,
instead of hanging or retrying for seconds as redis-py's own default policy does.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo = f"{parts.username or ''}:***"
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{userinfo}@{host}").geturl()


def describe_error(exc: BaseException, url: str) -> str:
    """``Redis at URL: [hint: ]error``, one line for a failed Redis operation on ``url``, safe to log (the
    password shown as ``***``); the hint names the fix for a missing or refused password or an untrusted TLS
    certificate."""
    hint = ""
    if isinstance(exc, redis.AuthenticationError):
        if urlsplit(url).password is None:
            hint = ("needs a password and the URL has none (redis://:PASSWORD@HOST:PORT/DB, or "
                    "redis://USER:PASSWORD@... for an ACL user): ")
        else:
            hint = "the URL's user or password was refused: "
    elif isinstance(exc, redis.ConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(exc):
        hint = "its TLS certificate is not trusted (give the CA as rediss://...?ssl_ca_certs=/path/to/ca.pem): "
    return f"Redis at {redact_url(url)}: {hint}{exc}"


def connect(
    url: str,
    *,
    socket_timeout_s: float = 2.0,
    socket_connect_timeout_s: float = 2.0,
    retries: int = 1,
) -> redis.Redis:
    """A client for ``url`` (``redis://[user:password@]host:port[/db]`` or ``rediss://...`` for TLS).

    TLS settings are query parameters of the URL, passed to redis-py's ``SSLConnection``:
    ``rediss://:PASSWORD@host:6380/0?ssl_ca_certs=/etc/pdserve/redis-ca.pem`` trusts that CA (else the system's);
    ``ssl_certfile`` and ``ssl_keyfile`` add a client certificate (Redis ``tls-auth-clients yes``). A password
    with ``@ : / ? #`` or ``%`` in it must be percent-encoded.

    Does no I/O: connections are opened on first use, so this never blocks and succeeds for a Redis that
    is down. ``retries`` is how many times a command that failed on a connection error is retried at once
    on a fresh connection (1 covers a pooled connection that a Redis restart broke); timeouts are not
    retried, since the command may have run. Responses are bytes
    (``decode_responses=False``): token ids are stored as packed binary. The client is thread-safe.
    """
    if not isinstance(url, str) or urlsplit(url).scheme not in SCHEMES:
        shown = redact_url(url) if isinstance(url, str) else url
        raise ValueError(f"Redis URL must start with redis:// or rediss://, got {shown!r}")
    timeouts_s = {"socket_timeout_s": socket_timeout_s, "socket_connect_timeout_s": socket_connect_timeout_s}
    for name, value in timeouts_s.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_connect_timeout_s,
        retry=Retry(NoBackoff(), retries, supported_errors=(redis.ConnectionError,)),
        decode_responses=False,
    )


def ping(client: redis.Redis) -> bool:
    """True when Redis answers PING; False on any error. Never raises; blocks at most the client's timeouts."""
    try:
        return bool(client.ping())
    except Exception as e:  # noqa: BLE001 - the contract is "never raises"
        logger.debug("Redis ping failed: %s", e)
        return False
