"""Redis with a password (``requirepass``) and over TLS (``rediss://`` trusting a CA via ``ssl_ca_certs``):
clients without the password or the CA are refused with a clear error, and the password never shows in an
error or log line pdserve writes."""

from __future__ import annotations

import argparse
import logging

import pytest
import redis

from common.config.loader import add_config_args, resolve_config
from common.state.redis_client import connect, describe_error, ping, redact_url
from pdserve.commands.status import status
from services.worker.config import WorkerConfig
from tests.redis_server import TLS_UNSUPPORTED, RedisServer, tls_supported

PASSWORD = "s3cr3t-pw"
WRONG = "wr0ng-pw"


@pytest.fixture(scope="module")
def protected():
    with RedisServer(password=PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def tls_server():
    if not tls_supported():
        pytest.skip(TLS_UNSUPPORTED)
    with RedisServer(password=PASSWORD, tls=True) as server:
        yield server


def test_no_password_is_refused_and_described_as_missing(protected):
    url = protected.url_with(password=None)
    client = connect(url)
    with pytest.raises(redis.AuthenticationError) as info:
        client.ping()
    assert ping(client) is False
    assert describe_error(info.value, url) == (
        f"Redis at {url}: needs a password and the URL has none (redis://:PASSWORD@HOST:PORT/DB, or "
        f"redis://USER:PASSWORD@... for an ACL user): {info.value}")


def test_a_wrong_password_is_refused_without_echoing_it(protected):
    url = protected.url_with(password=WRONG)
    with pytest.raises(redis.AuthenticationError, match="^invalid username-password pair") as info:
        connect(url).get("k")
    shown = f"redis://:***@127.0.0.1:{protected.port}/0"
    assert describe_error(info.value, url) == (
        f"Redis at {shown}: the URL's user or password was refused: {info.value}")
    assert WRONG not in str(info.value) and WRONG not in describe_error(info.value, url)


def test_the_right_password_is_accepted(protected):
    assert protected.url == f"redis://:{PASSWORD}@127.0.0.1:{protected.port}/0"
    client = connect(protected.url)
    assert client.set("k", b"v") is True and client.get("k") == b"v"


def test_tls_is_reached_with_rediss_and_the_ca(tls_server):
    ca = tls_server.tls_files.ca_cert
    assert tls_server.url == f"rediss://:{PASSWORD}@127.0.0.1:{tls_server.port}/0?ssl_ca_certs={ca}"
    client = connect(tls_server.url)
    assert client.set("k", b"v") is True and client.get("k") == b"v"
    assert client.connection_pool.connection_kwargs["ssl_ca_certs"] == str(ca)


def test_tls_without_the_ca_fails_certificate_verification(tls_server):
    url = tls_server.url.split("?")[0]  # the system's CAs do not know the test CA
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED") as info:
        connect(url).ping()
    assert describe_error(info.value, url) == (
        f"Redis at rediss://:***@127.0.0.1:{tls_server.port}/0: its TLS certificate is not trusted (give the CA as "
        f"rediss://...?ssl_ca_certs=/path/to/ca.pem): {info.value}")


def test_plain_redis_to_a_tls_port_fails(tls_server):
    url = tls_server.url.replace("rediss://", "redis://", 1).split("?")[0]
    with pytest.raises(redis.ConnectionError):
        connect(url, socket_timeout_s=0.5, socket_connect_timeout_s=0.5, retries=0).ping()


@pytest.mark.parametrize(
    ("url", "shown"),
    [(f"redis://:{PASSWORD}@h:6379/0", "redis://:***@h:6379/0"),
     (f"redis://alice:{PASSWORD}@h:6379/0", "redis://alice:***@h:6379/0"),
     (f"rediss://:{PASSWORD}@h:6380/0?ssl_ca_certs=/etc/ca.pem", "rediss://:***@h:6380/0?ssl_ca_certs=/etc/ca.pem"),
     ("redis://:p%40ss@h/0", "redis://:***@h/0"),
     ("redis://h:6379/0", "redis://h:6379/0")],
)
def test_redact_url_hides_the_password_and_keeps_the_rest(url, shown):
    assert redact_url(url) == shown


def test_a_bad_scheme_error_hides_the_password():
    with pytest.raises(ValueError, match=r"^Redis URL must start with redis:// or rediss://, got 'http://:\*\*\*@h/0'$"):
        connect(f"http://:{PASSWORD}@h/0")


def test_the_config_log_hides_the_password():
    parser = argparse.ArgumentParser()
    add_config_args(parser, WorkerConfig)
    resolved = resolve_config(WorkerConfig, parser.parse_args(["--redis-url", f"rediss://:{PASSWORD}@h:6380/0"]),
                              env={})
    assert "redis_url = 'rediss://:***@h:6380/0'  (flag)" in resolved.describe().splitlines()
    assert PASSWORD not in resolved.describe()


def test_pdserve_status_error_names_the_url_without_the_password(protected, capsys, caplog):
    url = protected.url_with(password=WRONG)
    with caplog.at_level(logging.DEBUG):
        code = status(argparse.Namespace(redis_url=url, prefix="pdserve:", json=True, k8s=False))
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"pdserve status: error: cannot read the worker registry from Redis at "
                          f"redis://:***@127.0.0.1:{protected.port}/0: the URL's user or password was refused: "
                          "invalid username-password pair")
    assert WRONG not in err and WRONG not in caplog.text
