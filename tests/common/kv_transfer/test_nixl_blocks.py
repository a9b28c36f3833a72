"""Direct KV block writes over NIXL (common.kv_transfer.nixl_blocks): blocks of one cache land bit for bit in the
reserved blocks of another, in one process and across two; every failure ends on both sides and leaves the
reserved blocks held until no write of the sender can reach them. Skipped where NIXL is not installed."""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest
import torch

from common.engine.kv_cache import KVCacheSpec, PagedKVCache
from common.kv_transfer import nixl, nixl_blocks, nixl_landing
from common.kv_transfer.blocks import CacheLayout, CacheRegion, layer_checksum, runs, write_descs
from common.kv_transfer.connector import TransferState
from tests.common.kv_transfer.test_shm import KVBuffer

needs_nixl = pytest.mark.skipif(nixl.nixl_api() is None, reason=nixl.unavailable_reason() or "NIXL importable")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16)
SRC_BLOCKS = [7, 8, 9, 2, 3, 11]  # a prefill request's blocks: stretches of 3, 2 and 1
DST_BLOCKS = [20, 21, 5, 6, 7, 30]  # the decode reservation's: stretches of 2, 3 and 1


def random_cache(num_blocks: int, seed: int) -> PagedKVCache:
    """A cache of random bits (NaNs included: only a bit-exact copy keeps them)."""
    cache = PagedKVCache(SPEC, num_blocks)
    g = torch.Generator().manual_seed(seed)
    cache.data.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, cache.data.shape, dtype=torch.int16,
                                                     generator=g))  # fmt: skip
    return cache


def blocks_of(cache: PagedKVCache, block_ids: list[int]) -> torch.Tensor:
    """[L, 2, H, n, bs, D] as int16, in ``block_ids`` order."""
    return cache.data[:, :, :, block_ids].view(torch.int16)


# -- the layout arithmetic, without NIXL -----------------------------------------------------------------------


def test_descriptors_cover_each_head_s_stretches_and_copying_them_moves_the_blocks():
    src, dst = random_cache(12, 0), random_cache(32, 1)
    layout = CacheLayout.of(src)
    assert layout == CacheLayout.of(dst) and layout.run_bytes == 16 * 32 * 2
    local, remote = write_descs(layout, 1, CacheRegion.of(src), np.array(SRC_BLOCKS), CacheRegion.of(dst),
                                np.array(DST_BLOCKS))  # fmt: skip
    # stretches consecutive on both sides: [7,8]->[20,21], [9]->[5], [2,3]->[6,7], [11]->[30]; x 2 x 2 heads
    assert local.shape == remote.shape == (16, 3)
    assert local[:4, 1].tolist() == [2 * layout.run_bytes, layout.run_bytes, 2 * layout.run_bytes, layout.run_bytes]
    for (src_addr, n, _), (dst_addr, m, _) in zip(local.tolist(), remote.tolist(), strict=True):  # what NIXL does
        assert n == m
        _bytes_at(dst, dst_addr, n).copy_(_bytes_at(src, src_addr, n))
    assert torch.equal(blocks_of(dst, DST_BLOCKS)[1], blocks_of(src, SRC_BLOCKS)[1])
    assert not torch.equal(blocks_of(dst, DST_BLOCKS)[0], blocks_of(src, SRC_BLOCKS)[0])  # only layer 1 moved
    for bad in ([0, 1], [12, 1, 2, 3, 4, 5]):
        with pytest.raises(ValueError):
            write_descs(layout, 0, CacheRegion.of(src), np.array(bad), CacheRegion.of(dst), np.array(DST_BLOCKS))


def _bytes_at(cache: PagedKVCache, addr: int, n: int) -> torch.Tensor:
    flat = cache.data.view(-1).view(torch.uint8)
    offset = addr - cache.data.data_ptr()
    assert 0 <= offset and offset + n <= flat.numel()
    return flat[offset : offset + n]


def test_checksums_agree_on_equal_blocks_and_catch_a_flip_a_stale_block_and_a_swap():
    src, dst = random_cache(12, 0), random_cache(32, 1)
    dst.data[:, :, :, DST_BLOCKS] = src.data[:, :, :, SRC_BLOCKS]
    sums = [layer_checksum(src, layer, SRC_BLOCKS) for layer in range(SPEC.num_layers)]
    assert [layer_checksum(dst, layer, DST_BLOCKS) for layer in range(SPEC.num_layers)] == sums
    assert len(set(sums)) == 3
    swapped = [DST_BLOCKS[1], DST_BLOCKS[0], *DST_BLOCKS[2:]]
    assert layer_checksum(dst, 0, swapped) != sums[0]
    dst.data[2, 1, 1, 7].view(-1).view(torch.int16)[5] ^= 1  # one bit of V, head 1, block 7 (5th of the request)
    assert layer_checksum(dst, 2, DST_BLOCKS) != sums[2]
    assert layer_checksum(dst, 1, DST_BLOCKS) == sums[1]
    dst.data[0, :, :, 30] = 0  # the last block never written
    assert layer_checksum(dst, 0, DST_BLOCKS) != sums[0]
    assert runs(np.array(SRC_BLOCKS))[1].tolist() == [3, 2, 1]


@pytest.mark.parametrize("ids", [[5], list(range(1, 30)), list(range(1, 32, 2)), SRC_BLOCKS], ids=str)
def test_the_torch_checksum_of_gpu_caches_equals_the_numpy_one(ids):
    from common.kv_transfer.blocks import _numpy_checksum, _torch_checksum

    cache = random_cache(32, 2)
    words = cache.data.view(*cache.data.shape[:4], -1).view(torch.uint8).view(torch.int64)[1]
    assert _torch_checksum(words, np.array(ids)) == _numpy_checksum(words.numpy(), np.array(ids))


# -- over NIXL ---------------------------------------------------------------------------------------------------


@pytest.fixture
def pair():
    src, dst = random_cache(12, 0), random_cache(32, 1)
    receiver = nixl.NixlKVReceiver(kv_cache=dst)
    sender = nixl_blocks.NixlBlockSender(receiver.metadata, src)
    yield sender, receiver, src, dst
    sender.close()
    receiver.close()


def expect(receiver, request_id: str, block_ids: list[int], deadline_s: float = 20.0) -> KVBuffer:
    buffer = KVBuffer()
    receiver.expect(request_id, SPEC.num_layers, len(block_ids), SPEC, buffer.write, deadline_s=deadline_s)
    assert receiver.offer_blocks(request_id, block_ids)
    return buffer


def send(sender, request_id: str, src_ids: list[int], dst_ids: list[int], num_layers: int = SPEC.num_layers):
    sender.claim(request_id, dst_ids, SPEC.num_layers)
    for layer in range(num_layers):
        sender.send_blocks(request_id, layer, src_ids)


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    until = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < until:
        time.sleep(0.01)
    return predicate()


@needs_nixl
def test_two_requests_land_bit_for_bit_in_the_reserved_blocks(pair):
    sender, receiver, src, dst = pair
    other_src, other_dst = [0, 1], [0, 31]
    buffers = [expect(receiver, "req-A", DST_BLOCKS), expect(receiver, "req-B", other_dst)]
    untouched = dst.data.clone()
    sender.claim("req-A", DST_BLOCKS, SPEC.num_layers)
    sender.claim("req-B", other_dst, SPEC.num_layers)
    for layer in range(SPEC.num_layers):  # interleaved, as two prompts' layers come out of one step
        sender.send_blocks("req-A", layer, SRC_BLOCKS)
        sender.send_blocks("req-B", layer, other_src)
    layout = CacheLayout.of(src)
    for rid, n in (("req-A", len(SRC_BLOCKS)), ("req-B", 2)):
        sent, got = sender.finish(rid, timeout_s=20.0), receiver.wait(rid, timeout_s=20.0)
        payload = SPEC.num_layers * layout.layer_bytes(n)
        assert (sent.state, sent.num_bytes, sent.error) == (TransferState.DONE, payload, "")
        assert (got.state, got.num_bytes, got.error) == (TransferState.DONE, payload, "")
    assert torch.equal(blocks_of(dst, DST_BLOCKS), blocks_of(src, SRC_BLOCKS))
    assert torch.equal(blocks_of(dst, other_dst), blocks_of(src, other_src))
    others = [b for b in range(32) if b not in DST_BLOCKS + other_dst]
    outside = dst.data[:, :, :, others].view(torch.int16)
    assert torch.equal(outside, untouched[:, :, :, others].view(torch.int16))  # no byte beyond the reservations
    assert all(not buffer.writes for buffer in buffers)  # nothing went through the arena path
    assert not receiver.writing("req-A") and not receiver.writing("req-B")


@needs_nixl
def test_a_corrupt_layer_fails_both_sides_with_a_checksum_error(pair):
    sender, receiver, src, dst = pair
    expect(receiver, "req-C", DST_BLOCKS)
    sender.corrupt_next_layer = True
    send(sender, "req-C", SRC_BLOCKS, DST_BLOCKS)
    sent, got = sender.finish("req-C", timeout_s=20.0), receiver.wait("req-C", timeout_s=20.0)
    assert got.error == "KV of request 'req-C': checksum mismatch in layer 0 after its NIXL write"
    assert (sent.state, sent.error) == (TransferState.FAILED, got.error)
    assert wait_until(lambda: not receiver.writing("req-C"), timeout_s=5.0)  # the sender's quiet came


@needs_nixl
def test_claims_that_do_not_fit_a_reservation_are_refused(pair):
    sender, receiver, _, _ = pair
    send(sender, "ghost", SRC_BLOCKS, DST_BLOCKS)
    assert sender.finish("ghost", timeout_s=10.0).error == ("no KV reservation for request 'ghost' (never made, "
                                                            "aborted, or already received)")  # fmt: skip
    expect(receiver, "req-W", DST_BLOCKS)
    send(sender, "req-W", SRC_BLOCKS, [0, 1, 2, 3, 4, 5])
    error = sender.finish("req-W", timeout_s=10.0).error
    assert error == "blocks claimed for request 'req-W' are not the ones reserved"
    assert not receiver.writing("req-W")
    with pytest.raises(ValueError, match="a claim needs block ids and 3 layers, got 0 blocks, 3 layers"):
        sender.claim("req-E", [], SPEC.num_layers)


@needs_nixl
def test_a_deadline_passed_holds_the_blocks_until_the_sender_is_quiet(pair):
    sender, receiver, _, _ = pair
    expect(receiver, "req-D", DST_BLOCKS, deadline_s=0.5)
    send(sender, "req-D", SRC_BLOCKS, DST_BLOCKS, num_layers=1)  # the prompt's other layers never come
    assert wait_until(lambda: receiver.writing("req-D"))  # granted
    result = receiver.wait("req-D", timeout_s=30.0)
    assert result.error.startswith("KV of request 'req-D' missed its 0.5s deadline")
    assert sender.finish("req-D", timeout_s=5.0).error == result.error  # the receiver told the sender
    assert wait_until(lambda: not receiver.writing("req-D"), timeout_s=5.0)  # ... which said quiet


@needs_nixl
def test_a_sender_abort_and_its_quiet_free_the_blocks(pair):
    sender, receiver, _, _ = pair
    expect(receiver, "req-S", DST_BLOCKS)
    send(sender, "req-S", SRC_BLOCKS, DST_BLOCKS, num_layers=2)
    assert wait_until(lambda: receiver.writing("req-S"))
    sender.abort("req-S")
    assert sender.finish("req-S", timeout_s=1.0).error == "request 'req-S' aborted by sender"
    assert receiver.wait("req-S", timeout_s=5.0).error == "request 'req-S' aborted by sender"
    assert wait_until(lambda: not receiver.writing("req-S"), timeout_s=5.0)


@needs_nixl
def test_a_receiver_abort_holds_the_blocks_while_the_sender_may_write(pair):
    sender, receiver, _, _ = pair
    expect(receiver, "req-R", DST_BLOCKS)
    send(sender, "req-R", SRC_BLOCKS, DST_BLOCKS, num_layers=1)
    assert wait_until(lambda: receiver.writing("req-R"))
    receiver.abort("req-R")  # the decode worker gave up (client gone): the sender hears of it, then says quiet
    assert sender.finish("req-R", timeout_s=5.0).error == "request 'req-R' aborted by receiver"
    assert wait_until(lambda: not receiver.writing("req-R"), timeout_s=5.0)


@needs_nixl
def test_a_silent_granted_sender_holds_the_blocks_until_the_deadline_and_grace(monkeypatch, pair):
    sender, receiver, _, _ = pair
    monkeypatch.setattr(nixl_landing, "GRANT_GRACE_S", 1.0)
    expect(receiver, "req-Q", DST_BLOCKS, deadline_s=1.0)
    send(sender, "req-Q", SRC_BLOCKS, DST_BLOCKS, num_layers=1)
    assert wait_until(lambda: receiver.writing("req-Q"))  # granted
    monkeypatch.setattr(sender, "_send", lambda msg: None)  # from now on the sender says nothing (as if hung)
    assert receiver.wait("req-Q", timeout_s=10.0).state is TransferState.FAILED  # its deadline
    assert receiver.writing("req-Q")  # no quiet came: the blocks are held past the deadline ...
    assert wait_until(lambda: not receiver.writing("req-Q"), timeout_s=5.0)  # ... for the grace


@needs_nixl
def test_one_endpoint_serves_two_decode_workers_and_takes_one_channel_per_worker():
    src = random_cache(12, 0)
    endpoint = nixl_blocks.BlockEndpoint(src)  # one agent, the cache registered once
    caches = [random_cache(32, 1), random_cache(32, 2)]
    receivers = [nixl.NixlKVReceiver(kv_cache=cache) for cache in caches]
    senders = [nixl_blocks.NixlBlockSender(r.metadata, endpoint) for r in receivers]
    try:
        assert senders[0].name == senders[1].name == endpoint.name
        for i, (sender, receiver) in enumerate(zip(senders, receivers, strict=True)):
            expect(receiver, f"req-{i}", DST_BLOCKS)
            sender.claim(f"req-{i}", DST_BLOCKS, SPEC.num_layers)
        for layer in range(SPEC.num_layers):  # interleaved: each channel gets its own receiver's notes
            for i, sender in enumerate(senders):
                sender.send_blocks(f"req-{i}", layer, SRC_BLOCKS if i == 0 else SRC_BLOCKS[::-1])
        for i, (sender, receiver) in enumerate(zip(senders, receivers, strict=True)):
            assert sender.finish(f"req-{i}", timeout_s=20.0).ok and receiver.wait(f"req-{i}", timeout_s=5.0).ok
        assert torch.equal(blocks_of(caches[0], DST_BLOCKS), blocks_of(src, SRC_BLOCKS))
        assert torch.equal(blocks_of(caches[1], DST_BLOCKS), blocks_of(src, SRC_BLOCKS[::-1]))

        with pytest.raises(ConnectionError, match="a NIXL KV block channel to .* is still open"):
            nixl_blocks.NixlBlockSender(receivers[0].metadata, endpoint, connect_timeout_s=0.2)
        senders[0].close()  # a new channel to that worker after it; the other channel is not disturbed
        senders[0] = nixl_blocks.NixlBlockSender(receivers[0].metadata, endpoint)
        for i, (sender, receiver) in enumerate(zip(senders, receivers, strict=True)):
            expect(receiver, f"again-{i}", DST_BLOCKS)
            send(sender, f"again-{i}", SRC_BLOCKS, DST_BLOCKS)
            assert sender.finish(f"again-{i}", timeout_s=20.0).ok and receiver.wait(f"again-{i}", timeout_s=5.0).ok
    finally:
        for sender in senders:
            sender.close()
        for receiver in receivers:
            receiver.close()
        endpoint.close()


@needs_nixl
def test_a_receiver_without_a_cache_or_of_another_layout_refuses_blocks():
    plain = nixl.NixlKVReceiver()
    other = nixl.NixlKVReceiver(kv_cache=PagedKVCache(KVCacheSpec(3, 2, 32, 8, torch.bfloat16), 4))
    try:
        with pytest.raises(nixl_blocks.BlocksRefused, match="this KV receiver takes no direct block writes"):
            nixl_blocks.NixlBlockSender(plain.metadata, random_cache(4, 0))
        with pytest.raises(nixl_blocks.BlocksRefused, match="differs from CacheLayout"):
            nixl_blocks.NixlBlockSender(other.metadata, random_cache(4, 0))
        assert not plain.offer_blocks("req", [0]) and not plain.writing("req")
        arena = nixl.NixlKVSender(other.metadata, arena_bytes=1 << 16, max_chunk_bytes=1 << 12)  # arenas still work
        arena.close()
    finally:
        plain.close()
        other.close()


@needs_nixl
def test_a_cache_nixl_cannot_register_leaves_arenas_only(monkeypatch, caplog):
    """A UCX build without GPU memory support refuses a CUDA cache: the receiver starts with arenas only."""

    def refused(*args, **kwargs):
        raise RuntimeError("NIXL_ERR_NOT_SUPPORTED: no backend for VRAM_SEG")

    monkeypatch.setattr(nixl, "BlockLanding", refused)
    receiver = nixl.NixlKVReceiver(kv_cache=random_cache(4, 0))
    try:
        assert receiver.blocks is None and "arenas only" in caplog.text
        with pytest.raises(nixl_blocks.BlocksRefused, match="this KV receiver takes no direct block writes"):
            nixl_blocks.NixlBlockSender(receiver.metadata, random_cache(4, 1))
        nixl.NixlKVSender(receiver.metadata, arena_bytes=1 << 16, max_chunk_bytes=1 << 12).close()
    finally:
        receiver.close()


@needs_nixl
def test_the_setting_is_0_or_1(monkeypatch):
    assert nixl_blocks.blocks_enabled()
    monkeypatch.setenv(nixl_blocks.BLOCKS_ENV, "0")
    assert not nixl_blocks.blocks_enabled()
    monkeypatch.setenv(nixl_blocks.BLOCKS_ENV, "no")
    with pytest.raises(ValueError, match="PDSERVE_NIXL_BLOCKS must be 0 or 1, got 'no'"):
        nixl_blocks.blocks_enabled()
    from services.decode.main import make_parts as decode_parts
    from services.prefill.main import make_parts as prefill_parts
    from services.worker.config import WorkerConfig

    for make_parts, flags, flag in ((decode_parts, {"kv_nixl": True}, "--kv-nixl"),
                                    (prefill_parts, {"kv_transport": "nixl"}, "--kv-transport nixl")):  # fmt: skip
        with pytest.raises(SystemExit) as exc:  # a worker asked for NIXL refuses to start, naming the value
            make_parts(WorkerConfig(model="unused", **flags))
        assert str(exc.value) == f"{flag}: PDSERVE_NIXL_BLOCKS must be 0 or 1, got 'no'"


def _receive_in_child(conn) -> None:
    """Child process: a decode cache behind a receiver; one request received into DST_BLOCKS, bytes sent back."""
    cache = random_cache(32, 1)
    receiver = nixl.NixlKVReceiver(kv_cache=cache)
    expect(receiver, "req-A", DST_BLOCKS)
    conn.send(receiver.metadata)
    result = receiver.wait("req-A", timeout_s=20.0)
    conn.send((result.state.value, result.error, blocks_of(cache, DST_BLOCKS).numpy().tobytes()))
    conn.recv()
    receiver.close()


@needs_nixl
def test_two_processes_move_the_blocks_bit_for_bit():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive_in_child, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(60)
    src = random_cache(12, 0)
    sender = nixl_blocks.NixlBlockSender(parent.recv(), src)
    send(sender, "req-A", SRC_BLOCKS, DST_BLOCKS)
    result = sender.finish("req-A", timeout_s=20.0)
    state, error, received = parent.recv()
    sender.close()
    parent.send("bye")
    proc.join(20)
    assert (result.state, result.error) == (TransferState.DONE, "")
    assert (state, error) == ("done", "")
    assert received == blocks_of(src, SRC_BLOCKS).numpy().tobytes()
    assert proc.exitcode == 0


@needs_nixl
def test_a_receiver_gone_silent_breaks_the_channel_but_a_long_prefill_does_not(monkeypatch):
    """The lost-link watch (``stall_s``): a receiver silent while the sender awaits a grant, or the confirmation of
    a request whose layers all went, breaks the channel past ``stall_s``; a granted request whose layers the
    engine is still computing awaits nothing of the receiver, however long that takes."""
    src, dst = random_cache(12, 0), random_cache(32, 1)
    receiver = nixl.NixlKVReceiver(kv_cache=dst)
    endpoint = nixl_blocks.BlockEndpoint(src)
    try:
        sender = nixl_blocks.NixlBlockSender(receiver.metadata, endpoint, stall_s=0.3)
        expect(receiver, "req-slow", DST_BLOCKS)
        sender.claim("req-slow", DST_BLOCKS, SPEC.num_layers)
        assert wait_until(lambda: receiver.writing("req-slow"))  # granted
        time.sleep(1.0)  # the prompt's layers take a while
        for layer in range(SPEC.num_layers):
            sender.send_blocks("req-slow", layer, SRC_BLOCKS)
        assert sender.finish("req-slow", timeout_s=10.0).state is TransferState.DONE
        assert not sender.broken

        for what, deaf_after_grant in (("its grant", False), ("its confirmation", True)):
            rid = f"req-{what.split()[1]}"
            expect(receiver, rid, [0, 1])
            if not deaf_after_grant:
                monkeypatch.setattr(receiver, "_on_note", lambda name, msg: None)
            start = time.monotonic()
            sender.claim(rid, [0, 1], SPEC.num_layers)
            if deaf_after_grant:  # the writes go (one-sided), their note and the answer do not
                assert wait_until(lambda rid=rid: receiver.writing(rid))
                monkeypatch.setattr(receiver, "_on_note", lambda name, msg: None)
                for layer in range(SPEC.num_layers):
                    sender.send_blocks(rid, layer, [3, 4])
            result = sender.finish(rid, timeout_s=20.0)
            assert result.state is TransferState.FAILED and time.monotonic() - start < 3.0, result
            assert "silent for" in result.error and f"awaited {what}" in result.error, result.error
            assert sender.broken == result.error
            sender.close()
            monkeypatch.undo()
            sender = nixl_blocks.NixlBlockSender(receiver.metadata, endpoint, stall_s=0.3)  # a new channel works
    finally:
        sender.close()
        receiver.close()
        endpoint.close()
