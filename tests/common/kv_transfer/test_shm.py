"""The shared-memory KV transport: real processes, exact bytes, failures that end cleanly on both sides."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

import pytest
import torch

from common.engine.kv_cache import KVCacheSpec
from common.kv_transfer.connector import TransferState
from common.kv_transfer.shm import SEGMENT_PREFIX, SHM_DIR, ShmKVReceiver, ShmKVSender

NUM_LAYERS, NUM_BLOCKS = 4, 10
SPEC = KVCacheSpec(num_layers=NUM_LAYERS, num_kv_heads=4, head_dim=32, block_size=16, dtype=torch.bfloat16)
CHUNK_BYTES = 32 << 10  # 8 KiB of K+V per block: chunks of 3, 3, 3, 1 blocks per layer
LAYER_SHAPE = (2, *SPEC.block_shape(NUM_BLOCKS))  # [K|V, n, bs, H, D]


def segments() -> set[str]:
    """This process's arenas in /dev/shm (named after the pid that creates them; every sender here is ours)."""
    prefix = f"{SEGMENT_PREFIX}{os.getpid()}-"
    return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}


@pytest.fixture(autouse=True)
def no_segment_left():
    assert segments() == set()
    yield
    assert segments() == set()


@pytest.fixture
def address():
    directory = tempfile.mkdtemp(prefix="pdkv-")  # short: a Unix socket path has at most 107 bytes
    yield os.path.join(directory, "kv.sock")
    shutil.rmtree(directory)


def make_layers(seed: int = 0) -> torch.Tensor:
    """[L, 2, n, bs, H, D] bf16 of random bits (NaNs included): only a bit-exact transfer keeps them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (NUM_LAYERS, *LAYER_SHAPE), dtype=torch.int16, generator=g).view(SPEC.dtype)


class KVBuffer:
    """What the decode engine's reserved blocks are to the receiver: a ``write`` target."""

    def __init__(self) -> None:
        self.kv = torch.zeros((NUM_LAYERS, *LAYER_SHAPE), dtype=SPEC.dtype)
        self.writes: list[tuple[int, int]] = []  # (layer, first_block)

    def write(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer, 0, first_block : first_block + k.shape[0]] = k
        self.kv[layer, 1, first_block : first_block + k.shape[0]] = v
        self.writes.append((layer, first_block))


def send(sender: ShmKVSender, request_id: str, layers: torch.Tensor, num_layers: int = NUM_LAYERS) -> None:
    for layer in range(num_layers):
        sender.send_layer(request_id, layer, layers[layer, 0].clone(), layers[layer, 1].clone())


@pytest.fixture
def pair(address):
    """An in-process receiver and a sender connected to it."""
    receiver = ShmKVReceiver(address)
    sender = ShmKVSender(address, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
    yield sender, receiver
    sender.close()
    receiver.close()


# -- two processes ----------------------------------------------------------------------------------------------


def _receive_in_child(address: str, conn) -> None:
    """Child process: expect one request, receive it, report the result and the bytes that arrived."""
    receiver = ShmKVReceiver(address)
    buffer = KVBuffer()
    receiver.expect("req-A", NUM_LAYERS, NUM_BLOCKS, SPEC, buffer.write, deadline_s=20.0)
    conn.send("ready")
    result = receiver.wait("req-A", timeout_s=20.0)
    conn.send((result.state.value, result.num_bytes, result.seconds, result.error,
               buffer.kv.view(torch.int16).numpy().tobytes()))  # fmt: skip
    receiver.close()


def _start_child_receiver(address: str):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive_in_child, args=(address, child), daemon=True)
    proc.start()
    assert parent.poll(30) and parent.recv() == "ready"
    return proc, parent


def test_two_processes_move_4_layers_of_10_blocks_bit_for_bit(address):
    proc, conn = _start_child_receiver(address)
    layers = make_layers()
    sender = ShmKVSender(address, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
    start = time.perf_counter()
    send(sender, "req-A", layers)
    result = sender.finish("req-A", timeout_s=20.0)
    seconds = time.perf_counter() - start
    sender.close()
    state, num_bytes, _, error, received = conn.recv()
    proc.join(10)

    num_payload_bytes = layers.numel() * layers.element_size()
    assert (result.state, result.num_bytes, result.error) == (TransferState.DONE, num_payload_bytes, "")
    assert (state, num_bytes, error) == ("done", num_payload_bytes, "")
    assert received == layers.view(torch.int16).numpy().tobytes()
    assert proc.exitcode == 0
    print(f"shm: {num_payload_bytes} bytes in {seconds * 1e3:.1f} ms, {num_payload_bytes / seconds / 1e9:.3f} GB/s")


def test_receiver_killed_mid_transfer_fails_the_sender_quickly_and_leaks_nothing(address):
    proc, _ = _start_child_receiver(address)
    sender = ShmKVSender(address, arena_bytes=4 * CHUNK_BYTES, max_chunk_bytes=CHUNK_BYTES)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    start = time.monotonic()
    send(sender, "req-A", make_layers())
    result = sender.finish("req-A", timeout_s=10.0)
    assert time.monotonic() - start < 2.0
    assert result.state is TransferState.FAILED
    assert result.error.startswith(f"lost the connection to KV receiver {address!r}: ")  # closed / broken pipe
    assert sender.broken == result.error  # what a prefill worker's SenderPool replaces the channel on
    sender.close()


# -- failures, in one process ---------------------------------------------------------------------------------------


def test_corrupt_chunk_fails_both_sides_with_the_checksum_error(pair):
    sender, receiver = pair
    buffer = KVBuffer()
    receiver.expect("req-C", NUM_LAYERS, NUM_BLOCKS, SPEC, buffer.write, deadline_s=10.0)
    sender.corrupt_next_chunk = True
    send(sender, "req-C", make_layers())
    sent, received = sender.finish("req-C", timeout_s=10.0), receiver.wait("req-C", timeout_s=10.0)

    assert received.state is TransferState.FAILED and sent.state is TransferState.FAILED
    assert received.error.startswith(
        "bad KV chunk for request 'req-C': checksum mismatch in request 'req-C', layer 0, blocks [0, 3), seq 0: "
        "expected 0x"
    )
    assert sent.error == received.error
    assert (0, 0) not in buffer.writes  # the corrupt chunk never reached the KV cache
    assert sender.corrupt_next_chunk is False


def test_sender_stopping_midway_fails_at_the_receiver_deadline(pair):
    sender, receiver = pair
    start = time.monotonic()
    receiver.expect("req-D", NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=0.5)
    send(sender, "req-D", make_layers(), num_layers=2)  # then stops: layers 2 and 3 never come
    result = receiver.wait("req-D", timeout_s=30.0)
    elapsed_s = time.monotonic() - start

    assert 0.5 <= elapsed_s < 1.5
    assert result.state is TransferState.FAILED
    assert result.error == (
        "KV of request 'req-D' missed its 0.5s deadline: 20 of 40 blocks arrived (8 chunks); "
        "missing: layer 2 blocks [0, 10), layer 3 blocks [0, 10)"
    )
    assert result.num_bytes == 2 * 2 * NUM_BLOCKS * 16 * 4 * 32 * 2
    assert sender.finish("req-D", timeout_s=5.0).error == result.error  # the receiver told the sender


def test_finish_returns_failed_at_its_timeout_and_aborts_the_receiver(pair):
    sender, receiver = pair
    receiver.expect("req-T", NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=30.0)
    send(sender, "req-T", make_layers(), num_layers=3)
    start = time.monotonic()
    result = sender.finish("req-T", timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 0.8
    assert result.state is TransferState.FAILED
    assert result.error.startswith("KV of request 'req-T' not confirmed within 0.3s")
    on_receiver = receiver.wait("req-T", timeout_s=5.0)
    assert (on_receiver.state, on_receiver.error) == (TransferState.FAILED, "request 'req-T' aborted by sender")


def test_receiver_abort_stops_writes_and_fails_the_sender(pair):
    sender, receiver = pair
    buffer = KVBuffer()
    receiver.expect("req-R", NUM_LAYERS, NUM_BLOCKS, SPEC, buffer.write, deadline_s=30.0)
    layers = make_layers()
    send(sender, "req-R", layers, num_layers=1)
    deadline = time.monotonic() + 5.0
    while receiver.poll("req-R") is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    receiver.abort("req-R")
    receiver.abort("req-R")  # idempotent
    writes_at_abort = list(buffer.writes)
    for layer in range(1, NUM_LAYERS):
        sender.send_layer("req-R", layer, layers[layer, 0].clone(), layers[layer, 1].clone())
    result = sender.finish("req-R", timeout_s=5.0)

    assert result.state is TransferState.FAILED
    assert result.error in ("request 'req-R' aborted by receiver", "no KV reservation for request 'req-R' "
                            "(never made, aborted, or already received)")  # fmt: skip
    assert buffer.writes == writes_at_abort
    assert receiver.poll("req-R") is TransferState.FAILED
    assert receiver.wait("req-R", timeout_s=0.1).error == "unknown request 'req-R'"


def test_sender_abort_is_idempotent_and_fails_the_receiver(pair):
    sender, receiver = pair
    receiver.expect("req-S", NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=30.0)
    send(sender, "req-S", make_layers(), num_layers=1)
    sender.abort("req-S")
    sender.abort("req-S")
    sender.abort("never-sent")
    assert sender.poll("req-S") is TransferState.FAILED
    result = sender.finish("req-S", timeout_s=1.0)
    assert (result.state, result.error) == (TransferState.FAILED, "request 'req-S' aborted by sender")
    on_receiver = receiver.wait("req-S", timeout_s=5.0)
    assert (on_receiver.state, on_receiver.error) == (TransferState.FAILED, "request 'req-S' aborted by sender")


def test_chunks_for_a_request_nobody_expects_fail_the_sender(pair):
    sender, _ = pair
    send(sender, "ghost", make_layers(), num_layers=1)
    result = sender.finish("ghost", timeout_s=5.0)
    assert result.error == "no KV reservation for request 'ghost' (never made, aborted, or already received)"


def test_a_receiver_that_never_maps_the_arena_leaves_no_segment(address):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(address)
    server.listen(1)
    connections, seen_during_handshake = [], []

    def accept_and_say_nothing():
        connections.append(server.accept()[0])
        seen_during_handshake.append(segments())

    accepting = threading.Thread(target=accept_and_say_nothing)
    accepting.start()
    with pytest.raises(ConnectionError, match=f"cannot open a KV channel to {address!r}: timed out"):
        ShmKVSender(address, arena_bytes=1 << 16, max_chunk_bytes=1 << 12, connect_timeout_s=0.3)
    accepting.join()
    for sock in [server, *connections]:
        sock.close()
    assert len(seen_during_handshake[0]) == 1  # the arena had a name while the hello waited for an answer


def test_receiver_and_sender_report_their_states(pair):
    sender, receiver = pair
    receiver.expect("req-P", NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=30.0)
    assert receiver.poll("req-P") is TransferState.PENDING
    assert sender.poll("req-P") is TransferState.FAILED  # unknown to the sender so far
    with pytest.raises(ValueError, match="request 'req-P' is already expected"):
        receiver.expect("req-P", NUM_LAYERS, NUM_BLOCKS, SPEC, KVBuffer().write, deadline_s=30.0)
    send(sender, "req-P", make_layers())
    assert sender.finish("req-P", timeout_s=5.0).ok
    assert receiver.poll("req-P") is TransferState.DONE
    assert receiver.wait("req-P", timeout_s=0.0).ok
    f64 = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype torch.float64 has no wire code"):
        sender.send_layer("req-Q", 0, f64, f64)
    big = torch.zeros(1, 64, 4, 32, dtype=torch.bfloat16)  # 32 KiB of K+V in one block
    with pytest.raises(ValueError, match="a chunk of one block takes 32896 bytes, more than max_chunk_bytes 32768"):
        sender.send_layer("req-Q", 0, big, big)
    assert sender.poll("req-Q") is TransferState.FAILED  # nothing was queued
