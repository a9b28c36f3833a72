"""What disaggregation costs: the cluster (1 prefill + 1 decode process) against one process running the
engine alone, measured side by side in one run, and the KV transports against a bare gRPC byte stream.

    python benchmarks/disagg_overhead.py [--model DIR] [--json] [--tls] [--kv-transport grpc|shm|nixl]
                                         [--handoff-only]

Model: the ~60M Llama (built with --size 60m if missing; context 4096), fp32. For prompts of 128, 512 and
2048 tokens (greedy, 32 new tokens, EOS ignored, each measured 3 times, median):
  - TTFT and decode tokens/s through the router (user-facing: includes routing, reservation, KV transfer)
    against the engine alone in this process;
  - KV bytes moved, transfer time (first chunk queued → decode's acknowledgement), prefill compute time
    and the *exposed* transfer time (what the transfer adds after prefill compute: the rest overlapped it).
Throughput: KV over gRPC (PushKv of large reservations, 4 MiB chunks, two transfers in flight) against a
bare gRPC byte stream of 4 MiB messages (DecodeService.ProbeLink) between the same two processes (this one,
sending as a prefill worker would, and the decode worker), medians of interleaved rounds; KV over shared
memory (common.kv_transfer.shm). ``--tls``: the cluster runs with mutual TLS between services (``pdserve up
--tls-dir``), and this process dials the workers with the cluster's client certificate: the cost of mTLS.
``--kv-transport``: how the prefill worker sends KV (``nixl``: decode workers with ``--kv-nixl``; NIXL block writes
unless PDSERVE_NIXL_BLOCKS=0 is set for the cluster). ``--handoff-only``: the hand-off breakdown alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent import futures
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.loader import load_model  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402
from common.kv_transfer.grpc_transport import GrpcKVSender, probe_link  # noqa: E402
from common.malloc import tune_malloc  # noqa: E402
from common.rpc.server import channel  # noqa: E402
from common.rpc.tls import TlsFiles  # noqa: E402
from common.state.redis_client import connect  # noqa: E402
from common.state.registry import WorkerRegistry  # noqa: E402
from pdserve.client import Client  # noqa: E402
from pdserve.v1 import types_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402

PROMPT_LENS = (128, 512, 2048)
NEW_TOKENS = 32
REPEATS = 3
MiB = 1 << 20


def prompts_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 4000, (n,), generator=g).tolist()


# -- the engine alone ------------------------------------------------------------------------------------------


def single_process(model: str, threads: int) -> dict[int, dict]:
    engine = LLMEngine(load_model(model), EngineConfig(max_num_seqs=8, max_model_len=4096, num_threads=threads))
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate([prompts_of(64, 0)], sp)  # warm-up
    out = {}
    for n in PROMPT_LENS:
        ttft, tps = [], []
        for r in range(REPEATS):
            t0 = time.perf_counter()
            engine.add_request(prompts_of(n, r), sp)
            first = None
            while engine.has_unfinished_requests():
                outs = engine.step()
                if outs and first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
            ttft.append(first - t0)
            tps.append((NEW_TOKENS - 1) / (end - first))
        out[n] = {"ttft_s": statistics.median(ttft), "decode_tok_s": statistics.median(tps)}
    return out


# -- the cluster -----------------------------------------------------------------------------------------------


def start_cluster(model: str, threads: int, tls: bool = False,
                  kv_transport: str = "grpc") -> tuple[subprocess.Popen, dict]:  # fmt: skip
    """``pdserve up`` with 1 prefill and 1 decode worker; ``info``: the ready line's fields, each role's worker
    address, and ``worker_tls`` (the files to dial the workers with; None: plaintext)."""
    tls_args = ["--tls-dir", tempfile.mkdtemp(prefix="pdserve-bench-tls-")] if tls else []
    tls_args.append(f"--prefill-arg=--kv-transport={kv_transport}")
    if kv_transport == "nixl":
        tls_args.append("--decode-arg=--kv-nixl")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--model", model, "--prefill", "1", "--decode", "1",
         f"--worker-arg=--threads={threads}", "--worker-arg=--max-model-len=4096",
         "--worker-arg=--kv-cache-memory=2e9", "--worker-arg=--max-num-seqs=8", *tls_args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    if not line.startswith("pdserve ready: "):
        proc.kill()
        raise RuntimeError(f"pdserve up failed: {line!r}")
    fields = line.split()
    info = {"router": fields[2], **dict(f.split("=", 1) for f in fields[3:])}
    workers = WorkerRegistry(connect(info["redis"])).list_workers()
    info.update({w.role: w.address for w in workers})
    tls_dir = info.get("tls")  # pdserve up --tls-dir: its client certificate reaches the workers
    info["worker_tls"] = (TlsFiles(f"{tls_dir}/client.pem", f"{tls_dir}/client.key", f"{tls_dir}/ca.pem")
                          if tls_dir else None)  # fmt: skip
    return proc, info


def worker_channel(info: dict, role: str):
    return channel(info[role], info["worker_tls"])


def through_router(router: str) -> dict[int, dict]:
    out = {}
    with Client(router, timeout_s=300) as client:
        client.generate(prompts_of(64, 0), max_tokens=4, temperature=0.0, ignore_eos=True)  # warm-up
        for n in PROMPT_LENS:
            ttft, tps = [], []
            for r in range(REPEATS):
                t0 = time.perf_counter()
                first = None
                count = 0
                for piece in client.stream(prompts_of(n, r), max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True):
                    if piece.token_ids and first is None:
                        first = time.perf_counter()
                    count += len(piece.token_ids)
                end = time.perf_counter()
                ttft.append(first - t0)
                tps.append((count - 1) / (end - first))
            out[n] = {"ttft_s": statistics.median(ttft), "decode_tok_s": statistics.median(tps)}
    return out


def handoff_breakdown(info: dict, seed: int = 10) -> dict[int, dict]:
    """Drive the hand-off by hand (as the router does) to read the prefill worker's transfer figures."""
    decode = worker_pb2_grpc.DecodeServiceStub(worker_channel(info, "decode"))
    prefill = worker_pb2_grpc.PrefillServiceStub(worker_channel(info, "prefill"))
    out = {}
    for n in PROMPT_LENS:
        rows = []
        for r in range(REPEATS):
            rid = uuid.uuid4().hex
            sampling = types_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            reserved = decode.ReserveKv(worker_pb2.ReserveKvRequest(request_id=rid, num_tokens=n, lease_seconds=30))
            t0 = time.perf_counter()
            resp = prefill.Prefill(worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompts_of(n, seed + r), sampling=sampling,
                kv_target_address=info["decode"], decode_identity=reserved.identity,
                kv_shm_address=reserved.kv_shm_address, kv_target_host=reserved.host,
                kv_nixl_metadata=reserved.kv_nixl_metadata, kv_block_ids=reserved.kv_block_ids))  # fmt: skip
            rpc_s = time.perf_counter() - t0
            decode.ReleaseKv(worker_pb2.ReleaseKvRequest(request_id=rid))
            rows.append({"kv_bytes": resp.kv_bytes, "kv_transfer_s": resp.kv_transfer_seconds,
                         "prefill_s": resp.prefill_seconds, "exposed_s": max(0.0, rpc_s - resp.prefill_seconds)})
        out[n] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        out[n]["overlapped_share"] = 1 - out[n]["exposed_s"] / max(out[n]["kv_transfer_s"], 1e-9)
    return out


def kv_push_throughput(
    info: dict, spec_layers: int, total_bytes: int, chunk_bytes: int = 4 * MiB, concurrency: int = 2
) -> float:
    """GB/s of KV pushed over gRPC into reservations on the decode worker (no compute in the way), with
    ``concurrency`` requests' transfers in flight at once (as a busy prefill worker has)."""
    decode = worker_pb2_grpc.DecodeServiceStub(worker_channel(info, "decode"))
    ch = worker_channel(info, "decode")
    tokens = 4000
    blocks = tokens // 16
    per_layer = torch.randn(blocks, 16, 4, 64)  # the 60M model's block shape: [bs, kv heads, head dim]
    pushed = [0] * concurrency

    def push(worker: int) -> None:
        while sum(pushed) < total_bytes:
            rid = uuid.uuid4().hex
            decode.ReserveKv(worker_pb2.ReserveKvRequest(request_id=rid, num_tokens=tokens, lease_seconds=60))
            sender = GrpcKVSender(ch, rid, spec_layers, max_chunk_bytes=chunk_bytes)
            for layer in range(spec_layers):
                sender.send_layer(layer, per_layer, per_layer)
            result = sender.finish(60)
            assert result.ok, result.error
            pushed[worker] += result.num_bytes
            decode.ReleaseKv(worker_pb2.ReleaseKvRequest(request_id=rid))

    t0 = time.perf_counter()
    with futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(push, range(concurrency)))
    return sum(pushed) / (time.perf_counter() - t0) / 1e9


def link_throughput(info: dict, rounds: int = 3, total_bytes: int = 512 * MiB) -> tuple[float, float]:
    """Medians over interleaved rounds (GB/s): KV over gRPC into the decode worker, and a bare gRPC byte
    stream of 4 MiB messages (``DecodeService.ProbeLink``: counted and dropped) between the same two
    processes. Interleaving keeps the noisy machine's swings out of the ratio."""
    ch = worker_channel(info, "decode")
    probe_link(ch, 64 * MiB)  # warm-up
    bare, kv = [], []
    for _ in range(rounds):
        bare.append(probe_link(ch, total_bytes) / 1e9)
        kv.append(kv_push_throughput(info, 8, total_bytes, 4 * MiB, concurrency=2))
    return statistics.median(kv), statistics.median(bare)


def shm_throughput() -> float | None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kv_shm_throughput.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    try:  # its last line: "median X GB/s (warm rounds)"
        return float(proc.stdout.strip().splitlines()[-1].split()[1])
    except (ValueError, IndexError):
        print(f"shm benchmark gave no figure: {proc.stdout[-500:]} {proc.stderr[-500:]}", file=sys.stderr)
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "build" / "llama-60m"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (2 cores: 1 each)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tls", action="store_true", help="mutual TLS between the services (pdserve up --tls-dir)")
    ap.add_argument("--kv-transport", choices=("grpc", "shm", "nixl"), default="grpc")
    ap.add_argument("--handoff-only", action="store_true", help="only the hand-off breakdown (no single process, "
                    "no router, no link throughput)")
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        from common.models.tiny import build_tiny

        build_tiny("llama", args.model, size="60m")
    torch.set_num_threads(args.threads)
    tune_malloc()  # this process sends KV as a prefill worker would (pdserve serve tunes its workers the same)
    if args.handoff_only:
        return handoff_only(args)
    single = single_process(args.model, args.threads)
    proc, info = start_cluster(args.model, args.threads, tls=args.tls, kv_transport=args.kv_transport)
    try:
        cluster = through_router(info["router"])
        handoff = handoff_breakdown(info)
        kv_grpc, bare = link_throughput(info)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    shm = shm_throughput()
    report = {"single": single, "cluster": cluster, "handoff": handoff, "kv_grpc_gb_s": kv_grpc,
              "bare_grpc_gb_s": bare, "kv_shm_gb_s": shm}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{'prompt':>6} | {'TTFT single':>11} {'TTFT cluster':>12} {'ratio':>6} | {'tok/s single':>12} "
          f"{'tok/s cluster':>13} | {'KV MiB':>7} {'xfer ms':>8} {'prefill ms':>10} {'exposed ms':>10} {'overlap':>7}")
    for n in PROMPT_LENS:
        s, c, h = single[n], cluster[n], handoff[n]
        print(f"{n:>6} | {s['ttft_s'] * 1e3:9.1f}ms {c['ttft_s'] * 1e3:10.1f}ms {c['ttft_s'] / s['ttft_s']:5.2f}x | "
              f"{s['decode_tok_s']:12.1f} {c['decode_tok_s']:13.1f} | {h['kv_bytes'] / MiB:7.1f} "
              f"{h['kv_transfer_s'] * 1e3:8.1f} {h['prefill_s'] * 1e3:10.1f} {h['exposed_s'] * 1e3:10.1f} "
              f"{h['overlapped_share']:6.0%}")
    print(f"KV over gRPC {kv_grpc:.2f} GB/s vs bare gRPC stream {bare:.2f} GB/s: {kv_grpc / bare:.0%}")
    print(f"KV over shared memory: {shm if shm is None else f'{shm:.2f} GB/s'}")
    return 0


def handoff_only(args) -> int:
    proc, info = start_cluster(args.model, args.threads, tls=args.tls, kv_transport=args.kv_transport)
    try:
        handoff_breakdown(info, seed=100)  # warm-up (other prompts: no prefix cache hits later)
        handoff = handoff_breakdown(info)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    if args.json:
        print(json.dumps({"handoff": handoff, "kv_transport": args.kv_transport}))
        return 0
    print(f"KV by {args.kv_transport} ({os.environ.get('PDSERVE_NIXL_BLOCKS', '1')=}):")
    print(f"{'prompt':>6} | {'KV MiB':>7} {'xfer ms':>8} {'prefill ms':>10} {'exposed ms':>10} {'overlap':>7}")
    for n in PROMPT_LENS:
        h = handoff[n]
        print(f"{n:>6} | {h['kv_bytes'] / MiB:7.1f} {h['kv_transfer_s'] * 1e3:8.1f} {h['prefill_s'] * 1e3:10.1f} "
              f"{h['exposed_s'] * 1e3:10.1f} {h['overlapped_share']:6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
