"""Every service answers grpc.health.v1 and server reflection (what grpcurl needs), and drains on stop."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.kv_transfer.grpc_transport import probe_link
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.services.inprocess import inprocess_cluster


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0"}]) as c:
        yield c


def list_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10)
        return {s.name for r in responses for s in r.list_services_response.service}


@pytest.mark.parametrize("who, service", [("router", "pdserve.v1.GenerateService"),
                                          ("prefill-0", "pdserve.v1.PrefillService"),
                                          ("decode-0", "pdserve.v1.DecodeService")])
def test_health_and_reflection(cluster, who, service):
    address = cluster.router if who == "router" else cluster.workers[who]
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", service):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    services = list_services(address)
    assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def test_probe_link_counts_what_was_sent(cluster):
    """DecodeService.ProbeLink: the bare-stream baseline of KV transfer, with the generated stub (protobuf's
    own framing) and with probe_link's pre-serialized messages."""
    with grpc.insecure_channel(cluster.workers["decode-0"]) as ch:
        stub = worker_pb2_grpc.DecodeServiceStub(ch)
        sizes = [0, 1, 300, 70_000]
        reply = stub.ProbeLink(iter(worker_pb2.ProbeLinkRequest(data=b"x" * n) for n in sizes), timeout=10)
        assert (reply.num_messages, reply.num_bytes) == (len(sizes), sum(sizes))
        assert probe_link(ch, 8 << 20, message_bytes=1 << 20) > 0
