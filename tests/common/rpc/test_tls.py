"""Mutual TLS of pdserve's gRPC ports (common/rpc/tls.py): which settings make a TlsFiles, what a bad file
says, and a real server from ``build_server(..., tls=...)`` that admits only clients with a certificate from
its CA."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.cluster.net import wait_for_grpc_health
from common.rpc.server import build_server, channel
from common.rpc.tls import TlsFiles
from common.security.certs import CertificateAuthority, write_service_certs
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig

SERVING = health_pb2.HealthCheckResponse.SERVING

# -- settings -----------------------------------------------------------------------------------------------


def test_no_tls_setting_means_plaintext():
    assert TlsFiles.from_config(WorkerConfig()) is None
    assert TlsFiles.from_config(RouterConfig()) is None
    assert TlsFiles.from_config(RouterConfig(), prefix="public_tls", mutual=False) is None


def test_all_three_files_make_mutual_tls():
    config = WorkerConfig(tls_cert_file="w.pem", tls_key_file="w.key", tls_ca_file="ca.pem", tls_server_name="w.svc")
    assert TlsFiles.from_config(config) == TlsFiles("w.pem", "w.key", "ca.pem", "w.svc")


def test_some_files_without_the_others_is_an_error_naming_them():
    config = WorkerConfig(tls_cert_file="w.pem", tls_key_file="w.key")
    with pytest.raises(ValueError) as info:
        TlsFiles.from_config(config)
    assert str(info.value) == (
        "TLS needs --tls-cert-file, --tls-key-file, --tls-ca-file together: --tls-cert-file "
        "'w.pem', --tls-key-file 'w.key' given, --tls-ca-file missing"
    )


def test_a_server_name_without_files_is_an_error():
    with pytest.raises(ValueError) as info:
        TlsFiles.from_config(RouterConfig(tls_server_name="w.svc"))
    assert str(info.value) == "--tls-server-name 'w.svc' needs --tls-cert-file, --tls-key-file, --tls-ca-file"


def test_public_tls_is_a_certificate_and_key_without_ca():
    config = RouterConfig(public_tls_cert_file="r.pem", public_tls_key_file="r.key", tls_server_name="")
    assert TlsFiles.from_config(config, prefix="public_tls", mutual=False) == TlsFiles("r.pem", "r.key")
    with pytest.raises(ValueError, match=r"--public-tls-cert-file 'r.pem' given, --public-tls-key-file missing$"):
        TlsFiles.from_config(RouterConfig(public_tls_cert_file="r.pem"), prefix="public_tls", mutual=False)


# -- files --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two unrelated CAs: ``ok`` (server, client, other) and ``rogue`` (client)."""
    ok = write_service_certs(tmp_path_factory.mktemp("ok"), ["server", "client", "other"])
    rogue = write_service_certs(tmp_path_factory.mktemp("rogue"), ["client"])
    return ok, rogue


def test_load_reads_the_files_and_hides_the_key_from_repr(pki):
    files = pki[0]["server"]
    material = files.load()
    with open(files.cert_file, "rb") as c, open(files.key_file, "rb") as k, open(files.ca_file, "rb") as a:
        assert (material.certificate_chain, material.private_key, material.root_certificates) == (
            c.read(), k.read(), a.read())  # fmt: skip
    assert "PRIVATE KEY" not in repr(material)


def test_a_missing_file_is_named(pki, tmp_path):
    files = pki[0]["server"]
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError) as info:
        TlsFiles(files.cert_file, files.key_file, missing).load()
    assert str(info.value) == f"TLS CA file {missing!r} cannot be read: No such file or directory"


def test_a_key_that_is_not_pem_is_named_without_its_bytes(pki, tmp_path):
    files = pki[0]["server"]
    key = tmp_path / "bad.key"
    key.write_bytes(b"TOP-SECRET-KEY-MATERIAL")
    with pytest.raises(ValueError) as info:
        TlsFiles(files.cert_file, str(key), files.ca_file).load()
    assert str(info.value) == f"TLS private key file {str(key)!r} is not an unencrypted PEM private key"
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_ca_file_without_a_certificate_is_named(pki):
    files = pki[0]["server"]
    with pytest.raises(ValueError) as info:
        TlsFiles(files.cert_file, files.key_file, files.key_file).load()  # a key where the CA should be
    assert str(info.value) == f"TLS CA file {files.key_file!r} holds no PEM certificate"


def test_a_key_of_another_certificate_is_refused(pki):
    server, other = pki[0]["server"], pki[0]["other"]
    with pytest.raises(ValueError) as info:
        TlsFiles(server.cert_file, other.key_file, server.ca_file).load()
    assert str(info.value) == (f"TLS private key file {other.key_file!r} does not belong to the certificate in "
                               f"{server.cert_file!r}")  # fmt: skip


def test_an_expired_certificate_is_refused(tmp_path):
    authority = CertificateAuthority(valid_s=0.01)
    cert_pem, key_pem = authority.issue("old", ["127.0.0.1"])
    (tmp_path / "old.pem").write_bytes(cert_pem)
    (tmp_path / "old.key").write_bytes(key_pem)
    (tmp_path / "ca.pem").write_bytes(authority.cert_pem)
    time.sleep(0.05)
    with pytest.raises(ValueError, match=r"^TLS certificate '.*old\.pem' expired at "):
        TlsFiles(str(tmp_path / "old.pem"), str(tmp_path / "old.key"), str(tmp_path / "ca.pem")).load()


def test_a_channel_needs_a_ca(pki):
    files = pki[0]["client"]
    with pytest.raises(ValueError, match="a TLS channel needs a CA file"):
        channel("127.0.0.1:1", TlsFiles(files.cert_file, files.key_file))


def test_build_server_with_a_bad_file_fails_before_listening(pki, tmp_path):
    files = pki[0]["server"]
    with pytest.raises(ValueError, match="cannot be read"):
        build_server(lambda s: None, [], tls=TlsFiles(files.cert_file, str(tmp_path / "none.key"), files.ca_file))


# -- a live server ------------------------------------------------------------------------------------------


@pytest.fixture
def served(request):
    """Start a health-only server with the given TlsFiles; yields its address."""
    servers = []

    def start(tls: TlsFiles) -> str:
        server, port, health = build_server(lambda s: None, ["test.Service"], tls=tls)
        server.start()
        health.set_serving(True)
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def check(ch: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def refused(ch: grpc.Channel) -> grpc.StatusCode:
    with ch, pytest.raises(grpc.RpcError) as info:
        check(ch)
    return info.value.code()


def test_a_client_with_a_certificate_from_the_ca_is_served(pki, served):
    ok, _ = pki
    address = served(ok["server"])
    with channel(address, ok["client"]) as ch:
        assert check(ch) == SERVING
    assert wait_for_grpc_health(address, timeout_s=10, tls=ok["client"]) is True


def test_clients_without_a_certificate_from_the_ca_are_refused_at_the_handshake(pki, served):
    ok, rogue = pki
    address = served(ok["server"])
    with open(ok["server"].ca_file, "rb") as f:
        ca = f.read()
    assert refused(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    no_cert = grpc.ssl_channel_credentials(root_certificates=ca)  # TLS, trusts the server, presents nothing
    assert refused(grpc.secure_channel(address, no_cert)) == grpc.StatusCode.UNAVAILABLE
    other_ca = TlsFiles(rogue["client"].cert_file, rogue["client"].key_file, ok["client"].ca_file)
    assert refused(channel(address, other_ca)) == grpc.StatusCode.UNAVAILABLE
    assert wait_for_grpc_health(address, timeout_s=0.5) is False


def test_a_client_refuses_a_server_its_ca_did_not_sign(pki, served):
    ok, rogue = pki
    address = served(ok["server"])
    trusts_rogue = TlsFiles(ok["client"].cert_file, ok["client"].key_file, rogue["client"].ca_file)
    assert refused(channel(address, trusts_rogue)) == grpc.StatusCode.UNAVAILABLE


def test_server_name_override_for_a_certificate_without_the_dialled_ip(served, tmp_path):
    files = write_service_certs(tmp_path, ["server", "client"], hosts=["worker.pdserve.internal"])
    address = served(files["server"])  # dialled as 127.0.0.1, which its certificate does not name
    assert refused(channel(address, files["client"])) == grpc.StatusCode.UNAVAILABLE
    client = files["client"]
    named = TlsFiles(client.cert_file, client.key_file, client.ca_file, server_name="worker.pdserve.internal")
    with channel(address, named) as ch:
        assert check(ch) == SERVING


def test_public_tls_serves_clients_without_a_certificate(pki, served):
    ok, _ = pki
    address = served(TlsFiles(ok["server"].cert_file, ok["server"].key_file))  # no CA: no client certificate asked
    with open(ok["server"].ca_file, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(address, credentials) as ch:
        assert check(ch) == SERVING
    assert refused(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
