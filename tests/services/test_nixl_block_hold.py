"""A decode worker whose reservation a NIXL block sender claimed frees its blocks only once no write of that
sender can reach them: after the sender's quiet, or its grant's end (the deadline + ``GRANT_GRACE_S``) when it went
silent. A real DecodeServicer, engine loop and NIXL receiver; the sender writes from a cache of its own."""

from __future__ import annotations

import time

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.engine_loop import EngineLoop
from common.engine.identity import ModelIdentity
from common.engine.kv_cache import PagedKVCache
from common.engine.loader import load_model
from common.kv_transfer import nixl, nixl_blocks, nixl_landing
from pdserve.v1 import worker_pb2
from services.decode.servicer import DecodeServicer

pytestmark = pytest.mark.skipif(nixl.nixl_api() is None, reason=nixl.unavailable_reason() or "NIXL importable")


class _Context:
    def invocation_metadata(self):
        return ()

    def abort(self, code, details):
        raise AssertionError(f"{code}: {details}")


@pytest.fixture
def decode(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    engine = LLMEngine(load_model(tiny_model_dir("llama")), EngineConfig(num_kv_blocks=200))
    loop = EngineLoop(engine).start()
    receiver = nixl.NixlKVReceiver(kv_cache=engine.kv_cache)
    servicer = DecodeServicer(loop, ModelIdentity.of_engine(engine), generation_config=engine.loaded.generation_config,
                              default_max_tokens=16, nixl_receiver=receiver)  # fmt: skip
    sender = nixl_blocks.NixlBlockSender(receiver.metadata, PagedKVCache(engine.kv_cache.spec, 8))
    yield loop, servicer, receiver, sender
    sender.close()
    servicer.close()
    receiver.close()
    loop.stop()


def num_reservations(loop: EngineLoop) -> int:
    return loop.call(lambda e: len(e.reservations))


def claim_one_layer(servicer, receiver, sender, request_id: str, lease_s: float) -> list[int]:
    reply = servicer.ReserveKv(worker_pb2.ReserveKvRequest(request_id=request_id, num_tokens=40,
                                                           lease_seconds=lease_s), _Context())  # fmt: skip
    assert reply.kv_nixl_metadata == receiver.metadata and len(reply.kv_block_ids) == reply.num_blocks
    sender.claim(request_id, list(reply.kv_block_ids), sender.layout.num_layers)
    sender.send_blocks(request_id, 0, list(range(reply.num_blocks)))  # the prompt's other layers never come
    until = time.monotonic() + 10.0
    while not receiver.writing(request_id) and time.monotonic() < until:
        time.sleep(0.01)
    assert receiver.writing(request_id)  # granted
    return list(reply.kv_block_ids)


def test_released_blocks_wait_for_the_sender_s_quiet(decode):
    loop, servicer, receiver, sender = decode
    claim_one_layer(servicer, receiver, sender, "req-Q", lease_s=30.0)
    assert servicer.release("req-Q")  # the router gave up on it: the sender hears and, its writes done, says quiet
    until = time.monotonic() + 10.0
    while num_reservations(loop) and time.monotonic() < until:
        servicer.expire_leases()  # (the worker's tick)
        time.sleep(0.05)
    assert num_reservations(loop) == 0
    assert sender.finish("req-Q", timeout_s=5.0).error == "request 'req-Q' aborted by receiver"


def test_a_silent_sender_holds_them_until_its_grant_ends(decode, monkeypatch):
    loop, servicer, receiver, sender = decode
    monkeypatch.setattr(nixl_landing, "GRANT_GRACE_S", 1.0)
    held_blocks = claim_one_layer(servicer, receiver, sender, "req-S", lease_s=1.0)
    monkeypatch.setattr(sender, "_send", lambda msg: None)  # no quiet will come
    reserved_at = time.monotonic()
    assert servicer.release("req-S")
    servicer.expire_leases()
    assert num_reservations(loop) == 1 and servicer.num_held == 1  # held: the sender may still write
    retry = servicer.ReserveKv(worker_pb2.ReserveKvRequest(request_id="req-S", num_tokens=40), _Context())
    assert set(retry.kv_block_ids).isdisjoint(held_blocks)  # a retry of the request gets blocks of its own
    assert num_reservations(loop) == 2
    assert servicer.release("req-S")  # (nobody claimed the retry's blocks: freed at once)
    assert num_reservations(loop) == 1
    while num_reservations(loop) and time.monotonic() < reserved_at + 10.0:
        servicer.expire_leases()
        time.sleep(0.05)
    assert num_reservations(loop) == 0 and servicer.num_held == 0
    assert time.monotonic() - reserved_at > 1.0  # not before the reservation's deadline + the grace (2 s from it)
