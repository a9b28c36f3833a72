"""The NIXL KV transport (UCX between two NIXL agents; here host memory, in one process and across two): exact
bytes, and failures that end cleanly on both sides. Skipped where NIXL is not installed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from common.kv_transfer import nixl
from common.kv_transfer.connector import TransferState
from tests.common.kv_transfer.test_shm import CHUNK_BYTES, NUM_BLOCKS, NUM_LAYERS, SPEC, KVBuffer, make_layers, send

pytestmark = pytest.mark.skipif(nixl.nixl_api() is None, reason=nixl.unavailable_reason() or "NIXL importable")
os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX's own listeners on the loopback device only


@pytest.fixture
def pair():
    receiver = nixl.NixlKVReceiver()
    sender = nixl.NixlKVSender(receiver.metadata, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_4_layers_of_10_blocks_bit_for_bit_and_two_requests_at_once(pair):
    two_requests_bit_for_bit(*pair)


def test_with_nixl_s_progress_thread_on_or_a_bad_setting(monkeypatch):
    monkeypatch.setenv(nixl.PROGRESS_THREAD_ENV, "yes")
    with pytest.raises(ValueError, match="PDSERVE_NIXL_PROGRESS_THREAD must be 0 or 1, got 'yes'"):
        nixl.NixlKVReceiver()
    monkeypatch.setenv(nixl.PROGRESS_THREAD_ENV, "1")
    receiver = nixl.NixlKVReceiver()
    sender = nixl.NixlKVSender(receiver.metadata, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
    try:
        two_requests_bit_for_bit(sender, receiver)
    finally:
        sender.close()
        receiver.close()


def test_workers_refuse_to_start_with_a_bad_progress_thread_setting(monkeypatch):
    from services.decode.main import make_parts as decode_parts
    from services.prefill.main import make_parts as prefill_parts
    from services.worker.config import WorkerConfig

    monkeypatch.setenv(nixl.PROGRESS_THREAD_ENV, "2")
    for make_parts, flags, flag in ((decode_parts, {"kv_nixl": True}, "--kv-nixl"),
                                    (prefill_parts, {"kv_transport": "nixl"}, "--kv-transport nixl")):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            make_parts(WorkerConfig(model="unused", **flags))
        assert str(exc.value) == f"{flag}: PDSERVE_NIXL_PROGRESS_THREAD must be 0 or 1, got '2'"
    assert prefill_parts(WorkerConfig(model="unused")) is not None  # NIXL not asked for: the setting is not read
    for bad in (-1.0, float("nan")):
        with pytest.raises(SystemExit) as exc:
            prefill_parts(WorkerConfig(model="unused", kv_write_stall_s=bad))
        assert str(exc.value) == f"--kv-write-stall-s must be >= 0 (0: no watch), got {bad!r}"


def two_requests_bit_for_bit(sender, receiver) -> None:
    assert sender.receiver == receiver.address
    buffers = {rid: KVBuffer() for rid in ("req-A", "req-B")}
    layers = {rid: make_layers(seed) for seed, rid in enumerate(buffers)}
    for rid, buffer in buffers.items():
        receiver.expect(rid, NUM_LAYERS, NUM_BLOCKS, SPEC, buffer.write, deadline_s=20.0)
    for layer in range(NUM_LAYERS):  # interleaved, as two prompts' layers come out of one step
        for rid in buffers:
            sender.send_layer(rid, layer, layers[rid][layer, 0].clone(), layers[rid][layer, 1].clone())
    payload = layers["req-A"].numel() * layers["req-A"].element_size()
    for rid, buffer in buffers.items():
        sent, got = sender.finish(rid, timeout_s=20.0), receiver.wait(rid, timeout_s=20.0)
        assert (sent.state, sent.num_bytes, sent.error) == (TransferState.DONE, payload, "")
        assert (got.state, got.num_bytes) == (TransferState.DONE, payload)
        assert torch.equal(buffer.kv.view(torch.int16), layers[rid].view(torch.int16))


def _receive_in_child(conn) -> None:
    """Child process: a receiver whose metadata goes to the parent; one request received, bytes sent back."""
    receiver = nixl.NixlKVReceiver()
    buffer = KVBuffer()
    receiver.expect("req-A", NUM_LAYERS, NUM_BLOCKS, SPEC, buffer.write, deadline_s=20.0)
    conn.send(receiver.metadata)
    result = receiver.wait("req-A", timeout_s=20.0)
    conn.send((result.state.value, result.num_bytes, result.error, buffer.kv.view(torch.int16).numpy().tobytes()))
    conn.recv()  # until the parent is done with the channel
    receiver.close()


def _start_child_receiver():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive_in_child, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(60)
    return proc, parent, parent.recv()


def test_two_processes_move_the_kv_bit_for_bit():
    proc, conn, metadata = _start_child_receiver()
    layers = make_layers()
    sender = nixl.NixlKVSender(metadata, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
    start = time.perf_counter()
    send(sender, "req-A", layers)
    result = sender.finish("req-A", timeout_s=20.0)
    seconds = time.perf_counter() - start
    state, num_bytes, error, received = conn.recv()
    sender.close()
    conn.send("bye")
    proc.join(20)
    payload = layers.numel() * layers.element_size()
    assert (result.state, result.num_bytes, result.error) == (TransferState.DONE, payload, "")
    assert (state, num_bytes, error) == ("done", payload, "")
    assert received == layers.view(torch.int16).numpy().tobytes()
    assert proc.exitcode == 0
    print(f"nixl: {payload} bytes in {seconds * 1e3:.1f} ms, {payload / seconds / 1e9:.3f} GB/s")


def test_a_killed_receiver_fails_the_sender_by_its_timeout():
    proc, _, metadata = _start_child_receiver()
    sender = nixl.NixlKVSender(metadata, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    start = time.monotonic()
    send(sender, "req-A", make_layers())
    result = sender.finish("req-A", timeout_s=2.0)
    assert time.monotonic() - start < 4.0
    assert result.state is TransferState.FAILED
    start = time.monotonic()
    sender.close()
    assert time.monotonic() - start < 3.0  # unfinished writes are not waited for past a second


def test_no_receiver_answering_is_a_connection_error():
    api = nixl.nixl_api()
    silent = api.nixl_agent("pdserve-kv-silent", api.nixl_agent_config(backends=["UCX"]))
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="no answer from NIXL KV receiver pdserve-kv-silent within 0.3s"):
        nixl.NixlKVSender(silent.get_agent_metadata(), arena_bytes=1 << 16, max_chunk_bytes=1 << 12,
                          connect_timeout_s=0.3)  # fmt: skip
    assert time.monotonic() - start < 2.0
    with pytest.raises(ConnectionError, match="cannot open a NIXL KV channel"):
        nixl.NixlKVSender(b"not metadata")


def test_an_arena_too_large_is_refused():
    receiver = nixl.NixlKVReceiver(max_arena_bytes=1 << 16)
    try:
        with pytest.raises(ConnectionError, match=r"arena of 131072 bytes refused \(at most 65536\)"):
            nixl.NixlKVSender(receiver.metadata, arena_bytes=1 << 17, max_chunk_bytes=1 << 12)
    finally:
        receiver.close()


def test_corrupt_chunk_fails_both_sides_with_the_checksum_error(pair):
    sender, receiver = pair
    buffer = KVBuffer()
    receiver.expect("req-C", NUM_LAYERS, NUM_BLOCKS, SPEC, buffer.write, deadline_s=10.0)
    sender.corrupt_next_chunk = True
    send(sender, "req-C", make_layers())
    sent, received = sender.finish("req-C", timeout_s=10.0), receiver.wait("req-C", timeout_s=10.0)
    assert received.state is TransferState.FAILED and sent.state is TransferState.FAILED
    assert received.error.startswith("bad KV chunk for request 'req-C': checksum mismatch in request 'req-C', "
                                     "layer 0, blocks [0, 3), seq 0: expected 0x")  # fmt: skip
    assert sent.error == received.error
    assert (0, 0) not in buffer.writes


def test_deadline_abort_and_unknown_requests(pair):
    sender, receiver = pair
    receiver.expect("req-D", NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=0.5)
    send(sender, "req-D", make_layers(), num_layers=2)
    result = receiver.wait("req-D", timeout_s=30.0)
    assert result.error.startswith("KV of request 'req-D' missed its 0.5s deadline: 20 of 40 blocks arrived")
    assert sender.finish("req-D", timeout_s=5.0).error == result.error  # the receiver told the sender

    receiver.expect("req-S", NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=30.0)
    send(sender, "req-S", make_layers(), num_layers=1)
    sender.abort("req-S")
    assert sender.finish("req-S", timeout_s=1.0).error == "request 'req-S' aborted by sender"
    assert receiver.wait("req-S", timeout_s=5.0).error == "request 'req-S' aborted by sender"

    send(sender, "ghost", make_layers(), num_layers=1)
    assert sender.finish("ghost", timeout_s=5.0).error == ("no KV reservation for request 'ghost' (never made, "
                                                           "aborted, or already received)")  # fmt: skip


def test_a_closing_receiver_fails_its_senders_transfers(pair):
    sender, receiver = pair
    receiver.expect("req-X", NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=30.0)
    send(sender, "req-X", make_layers(), num_layers=1)
    deadline = time.monotonic() + 5.0
    while receiver.poll("req-X") is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    receiver.close()
    result = sender.finish("req-X", timeout_s=5.0)
    assert (result.state, result.error) == (TransferState.FAILED, f"KV receiver {receiver.address} closed")


def test_a_silent_sender_loses_its_arena_and_a_new_channel_works():
    receiver = nixl.NixlKVReceiver(peer_idle_s=0.3)
    try:
        sender = nixl.NixlKVSender(receiver.metadata, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
        deadline = time.monotonic() + 5.0
        while not sender.broken and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sender.broken == "the KV receiver dropped a channel silent for 0.3s"
        sender.close()
        receiver.peer_idle_s = 60.0  # the next channel is not dropped mid-test on a slow machine
        again = nixl.NixlKVSender(receiver.metadata, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
        buffer = KVBuffer()
        receiver.expect("req-N", NUM_LAYERS, NUM_BLOCKS, SPEC, buffer.write, deadline_s=20.0)
        layers = make_layers(3)
        send(again, "req-N", layers)
        assert again.finish("req-N", timeout_s=20.0).ok and receiver.wait("req-N", timeout_s=5.0).ok
        assert torch.equal(buffer.kv.view(torch.int16), layers.view(torch.int16))
        again.close()
    finally:
        receiver.close()


def test_a_receiver_gone_silent_breaks_the_channel_within_the_stall_allowance(monkeypatch):
    """NIXL tells a sender nothing when its receiver's host drops off the network (its writes and notes stay in
    progress): chunks left unacknowledged past ``stall_s`` (plus a second per MiB of them) break the channel,
    and the request fails then, not at its own timeout. Without the watch it waits for that timeout."""
    receiver = nixl.NixlKVReceiver()
    senders = []
    try:
        for stall_s, timeout_s in ((0.5, 20.0), (0.0, 2.0)):
            sender = nixl.NixlKVSender(receiver.metadata, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES,
                                       stall_s=stall_s)  # fmt: skip
            senders.append(sender)
            monkeypatch.setattr(receiver, "_on_note", lambda name, msg: None)  # deaf from now on: no ack comes
            rid = f"req-{len(senders)}"
            receiver.expect(rid, NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=30.0)
            start = time.monotonic()
            send(sender, rid, make_layers())
            result = sender.finish(rid, timeout_s=timeout_s)
            took_s = time.monotonic() - start
            assert result.state is TransferState.FAILED
            if stall_s:  # 4 chunks of 32 KiB unacknowledged: 0.5 s + 0.125 s
                assert 0.5 < took_s < 3.0, took_s
                assert "silent for" in result.error and "chunks unacknowledged" in result.error, result.error
                assert sender.broken == result.error
            else:
                assert took_s >= timeout_s and result.error.startswith(f"KV of request '{rid}' not confirmed")
                assert not sender.broken
            monkeypatch.undo()
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
