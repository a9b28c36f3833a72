"""KV between two processes over shared memory (common.kv_transfer.shm, target >= 4 GB/s) or NIXL (``--transport
nixl``: common.kv_transfer.nixl, UCX between the two processes' agents, through arenas; ``--transport nixl-blocks``:
common.kv_transfer.nixl_blocks, from one KV cache's blocks straight into the other's).

    python benchmarks/kv_shm_throughput.py [--transport shm|nixl|nixl-blocks] [--total-mib 256] [--max-chunk-mib 4]
                                           [--arena-mib 64] [--fragmented | --stretch K]

Moves bf16 KV (32 layers, random bits: the transfer must be bit-exact) to a spawned receiver process several
times and prints each round's rate and the median of the warm rounds (the last line: ``median X GB/s``).
``--fragmented``: the blocks on both sides are scattered (no two consecutive), as in a long-running worker's cache
under ``--kv-block-placement lru``; ``--stretch K``: in stretches of K consecutive blocks, scattered (what
``benchmarks/block_placement.py`` reports for a busy worker). Only the block transport cares.
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.engine.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from common.kv_transfer.shm import ShmKVReceiver, ShmKVSender  # noqa: E402


def _block_ids(num_blocks: int, stretch: int, seed: int) -> list[int]:
    """Block ids of a request in a cache of ``2 * num_blocks + 1`` blocks: consecutive (``stretch`` 0), or in
    stretches of ``stretch`` consecutive blocks, one free block after each, the stretches in random order."""
    if not stretch:
        return list(range(1, num_blocks + 1))
    num_stretches = -(-num_blocks // stretch)
    order = torch.randperm(num_stretches, generator=torch.Generator().manual_seed(seed)).tolist()
    ids = [slot * (stretch + 1) + 1 + i for slot in order for i in range(stretch)]
    return [b for b in ids if b < 2 * num_blocks + 1][:num_blocks]


def _bench_block_receiver(spec: KVCacheSpec, num_blocks: int, num_rounds: int, stretch: int, conn) -> None:
    """Child process: ``num_rounds`` requests written by NIXL into reserved blocks of its KV cache; report each."""
    from common.kv_transfer.nixl import NixlKVReceiver

    torch.set_num_threads(1)
    cache = PagedKVCache(spec, 2 * num_blocks + 1)
    receiver = NixlKVReceiver(kv_cache=cache)
    conn.send(receiver.metadata)
    block_ids = _block_ids(num_blocks, stretch, seed=1)
    for i in range(num_rounds):
        cache.data.zero_()
        receiver.expect(f"bench-{i}", spec.num_layers, num_blocks, spec, lambda *a: None, deadline_s=120.0)
        receiver.offer_blocks(f"bench-{i}", block_ids)
        conn.send(("ready", block_ids))
        result = receiver.wait(f"bench-{i}", timeout_s=120.0)
        conn.send((result.ok, result.num_bytes, result.seconds, result.error, _crc(cache.data[:, :, :, block_ids])))
    receiver.close()


def _bench_receiver(transport: str, address: str, spec: KVCacheSpec, num_blocks: int, num_rounds: int,
                    conn) -> None:  # fmt: skip
    """Child process: receive ``num_rounds`` requests into one KV buffer, one at a time; report each."""
    torch.set_num_threads(1)  # see bench()
    if transport == "nixl":
        from common.kv_transfer.nixl import NixlKVReceiver

        receiver = NixlKVReceiver()
        conn.send(receiver.metadata)
    else:
        receiver = ShmKVReceiver(address)
    kv = torch.zeros((spec.num_layers, 2, *spec.block_shape(num_blocks)), dtype=spec.dtype)  # [L, 2, n, bs, H, D]

    def write(layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kv[layer, 0, first_block : first_block + k.shape[0]].copy_(k)
        kv[layer, 1, first_block : first_block + k.shape[0]].copy_(v)

    for i in range(num_rounds):
        receiver.expect(f"bench-{i}", spec.num_layers, num_blocks, spec, write, deadline_s=120.0)
        conn.send("ready")
        result = receiver.wait(f"bench-{i}", timeout_s=120.0)
        conn.send((result.ok, result.num_bytes, result.seconds, result.error, _crc(kv)))
    receiver.close()


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))


def bench_blocks(total_mib: int = 256, num_rounds: int = 5, stretch: int = 0) -> None:
    """Move ``total_mib`` of bf16 KV from one process's cache blocks into another's by NIXL block writes."""
    import multiprocessing

    from common.kv_transfer.nixl_blocks import NixlBlockSender

    torch.set_num_threads(1)  # see bench()
    spec, num_blocks = _spec(total_mib)
    cache = PagedKVCache(spec, 2 * num_blocks + 1)
    cache.data.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, cache.data.shape, dtype=torch.int16))
    src_ids = _block_ids(num_blocks, stretch, seed=0)
    expected_crc = _crc(cache.data[:, :, :, src_ids])
    num_bytes = cache.data[:, :, :, src_ids].numel() * cache.data.element_size()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_bench_block_receiver, args=(spec, num_blocks, num_rounds, stretch, child))
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("benchmark receiver did not start")
        sender = NixlBlockSender(parent.recv(), cache)
        layout = f"stretches of {stretch}" if stretch > 1 else "scattered" if stretch else "consecutive"
        print(f"nixl-blocks: moving {num_bytes / 2**20:.0f} MiB ({spec.num_layers} layers x {num_blocks} blocks, "
              f"bf16, {layout} blocks) cache to cache, {num_rounds} rounds")  # fmt: skip
        rates = []
        for i in range(num_rounds):
            if not parent.poll(60):
                raise RuntimeError("benchmark receiver stopped")
            _, dst_ids = parent.recv()
            start = time.perf_counter()
            sender.claim(f"bench-{i}", dst_ids, spec.num_layers)
            for layer in range(spec.num_layers):
                sender.send_blocks(f"bench-{i}", layer, src_ids)
            result = sender.finish(f"bench-{i}", timeout_s=120.0)
            rates.append(_report(i, "claim", num_bytes, time.perf_counter() - start, result, parent.recv(),
                                 expected_crc))  # fmt: skip
        sender.close()
        _print_median(rates)
    finally:
        proc.join(10)


def _report(i: int, started_by: str, num_bytes: int, seconds: float, result, reply: tuple, expected_crc: int) -> float:
    """Print one round (the sender's result, the receiver's ``reply``); its rate in GB/s, the sender's view."""
    ok, n, receiver_s, error, crc = reply
    status = "ok" if result.ok and ok else result.error or error
    print(f"  round {i}: {status}; sender {num_bytes / seconds / 1e9:.2f} GB/s ({started_by} -> finish),"
          f" receiver {n / receiver_s / 1e9:.2f} GB/s (expect -> done), bit-exact {crc == expected_crc}")
    return num_bytes / seconds / 1e9


def _print_median(rates: list[float]) -> None:
    warm = rates[1:] or rates
    print(f"median {sorted(warm)[len(warm) // 2]:.2f} GB/s (warm rounds)")


def _spec(total_mib: int) -> tuple[KVCacheSpec, int]:
    """The benchmark's cache layout (32 layers, block size 16, 8 KV heads, head_dim 128, bf16) and how many blocks
    hold ``total_mib``."""
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    return spec, max(1, (total_mib << 20) // (2 * spec.num_layers * 16 * 8 * 128 * 2))


def bench(total_mib: int = 256, max_chunk_mib: int = 4, arena_mib: int = 64, num_rounds: int = 5,
          transport: str = "shm") -> None:
    """Move ``total_mib`` of bf16 KV (32 layers, K and V) to another process ``num_rounds`` times; print GB/s."""
    import multiprocessing
    import shutil
    import tempfile

    # One intra-op thread per process: the two processes share the machine's cores, and torch's idle OpenMP
    # threads spin, stealing the other process's core (measured on 2 cores: 0.3-1.2 GB/s instead of ~2.5;
    # OMP_WAIT_POLICY=PASSIVE helps as much).
    torch.set_num_threads(1)

    spec, num_blocks = _spec(total_mib)
    num_layers = spec.num_layers
    layers = torch.randint(-(2**15), 2**15, (num_layers, 2, *spec.block_shape(num_blocks)), dtype=torch.int16)
    layers = layers.view(torch.bfloat16)  # random bits, NaNs included: the transfer must be bit-exact
    num_bytes = layers.numel() * layers.element_size()
    address = os.path.join(tempfile.mkdtemp(prefix="pdkv-"), "bench.sock")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_bench_receiver, args=(transport, address, spec, num_blocks, num_rounds, child))
    proc.start()
    try:
        metadata = parent.recv() if transport == "nixl" and parent.poll(60) else b""
        if not parent.poll(60) or parent.recv() != "ready":
            raise RuntimeError("benchmark receiver did not start")  # (its first "ready")
        if transport == "nixl":
            from common.kv_transfer.nixl import NixlKVSender

            sender = NixlKVSender(metadata, arena_bytes=arena_mib << 20, max_chunk_bytes=max_chunk_mib << 20)
        else:
            sender = ShmKVSender(address, arena_bytes=arena_mib << 20, max_chunk_bytes=max_chunk_mib << 20)
        print(f"{transport}: moving {num_bytes / 2**20:.0f} MiB ({num_layers} layers x {num_blocks} blocks, bf16) "
              f"in chunks of <= {max_chunk_mib} MiB through a {arena_mib} MiB arena, {num_rounds} rounds")  # fmt: skip
        expected_crc = _crc(layers)
        rates = []  # GB/s per round
        for i in range(num_rounds):
            if i and parent.recv() != "ready":
                raise RuntimeError("benchmark receiver stopped")
            start = time.perf_counter()
            for layer in range(num_layers):
                sender.send_layer(f"bench-{i}", layer, layers[layer, 0], layers[layer, 1])
            result = sender.finish(f"bench-{i}", timeout_s=120.0)
            rates.append(_report(i, "first send_layer", num_bytes, time.perf_counter() - start, result,
                                 parent.recv(), expected_crc))  # fmt: skip
        sender.close()
        _print_median(rates)
    finally:
        proc.join(10)
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--max-chunk-mib", type=int, default=4)
    parser.add_argument("--arena-mib", type=int, default=64)
    parser.add_argument("--transport", choices=("shm", "nixl", "nixl-blocks"), default="shm")
    parser.add_argument("--fragmented", action="store_true", help="the same as --stretch 1")
    parser.add_argument("--stretch", type=int, default=0, help="consecutive blocks per stretch (0: all)")
    args = parser.parse_args()
    if args.transport == "nixl-blocks":
        bench_blocks(args.total_mib, stretch=1 if args.fragmented else args.stretch)
    else:
        bench(args.total_mib, args.max_chunk_mib, args.arena_mib, transport=args.transport)
