"""CPU per streamed token of gRPC itself, without an engine: a paced token source (the decode worker's part), a
relay (the router's) and 16 client threads, each a process of its own, servers either synchronous
(thread per stream) or ``grpc.aio`` (one event loop).

    python benchmarks/grpc_stream_cost.py [--streams 16] [--tokens 128] [--step-ms 25] [--rounds 3] [--json]

The source sends every open stream one ``DecodeResponse`` per step (``--step-ms``, as a decode step would),
the relay turns each into a ``GenerateResponse`` for its client. For each of the four source x relay
combinations it prints the CPU microseconds per token that the source, the relay and the clients spent
(user + system, median of the rounds). It measures the fixed cost the serving path adds to each token on a
machine whose cores the engine also needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from common.cluster.net import free_port  # noqa: E402
from pdserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402


def source_sync(port: int, tokens: int, step_s: float) -> None:
    step, changed = [0], threading.Condition()

    def tick() -> None:
        while True:
            time.sleep(step_s)
            with changed:
                step[0] += 1
                changed.notify_all()

    class Source(worker_pb2_grpc.DecodeServiceServicer):
        def Decode(self, request, context):
            for i in range(tokens):
                with changed:
                    seen = step[0]
                    changed.wait_for(lambda: step[0] > seen)  # noqa: B023 - read at once
                yield worker_pb2.DecodeResponse(token_ids=[i + 4], text="ab")

    threading.Thread(target=tick, daemon=True).start()
    server = grpc.server(futures.ThreadPoolExecutor(64))
    worker_pb2_grpc.add_DecodeServiceServicer_to_server(Source(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


async def source_aio(port: int, tokens: int, step_s: float) -> None:
    loop, waiting = asyncio.get_running_loop(), []

    def wake() -> None:
        ready, waiting[:] = list(waiting), []
        for future in ready:
            if not future.done():
                future.set_result(None)

    def tick() -> None:  # another thread, like the engine's
        while True:
            time.sleep(step_s)
            loop.call_soon_threadsafe(wake)

    class Source(worker_pb2_grpc.DecodeServiceServicer):
        async def Decode(self, request, context):
            for i in range(tokens):
                future = loop.create_future()
                waiting.append(future)
                await future
                yield worker_pb2.DecodeResponse(token_ids=[i + 4], text="ab")

    threading.Thread(target=tick, daemon=True).start()
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeServiceServicer_to_server(Source(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def relay_sync(port: int, source_port: int) -> None:
    stub = worker_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{source_port}"))

    class Relay(generate_pb2_grpc.GenerateServiceServicer):
        def Generate(self, request, context):
            for piece in stub.Decode(worker_pb2.DecodeRequest(request_id=request.request_id)):
                yield generate_pb2.GenerateResponse(request_id=request.request_id, token_ids=piece.token_ids,
                                                    text=piece.text)  # fmt: skip

    server = grpc.server(futures.ThreadPoolExecutor(64))
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(Relay(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


async def relay_aio(port: int, source_port: int) -> None:
    stub = worker_pb2_grpc.DecodeServiceStub(grpc.aio.insecure_channel(f"127.0.0.1:{source_port}"))

    class Relay(generate_pb2_grpc.GenerateServiceServicer):
        async def Generate(self, request, context):
            async for piece in stub.Decode(worker_pb2.DecodeRequest(request_id=request.request_id)):
                yield generate_pb2.GenerateResponse(request_id=request.request_id, token_ids=piece.token_ids,
                                                    text=piece.text)  # fmt: skip

    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(Relay(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_listening(port: int) -> None:
    grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{port}")).result(timeout=30)


def measure(source: str, relay: str, args) -> dict[str, float]:
    """Median CPU µs per token of source, relay and clients over the rounds."""
    source_port, relay_port = free_port(), free_port()
    me = [sys.executable, __file__]
    procs = {
        "source": subprocess.Popen([*me, "--serve", f"source-{source}", str(source_port), str(args.tokens),
                                    str(args.step_ms)]),  # fmt: skip
        "relay": subprocess.Popen([*me, "--serve", f"relay-{relay}", str(relay_port), str(source_port)]),
    }
    try:
        wait_listening(source_port)
        wait_listening(relay_port)
        per_round: dict[str, list[float]] = {"source": [], "relay": [], "clients": []}
        useful = args.streams * args.tokens

        def one(i: int) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{relay_port}") as channel:
                for _ in generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                        generate_pb2.GenerateRequest(request_id=str(i)), timeout=120):  # fmt: skip
                    pass

        for _ in range(args.rounds):
            before = {name: cpu_seconds(p.pid) for name, p in procs.items()}
            clients0 = time.process_time()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for name, p in procs.items():
                per_round[name].append((cpu_seconds(p.pid) - before[name]) / useful * 1e6)
            per_round["clients"].append((time.process_time() - clients0) / useful * 1e6)
        return {name: statistics.median(values) for name, values in per_round.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":  # a child: one server
        role, *rest = sys.argv[2:]
        numbers = [int(rest[0]), *(float(x) for x in rest[1:])]
        if role == "source-sync":
            source_sync(numbers[0], int(numbers[1]), numbers[2] / 1000)
        elif role == "source-aio":
            asyncio.run(source_aio(numbers[0], int(numbers[1]), numbers[2] / 1000))
        elif role == "relay-sync":
            relay_sync(numbers[0], int(numbers[1]))
        else:
            asyncio.run(relay_aio(numbers[0], int(numbers[1])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=25.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for source in ("sync", "aio"):
        for relay in ("sync", "aio"):
            row = {"source": source, "relay": relay, "us_per_token": measure(source, relay, args)}
            results.append(row)
            if not args.json:
                us = row["us_per_token"]
                print(f"source {source:4} relay {relay:4}: CPU µs per token: source {us['source']:5.0f}, "
                      f"relay {us['relay']:5.0f}, clients {us['clients']:5.0f}", flush=True)
    if args.json:
        print(json.dumps({"streams": args.streams, "tokens": args.tokens, "step_ms": args.step_ms,
                          "results": results}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
