"""Mutual TLS on a live cluster: every gRPC hop between services (router → workers, prefill → decode KV push)
over mTLS gives stock ``generate``'s tokens, and a worker's gRPC port refuses a client without a certificate
from the CA. Once in-process (with TLS on the router's public API too), once as ``pdserve up --tls-dir``."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.rpc.server import channel
from common.rpc.tls import TlsFiles
from common.security.certs import write_service_certs
from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster
from tests.services.probe import workers
from tests.services.up import pdserve_up

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 8, 64, 3000, 12]
MAX_TOKENS = 8
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def flags(tls: TlsFiles) -> dict:
    return dict(tls_cert_file=tls.cert_file, tls_key_file=tls.key_file, tls_ca_file=tls.ca_file)


def health(ch: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def plaintext_refused(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
        health(ch)
    return info.value.code()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def test_inprocess_cluster_over_mtls_equals_generate(model_dir, hf_reference, tmp_path):
    certs = write_service_certs(tmp_path / "tls", ["router", "prefill-0", "decode-0", "client"])
    router = {**flags(certs["router"]), "public_tls_cert_file": certs["router"].cert_file,
              "public_tls_key_file": certs["router"].key_file}  # fmt: skip
    with inprocess_cluster(
        model_dir,
        prefill=[{"worker_id": "prefill-0", **flags(certs["prefill-0"])}],
        decode=[{"worker_id": "decode-0", **flags(certs["decode-0"])}],
        router=router,
    ) as cluster:
        with Client(cluster.router, timeout_s=120, ca_file=certs["client"].ca_file) as client:
            result = client.generate(PROMPT, **GREEDY)
        assert result.token_ids == hf_greedy(hf_reference(model_dir), PROMPT, MAX_TOKENS)
        assert (result.prefill_worker_id, result.decode_worker_id) == ("prefill-0", "decode-0")  # KV pushed over mTLS
        assert plaintext_refused(cluster.router) == grpc.StatusCode.UNAVAILABLE  # --public-tls-*: TLS only
        for name in ("prefill-0", "decode-0"):
            assert plaintext_refused(cluster.workers[name]) == grpc.StatusCode.UNAVAILABLE
            with channel(cluster.workers[name], certs["client"]) as ch:
                assert health(ch) == health_pb2.HealthCheckResponse.SERVING


def test_pdserve_up_tls_dir(model_dir, hf_reference, tmp_path):
    tls_dir = tmp_path / "tls"
    with pdserve_up(
        "--model",
        model_dir,
        "--tls-dir",
        str(tls_dir),
        "--log-dir",
        str(tmp_path / "logs"),
        "--worker-arg=--kv-cache-memory=6e7",
    ) as info:
        assert info["tls"] == str(tls_dir)
        with Client(info["router"], timeout_s=120) as client:  # the public API stays plaintext
            result = client.generate(PROMPT, **GREEDY)
        assert result.token_ids == hf_greedy(hf_reference(model_dir), PROMPT, MAX_TOKENS)
        client_tls = TlsFiles(str(tls_dir / "client.pem"), str(tls_dir / "client.key"), str(tls_dir / "ca.pem"))
        registered = workers(info["redis"])
        assert sorted(registered) == ["decode-0", "prefill-0"]
        for worker in registered.values():
            assert plaintext_refused(worker.address) == grpc.StatusCode.UNAVAILABLE
            with channel(worker.address, client_tls) as ch:
                assert health(ch) == health_pb2.HealthCheckResponse.SERVING
    assert info["returncode"] == 0
