"""``pdserve bench --http`` against a stand-in OpenAI-protocol server (stdlib ``http.server`` on loopback).

The stand-in speaks the protocol the router's HTTP front will (``GET /v1/models``, ``POST /v1/completions``
streamed as server-sent events over chunked transfer encoding). The live-router HTTP test comes with the front.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.bench.http_backend import HttpBackend, base_url_from, first_model_id, iter_sse_data
from pdserve.bench.runner import issue
from pdserve.commands import bench as bench_cmd
from tests.redis_server import free_port

MODEL_ID = "stand-in-model"


class StandIn(ThreadingHTTPServer):
    """Streams ``ceil(max_tokens / tokens_per_chunk)`` text chunks ``delay_s`` apart, then (``usage``) the usage
    chunk and ``[DONE]``. Every ``fail_every``-th completion gets 503; ``ending`` = "error" sends an error
    object instead of the usage, "truncate" ends the stream without ``[DONE]``."""

    daemon_threads = True

    def __init__(self, *, usage=True, tokens_per_chunk=1, token_ids=False, fail_every=0, ending="done",
                 models=(MODEL_ID,), delay_s=0.001) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.usage, self.tokens_per_chunk, self.token_ids = usage, tokens_per_chunk, token_ids
        self.fail_every, self.ending, self.models, self.delay_s = fail_every, ending, models, delay_s
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StandIn

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _event(self, obj) -> None:
        data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            return self._json(404, {"error": {"message": "not found"}})
        self._json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.server.models]})

    def do_POST(self) -> None:
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.bodies.append(body)
            num_calls = len(srv.bodies)
        if self.path != "/v1/completions" or (srv.fail_every and num_calls % srv.fail_every == 0):
            return self._json(503, {"error": {"message": "overloaded", "code": 503}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        max_tokens = body["max_tokens"]
        for i in range(math.ceil(max_tokens / srv.tokens_per_chunk)):
            time.sleep(srv.delay_s)
            n = min(srv.tokens_per_chunk, max_tokens - i * srv.tokens_per_chunk)
            choice = {"index": 0, "text": "ab" * n, "finish_reason": None}
            if srv.token_ids:
                choice["token_ids"] = [100 + i] * n
            self._event({"object": "text_completion", "model": body["model"], "choices": [choice], "usage": None})
        if srv.ending == "error":
            self._event({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
        elif srv.ending == "done":
            if srv.usage:
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": max_tokens}
                self._event({"object": "text_completion", "choices": [], "usage": usage})
            self._event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    bench_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_iter_sse_data():
    lines = [b": keep-alive\n", b"event: chunk\n", b"data: {\"a\": 1}\r\n", b"\r\n", b"data:x\n", b"data: y\n",
             b"\n", b"\n", b"id: 3\n", b"data: [DONE]\n"]  # fmt: skip
    assert list(iter_sse_data(lines)) == ['{"a": 1}', "x\ny", "[DONE]"]


def test_base_url():
    assert base_url_from("10.0.0.1:8000", None) == "http://10.0.0.1:8000"
    assert base_url_from("ignored:1", "https://front.example/proxy/") == "https://front.example/proxy"
    with pytest.raises(ValueError, match="not an http"):
        base_url_from("ignored:1", "ftp://front.example")


def test_bench_over_http_writes_the_json_result(tmp_path):
    out = tmp_path / "result.json"
    with StandIn() as server:
        args = parse("--http", "--router", server.address, "--num-requests", "12", "--concurrency", "3",
                     "--input-len", "5", "--output-len", "4", "--temperature", "0.5", "--no-progress",
                     "--result-json", str(out))
        assert bench_cmd.bench(args) == 0
        bodies = server.bodies
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["errors"]) == (12, 0, {})
    assert (result["input_tokens"], result["output_tokens"]) == (60, 48)
    assert result["settings"]["protocol"] == "http" and result["settings"]["model"] == MODEL_ID
    assert result["settings"]["http_url"] == f"http://{server.address}"
    assert len(result["runs"]) == 1 and result["runs"][0]["completed"] == 12
    assert result["tpot_ms"]["p50"] <= result["tpot_ms"]["p90"] <= result["tpot_ms"]["p99"]
    assert len(bodies) == 12
    for body in bodies:
        assert set(body) == {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options",
                             "ignore_eos"}  # fmt: skip
        assert (body["model"], body["max_tokens"], body["temperature"]) == (MODEL_ID, 4, 0.5)
        assert (body["stream"], body["stream_options"], body["ignore_eos"]) == (True, {"include_usage": True}, True)
        assert len(body["prompt"]) == 5 and all(isinstance(t, int) and 10 <= t < 256 for t in body["prompt"])


def test_sweep_over_http_counts_errors_by_status_and_plots(tmp_path, capsys):
    out, plot_dir = tmp_path / "result.json", tmp_path / "plots"
    with StandIn(fail_every=4) as server:
        args = parse("--http-url", f"http://{server.address}/", "--model", "given", "--num-requests", "8",
                     "--request-rate", "400,800", "--arrival", "fixed", "--input-len", "3", "--output-len", "2",
                     "--no-progress", "--result-json", str(out), "--plot-dir", str(plot_dir))
        assert bench_cmd.bench(args) == 0
        assert {b["model"] for b in server.bodies} == {"given"} and len(server.bodies) == 16
    result = json.loads(out.read_text())
    assert [run["request_rate"] for run in result["runs"]] == [400.0, 800.0]
    assert [(run["completed"], run["failed"], run["errors"]) for run in result["runs"]] == [(6, 2, {"503": 2})] * 2
    assert result["settings"]["request_rates"] == [400.0, 800.0] and result["settings"]["arrival"] == "fixed"
    assert sorted(p.name for p in plot_dir.iterdir()) == ["goodput_vs_rate.png", "latency_cdf.png",
                                                         "throughput_vs_rate.png"]  # fmt: skip
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plot_dir.iterdir())
    stdout = capsys.readouterr().out
    assert stdout.count("==== pdserve bench: rate") == 2 and "\nLOAD " in stdout


def run_one(server: StandIn, max_tokens: int = 4):
    backend = HttpBackend(f"http://{server.address}", MODEL_ID)
    return issue(backend, [11, 12, 13], max_tokens=max_tokens, temperature=0.0, timeout_s=10.0)


def test_usage_gives_the_token_count():
    with StandIn(tokens_per_chunk=3) as server:  # 7 tokens in chunks of 3, 3, 1
        record, output_ids = run_one(server, max_tokens=7)
    assert record.completed and record.output_tokens == 7 and output_ids is None
    assert [k for _, k in record.arrivals] == [1, 1, 1]


def test_without_usage_chunks_are_counted():
    with StandIn(usage=False) as server:
        record, _ = run_one(server, max_tokens=5)
    assert record.completed and record.output_tokens == 5


def test_token_ids_in_chunks_are_used():
    with StandIn(tokens_per_chunk=2, token_ids=True) as server:
        record, output_ids = run_one(server, max_tokens=4)
    assert output_ids == [100, 100, 101, 101] and [k for _, k in record.arrivals] == [2, 2]


@pytest.mark.parametrize("options, status", [
    ({"ending": "error"}, "500"),
    ({"ending": "truncate"}, "StreamTruncated"),
    ({"fail_every": 1}, "503"),
])  # fmt: skip
def test_failures_by_status(options, status):
    with StandIn(**options) as server:
        record, _ = run_one(server)
    assert record.error == status


def test_refused_connection():
    backend = HttpBackend(f"http://127.0.0.1:{free_port()}", MODEL_ID)
    record, _ = issue(backend, [11], max_tokens=2, temperature=0.0, timeout_s=5.0)
    assert record.error == "ConnectionRefusedError" and record.output_tokens == 0


def test_model_discovery():
    with StandIn(models=("first", "second")) as server:
        assert first_model_id(f"http://{server.address}") == "first"
    with StandIn(models=()) as server:
        with pytest.raises(ValueError, match="lists no model; pass --model"):
            first_model_id(f"http://{server.address}")


def test_unreachable_front_exits_1(capsys):
    args = parse("--http", "--router", f"127.0.0.1:{free_port()}", "--num-requests", "1", "--concurrency", "1",
                 "--input-len", "2", "--output-len", "2")
    assert bench_cmd.bench(args) == 1
    assert capsys.readouterr().err.startswith("pdserve bench: error: cannot ask the HTTP front for its model: ")
