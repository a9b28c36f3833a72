"""The measurements of ``benchmarks/gpu_check.py``: one function per section after setup.

Each takes the running check (its engine, stock model, counts, device and prompt generator; see
``gpu_check.GpuCheck``) and fills one ``gpu_check.Section``: ``text`` (the table row), ``values`` (numbers
only), ``info`` (anything else) and, for the serving targets, ``targets`` with PASS/FAIL. Engine figures are
in-process: no gRPC, no router. Timings synchronize the device before reading the clock.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

GB = 1e9
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
TTFT_TARGET_S = 0.5  # 16 concurrent chat-length prompts: the worst time to first token
SHORT_RPS_TARGET = 100.0  # short requests (64-token prompt, 16 new tokens) completed per second
STREAM_TOK_S_TARGET = 50.0  # tokens/s of the slowest of 16 streams, after its first token
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # added to 2x stock's own error


class SectionError(RuntimeError):
    """A section cannot run or its result is wrong; the message says what."""


@dataclass
class Timeline:
    """When each request's tokens came out of ``engine.step`` (perf_counter seconds)."""

    t0: float  # all requests submitted from here
    token_times: dict[str, list[float]]  # request id -> one time per token
    steps: list[tuple[float, int]] = field(default_factory=list)  # (end of step, tokens it produced)
    end: float = 0.0

    def decode_tok_s(self) -> float:
        """Tokens/s of the steps after every request had its first token (decode steps only)."""
        all_first = max(times[0] for times in self.token_times.values())
        after = [(t, n) for t, n in self.steps if t > all_first]
        if not after:
            raise SectionError("no decode step after the last first token: raise the number of new tokens")
        return sum(n for _, n in after) / (after[-1][0] - all_first)


def timed_run(ck, prompts: list[list[int]], max_new: int, engine=None) -> Timeline:
    """Submit every prompt at once (greedy, EOS ignored), step the engine (default: the check's) to the end, note
    each token's time. A step that raises aborts the run's requests first: the sections after it find the engine
    empty."""
    engine = engine or ck.engine
    t0 = time.perf_counter()
    ids = [engine.add_request(p, ck.greedy(max_new)) for p in prompts]
    tl = Timeline(t0, {rid: [] for rid in ids})
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                tl.token_times[out.request_id].extend([now] * len(out.new_token_ids))
            tl.steps.append((now, sum(len(out.new_token_ids) for out in outputs)))
    except BaseException:
        for rid in ids:
            engine.abort(rid)
        raise
    tl.end = time.perf_counter()
    return tl


# -- oracle ---------------------------------------------------------------------------------------------------


def oracle(ck, s) -> None:
    """Engine greedy vs stock ``generate`` (same weights and dtype), and first-step logits against fp32."""
    engine, stock, c, dev = ck.engine, ck.stock, ck.counts, ck.device
    prompts = [ck.prompts(1, n)[0] for n in c.oracle_lens]
    fp32 = ck.fp32_model()
    engine_logits = [engine_first_logits(ck, p) for p in prompts]
    stock_logits = [last_logits(stock, p, dev) for p in prompts]
    ref_logits = stock_logits if fp32 is stock else [last_logits(fp32, p, dev) for p in prompts]
    diff = max(float((e - st).abs().max()) for e, st in zip(engine_logits, stock_logits))
    stock_err = max(float((st - r).abs().max()) for st, r in zip(stock_logits, ref_logits))
    engine_err = max(float((e - r).abs().max()) for e, r in zip(engine_logits, ref_logits))
    tol = 2 * stock_err + LOGIT_ATOL[ck.dtype]
    results = engine.generate(prompts, ck.greedy(c.oracle_new))  # one batch; stock: one prompt at a time
    divergences, gaps, compared, agreeing = [], [], 0, 0
    for prompt, res in zip(prompts, results):
        expected = stock_greedy(stock, prompt, c.oracle_new, dev)
        n = min(len(expected), len(res.token_ids))  # stock stops at EOS, the engine ignores it
        first = next((i for i in range(n) if expected[i] != res.token_ids[i]), None)
        compared += n
        agreeing += n if first is None else first
        divergences.append(first)
        if first is not None:  # stock's own logits at that step: how far apart were the two tokens?
            logits = last_logits(stock, prompt + expected[:first], dev)
            gaps.append(abs(float(logits[expected[first]] - logits[res.token_ids[first]])))
    near_ties = all(gap <= 2 * tol for gap in gaps)  # two logits, each off by up to tol, can swap within 2 tol
    ok = diff <= tol and near_ties
    s.values = {"num_prompts": len(prompts), "num_new_tokens": c.oracle_new, "num_tokens_compared": compared,
                "num_agreeing_tokens": agreeing, "num_divergent_prompts": sum(d is not None for d in divergences),
                "max_logit_diff": diff, "stock_vs_fp32": stock_err, "engine_vs_fp32": engine_err, "tolerance": tol,
                "max_divergence_gap": max(gaps, default=0.0)}  # fmt: skip
    s.info = {"first_divergence": divergences, "prompt_lens": list(c.oracle_lens), "divergence_gaps": gaps}
    s.targets.append({"name": "oracle", "value": diff, "unit": "logit", "target": f"<= {tol:.3g}", "pass": ok})
    shown = ", ".join("none" if d is None else str(d) for d in divergences)
    ties = ""
    if gaps:
        ties = (f"; divergences at near-ties of stock's logits (gaps {', '.join(f'{g:.3g}' for g in gaps)} <= "
                f"2 x tolerance): {'yes' if near_ties else 'NO'}")  # fmt: skip
    s.text = (f"{'PASS' if ok else 'FAIL'} {len(prompts)} prompts x {c.oracle_new} tokens, first divergence: {shown} "
              f"({agreeing}/{compared} tokens agree){ties}; first-step logits max|engine-stock| {diff:.3g} (tolerance "
              f"{tol:.3g}; stock vs fp32 {stock_err:.3g}, engine vs fp32 {engine_err:.3g})")  # fmt: skip


def engine_first_logits(ck, prompt: list[int]) -> torch.Tensor:
    """The float32 logits [V] the engine sampled the prompt's first token from."""
    runner = ck.engine.runner
    run = runner.run
    captured: list[torch.Tensor] = []

    def capture(batch):
        logits = run(batch)
        captured.append(logits.clone())
        return logits

    runner.run = capture  # an instance attribute over the method, deleted below
    try:
        ck.engine.generate([prompt], ck.greedy(1))
    finally:
        del runner.run
    return [c for c in captured if len(c)][-1][0]


@torch.inference_mode()
def last_logits(model, prompt: list[int], device: torch.device) -> torch.Tensor:
    """Stock forward of ``prompt``: float32 logits [V] of its last position."""
    ids = torch.tensor([prompt], device=device)
    try:
        out = model(input_ids=ids, logits_to_keep=1)
    except TypeError:  # a transformers without logits_to_keep
        out = model(input_ids=ids)
    logits = out.logits[0, -1].float()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return logits


@torch.inference_mode()
def stock_generate(model, prompt: list[int], max_new: int, device: torch.device, *, exact_length: bool) -> list[int]:
    """Stock greedy ``generate`` of one prompt; ``exact_length``: no stop at EOS (``min_new_tokens``)."""
    ids = torch.tensor([prompt], device=device)
    extra = {"min_new_tokens": max_new} if exact_length else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=model.generation_config.pad_token_id, **extra)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out[0, len(prompt) :].tolist()


def stock_greedy(model, prompt: list[int], max_new: int, device: torch.device) -> list[int]:
    return stock_generate(model, prompt, max_new, device, exact_length=False)


# -- throughput -----------------------------------------------------------------------------------------------


def prefill(ck, s) -> None:
    c = ck.counts
    n = min(c.prefill_len, ck.engine.max_model_len - 1)  # a model with a shorter context: its longest prompt
    engine_s, stock_s = [], []
    for prompt in ck.prompts(c.prefill_repeats, n):
        t = time.perf_counter()
        ck.engine.generate([prompt], ck.greedy(1))
        engine_s.append(time.perf_counter() - t)
        ck.sync()
        t = time.perf_counter()
        last_logits(ck.stock, prompt, ck.device)
        stock_s.append(time.perf_counter() - t)
    e, st = n / statistics.median(engine_s), n / statistics.median(stock_s)
    s.values = {"prompt_tokens": n, "engine_tok_s": e, "stock_tok_s": st, "engine_over_stock": e / st}
    s.text = (f"{n}-token prompt: engine {e:,.0f} tok/s, stock forward {st:,.0f} tok/s ({e / st:.2f}x; "
              f"median of {c.prefill_repeats})")  # fmt: skip


def decode(ck, s) -> None:
    c = ck.counts
    parts = []
    for batch in c.decode_batches:
        rate = timed_run(ck, ck.prompts(batch, c.decode_prompt), c.decode_new).decode_tok_s()
        s.values[f"batch_{batch}_tok_s"] = rate
        parts.append(f"batch {batch}: {rate:,.0f}")
    prompt = ck.prompts(1, c.decode_prompt)[0]

    def stock_s(n: int) -> float:
        t = time.perf_counter()
        stock_generate(ck.stock, prompt, n, ck.device, exact_length=True)
        return time.perf_counter() - t

    one = min(stock_s(1), stock_s(1))  # stock decode only: (time for n tokens - time for 1) / (n - 1)
    stock = (c.decode_new - 1) / max(stock_s(c.decode_new) - one, 1e-9)
    s.values["stock_batch_1_tok_s"] = stock
    b1 = s.values[f"batch_{c.decode_batches[0]}_tok_s"]
    s.text = (f"tok/s of decode steps, {c.decode_prompt}-token prompts, {c.decode_new} new: {', '.join(parts)}; "
              f"stock generate batch 1: {stock:,.0f} (engine {b1 / stock:.2f}x)")  # fmt: skip


def cuda_graphs(ck, s) -> None:
    """Decode steps with the engine's CUDA graphs (``EngineConfig.cuda_graphs``) against the decode section's
    eager figures: a second engine on the same weights with graphs on, its buckets captured by a first pass of the
    same workload, then timed; greedy tokens of both engines compared on a few prompts."""
    import dataclasses

    from common.engine.engine import LLMEngine

    c, eager = ck.counts, ck.engine
    engine = LLMEngine(eager.loaded, dataclasses.replace(eager.config, cuda_graphs=True))
    graphs = engine.runner.graphs
    try:
        t = time.perf_counter()
        for batch in c.decode_batches:  # captures the buckets these runs need
            timed_run(ck, ck.prompts(batch, c.decode_prompt), c.decode_new, engine=engine)
        s.values["capture_pass_s"] = time.perf_counter() - t
        parts = []
        for batch in c.decode_batches:
            rate = timed_run(ck, ck.prompts(batch, c.decode_prompt), c.decode_new, engine=engine).decode_tok_s()
            off = ck.sections_by_name["decode"].values.get(f"batch_{batch}_tok_s") if "decode" in ck.sections_by_name \
                else None  # fmt: skip
            s.values[f"batch_{batch}_tok_s"] = rate
            parts.append(f"batch {batch}: {rate:,.0f}" + (f" vs {off:,.0f} ({rate / off:.2f}x)" if off else ""))
        prompts = ck.prompts(4, c.decode_prompt)
        on = [r.token_ids for r in engine.generate(prompts, ck.greedy(c.decode_new))]
        off_ids = [r.token_ids for r in eager.generate(prompts, ck.greedy(c.decode_new))]
        agree = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(on, off_ids))
        total = sum(len(x) for x in off_ids)
        stats = graphs.stats()
        s.info.update(stats)
        s.values.update(captured=stats["captured"], graph_steps=stats["steps"], tokens_agree=agree,
                        tokens_compared=total)  # fmt: skip
        if not stats["enabled"]:
            raise SectionError(f"graphs switched off: {stats['disabled_because']}")
        s.text = (f"on vs off, tok/s of decode steps: {', '.join(parts)}; {stats['captured']} graphs captured "
                  f"(capture pass {s.values['capture_pass_s']:.1f} s), greedy tokens agree with eager {agree}/{total} "
                  f"(to each prompt's first difference)")  # fmt: skip
    finally:
        del engine


# -- KV transfer ----------------------------------------------------------------------------------------------


def kv_transfer(ck, s) -> None:
    """The sender's path (export, staging, encoding), the receiver's (check, write) and plain copies, in GB/s."""
    from common.kv_transfer.staging import to_host  # (no gRPC import: the GPU machine may lack grpcio)
    from common.kv_transfer.wire import DEFAULT_MAX_CHUNK_BYTES, TransferAssembler, iter_layer_chunks

    engine, c = ck.engine, ck.counts
    n = min(c.kv_prompt, engine.max_model_len - 2)
    rid = engine.add_request(ck.prompts(1, n)[0], ck.greedy(2), prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    ck.sync()
    t = time.perf_counter()
    handoff = engine.export_kv(rid)  # read_blocks of every layer: device copies, token-major
    ck.sync()
    extract_s = time.perf_counter() - t
    nbytes = handoff.num_bytes
    warm = [to_host(k, v) for k, v in handoff.layers]  # warm-up: every layer's pinned blocks allocated at once,
    del warm  # then back in torch's cache for the timed staging (one layer at a time would cache one layer's)
    t = time.perf_counter()
    staged = [to_host(k, v) for k, v in handoff.layers]  # then taken from torch's cache, as a worker's would be
    stage_s = time.perf_counter() - t
    del staged
    t = time.perf_counter()
    chunks: list[bytes] = []  # what a sender's thread does: stage each layer, encode it, build the messages
    for layer, (k, v) in enumerate(handoff.layers):
        last = layer == len(handoff.layers) - 1
        encoded = iter_layer_chunks(rid, layer, k, v, DEFAULT_MAX_CHUNK_BYTES, first_seq=len(chunks), last=last)
        chunks.extend(b"".join((chunk.header_buf, *chunk.payload_parts)) for chunk in encoded)
    encode_s = time.perf_counter() - t
    received = rid + "-received"  # the receiver: reserve, check and write each chunk, compare what landed
    blocks = engine.reserve_kv(received, handoff.num_kv_tokens, lease_s=60.0)
    try:
        assembler = TransferAssembler(rid, engine.kv_spec.num_layers, handoff.num_blocks, engine.kv_spec,
                                      lambda layer, first, k, v: engine.write_kv(received, layer, first, k, v))
        t = time.perf_counter()
        for chunk in chunks:
            assembler.feed(chunk)
        ck.sync()
        receive_s = time.perf_counter() - t
        landed = [engine.kv_cache.read_blocks(layer, blocks) for layer in range(engine.kv_spec.num_layers)]
        exact = assembler.complete and all(torch.equal(lk, k) and torch.equal(lv, v)
                                           for (lk, lv), (k, v) in zip(landed, handoff.layers))  # fmt: skip
        blocks_gb_s, blocks_note = nixl_blocks_bandwidth(ck, engine.kv_cache, blocks)  # from the landed copy
    finally:
        engine.release_kv(received)
    pinned, pageable = copy_bandwidth(ck, c.copy_bytes)
    nixl_gb_s, nixl_note = nixl_bandwidth(ck, c.copy_bytes)
    vals = {"kv_bytes": nbytes, "extract_gb_s": nbytes / extract_s / GB, "stage_gb_s": nbytes / stage_s / GB,
            "stage_encode_gb_s": nbytes / encode_s / GB, "sender_gb_s": nbytes / (extract_s + encode_s) / GB,
            "receive_gb_s": nbytes / receive_s / GB, "round_trip_exact": int(exact), "copy_pinned_gb_s": pinned,
            "copy_pageable_gb_s": pageable}  # fmt: skip
    if nixl_gb_s is not None:
        vals["nixl_write_gb_s"] = nixl_gb_s
    if blocks_gb_s is not None:
        vals["nixl_blocks_gb_s"] = blocks_gb_s
    s.info["nixl"] = nixl_note
    s.info["nixl_blocks"] = blocks_note
    s.values = vals
    g = {key: f"{value:.3g}" for key, value in vals.items()}  # GB/s to 3 significant digits
    host = f"to host {g['stage_gb_s']}" if ck.cuda else "to host: none (already there)"
    copies = (f"device->pinned {g['copy_pinned_gb_s']}, device->pageable {g['copy_pageable_gb_s']}" if ck.cuda
              else f"host memcpy {g['copy_pinned_gb_s']} (no device)")  # fmt: skip
    s.text = (f"{n}-token KV ({nbytes / MiB:.1f} MiB), GB/s: extract {g['extract_gb_s']}, {host}, to host+encode "
              f"{g['stage_encode_gb_s']}, sender total {g['sender_gb_s']}, receive+write {g['receive_gb_s']} (round "
              f"trip exact: {'yes' if exact else 'NO'}); plain {copies}; NIXL write {nixl_note}; NIXL block "
              f"writes {blocks_note}")  # fmt: skip
    if not exact:
        raise SectionError(f"the KV the receiver wrote differs from what was sent: {s.text}")


def copy_bandwidth(ck, nbytes: int) -> tuple[float, float]:
    """GB/s of device -> pinned and device -> pageable host copies (on the CPU: a host memcpy, twice)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=ck.device).random_()
    if ck.cuda:
        destinations = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch.empty(nbytes, dtype=torch.uint8)]
    else:
        destinations = [torch.empty_like(src)] * 2
    rates = []
    for dst in destinations:
        pinned = dst.is_pinned()
        dst.copy_(src, non_blocking=pinned)  # warm-up: the first touch of the pages
        ck.sync()
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=pinned)
        ck.sync()
        rates.append(3 * nbytes / (time.perf_counter() - t) / GB)
    return rates[0], rates[1]


def nixl_bandwidth(ck, nbytes: int) -> tuple[float | None, str]:
    """GB/s of one NIXL ``WRITE`` of ``nbytes`` between two agents of this process, memory on the check's device
    (VRAM to VRAM on CUDA: what a KV transport from device memory would get), best of 3, checked bit for bit;
    (None, why) where NIXL is not installed or the write fails."""
    from common.kv_transfer import nixl

    api = nixl.nixl_api()
    if api is None:
        return None, "n/a (NIXL not installed)"
    mem = "VRAM" if ck.cuda else "DRAM"
    try:
        a, b = (api.nixl_agent(f"gpu-check-{x}", api.nixl_agent_config(backends=["UCX"])) for x in "ab")
        src = torch.empty(nbytes, dtype=torch.uint8, device=ck.device).random_()
        dst = torch.zeros_like(src)
        a.register_memory(src)
        b.register_memory(dst)
        peer = a.add_remote_agent(b.get_agent_metadata())
        peer = peer.decode() if isinstance(peer, bytes) else peer
        local, remote = a.get_xfer_descs(src), b.get_xfer_descs(dst)
        best = float("inf")
        for _ in range(3):
            ck.sync()
            t = time.perf_counter()
            handle = a.initialize_xfer("WRITE", local, remote, peer)
            state = a.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = a.check_xfer_state(handle)
            a.release_xfer_handle(handle)
            if state == "ERR":
                return None, f"failed ({mem} to {mem}: the write ended in error)"
            best = min(best, time.perf_counter() - t)
        ck.sync()
        if not torch.equal(src, dst):
            return None, f"failed ({mem} to {mem}: the bytes differ)"
    except Exception as e:  # noqa: BLE001  (a NIXL build without this memory type, no UCX transport, ...)
        return None, f"failed ({mem} to {mem}: {e!r:.200})"
    rate = nbytes / best / GB
    return rate, f"{mem} to {mem} {rate:.3g} ({nbytes / MiB:.0f} MiB, two agents in one process)"


def nixl_blocks_bandwidth(ck, cache, block_ids: list[int]) -> tuple[float | None, str]:
    """GB/s of the NIXL block transport (common.kv_transfer.nixl_blocks: claim, one write per layer, checksums,
    done) moving ``block_ids`` of ``cache`` into another cache on the same device (VRAM to VRAM on CUDA), best of 3
    requests, checked bit for bit; (None, why) where NIXL is not installed or the transfer fails."""
    from common.engine.kv_cache import PagedKVCache
    from common.kv_transfer import nixl, nixl_blocks

    if nixl.nixl_api() is None:
        return None, "n/a (NIXL not installed)"
    mem = "VRAM" if ck.cuda else "DRAM"
    spec, n = cache.spec, len(block_ids)
    dst_ids = list(range(1, n + 1))
    receiver = sender = None
    try:
        dst = PagedKVCache(spec, n + 1, device=cache.data.device)
        receiver = nixl.NixlKVReceiver(kv_cache=dst)
        sender = nixl_blocks.NixlBlockSender(receiver.metadata, cache)
        best = float("inf")
        for i in range(3):
            rid = f"gpu-check-blocks-{i}"
            receiver.expect(rid, spec.num_layers, n, spec, lambda *args: None, deadline_s=60.0)
            receiver.offer_blocks(rid, dst_ids)
            ck.sync()
            t = time.perf_counter()
            sender.claim(rid, dst_ids, spec.num_layers)
            for layer in range(spec.num_layers):
                sender.send_blocks(rid, layer, block_ids)
            result = sender.finish(rid, timeout_s=60.0)
            if not result.ok:
                return None, f"failed ({mem} to {mem}: {result.error:.200})"
            best = min(best, time.perf_counter() - t)
            receiver.wait(rid, timeout_s=5.0)
        ck.sync()
        landed, sent = dst.data[:, :, :, dst_ids], cache.data[:, :, :, block_ids]
        if not torch.equal(landed.contiguous().view(torch.uint8), sent.contiguous().view(torch.uint8)):
            return None, f"failed ({mem} to {mem}: the blocks differ)"
    except Exception as e:  # noqa: BLE001  (a NIXL build without this memory type, no UCX transport, ...)
        return None, f"failed ({mem} to {mem}: {e!r:.200})"
    finally:
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()
    nbytes = spec.num_layers * 2 * spec.num_kv_heads * n * spec.block_size * spec.head_dim * cache.data.element_size()
    rate = nbytes / best / GB
    return rate, f"{mem} to {mem} {rate:.3g} ({nbytes / MiB:.1f} MiB in {n} blocks, cache to cache, one process)"


# -- serving targets ------------------------------------------------------------------------------------------


def _target(s, name: str, value: float, unit: str, target: str, ok: bool) -> str:
    s.targets.append({"name": name, "value": value, "unit": unit, "target": target, "pass": ok})
    return "PASS" if ok else "FAIL"


def ttft(ck, s) -> None:
    c = ck.counts
    tl = timed_run(ck, ck.prompts(c.ttft_requests, c.ttft_prompt), 16)
    ttfts = sorted(times[0] - tl.t0 for times in tl.token_times.values())
    worst, p50 = ttfts[-1], statistics.median(ttfts)
    s.values = {"requests": c.ttft_requests, "prompt_tokens": c.ttft_prompt, "ttft_p50_ms": p50 * 1e3,
                "ttft_max_ms": worst * 1e3}  # fmt: skip
    verdict = _target(s, "ttft_max", worst * 1e3, "ms", f"< {TTFT_TARGET_S * 1e3:.0f}", worst < TTFT_TARGET_S)
    s.text = (f"{verdict} {c.ttft_requests} concurrent {c.ttft_prompt}-token prompts: TTFT max {worst * 1e3:,.0f} ms, "
              f"p50 {p50 * 1e3:,.0f} ms (target < {TTFT_TARGET_S * 1e3:.0f} ms; {ck.model_desc})")  # fmt: skip


def short_requests(ck, s) -> None:
    c, running = ck.counts, ck.engine.config.max_num_seqs
    tl = timed_run(ck, ck.prompts(c.short_requests, c.short_prompt), c.short_new)
    rps = c.short_requests / (tl.end - tl.t0)
    s.values = {"requests": c.short_requests, "prompt_tokens": c.short_prompt, "new_tokens": c.short_new,
                "requests_per_s": rps, "max_num_seqs": running}  # fmt: skip
    verdict = _target(s, "short_requests_per_s", rps, "req/s", f"> {SHORT_RPS_TARGET:.0f}", rps > SHORT_RPS_TARGET)
    s.text = (f"{verdict} {c.short_requests} requests of {c.short_prompt} prompt + {c.short_new} new tokens, all at "
              f"once (up to {running} running): {rps:,.1f} requests/s (target > {SHORT_RPS_TARGET:.0f}; "
              f"{ck.model_desc})")  # fmt: skip


def stream_rate(ck, s) -> None:
    c = ck.counts
    tl = timed_run(ck, ck.prompts(c.streams, c.stream_prompt), c.stream_new)
    rates = sorted((len(t) - 1) / (t[-1] - t[0]) for t in tl.token_times.values())
    slowest, median = rates[0], statistics.median(rates)
    s.values = {"streams": c.streams, "new_tokens": c.stream_new, "min_tok_s": slowest, "median_tok_s": median}
    ok = slowest > STREAM_TOK_S_TARGET
    verdict = _target(s, "stream_tok_s_min", slowest, "tok/s", f"> {STREAM_TOK_S_TARGET:.0f}", ok)
    s.text = (f"{verdict} {c.streams} streams x {c.stream_new} tokens: slowest {slowest:,.1f} tok/s, median "
              f"{median:,.1f} after the first token (target > {STREAM_TOK_S_TARGET:.0f}; {ck.model_desc})")  # fmt: skip


SECTIONS = {"oracle": oracle, "prefill": prefill, "decode": decode, "cuda_graphs": cuda_graphs,
            "kv_transfer": kv_transfer, "ttft": ttft, "short_requests": short_requests,
            "stream_rate": stream_rate}  # fmt: skip
