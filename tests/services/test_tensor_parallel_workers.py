"""Prefill and decode pools of different tensor-parallel sizes hand off: ``pdserve up`` with a prefill worker at
``--tensor-parallel-size 2`` and a decode worker at 1 (KV over gRPC), then a prefill worker at 1 and a decode worker
at 2 (KV through shared memory). Greedy generations through the router equal stock ``generate`` (fp32); each
two-rank worker runs one follower process, and none outlives the cluster's stop. Settings the engine refuses with
tensor parallelism fail the worker's start, naming the flags.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import psutil
import pytest
import torch

from common.state.redis_client import connect
from common.state.registry import WorkerRegistry
from pdserve.cli import EXIT_PORT_TAKEN
from pdserve.client import Client
from services.worker.config import WorkerConfig
from services.worker.runtime import build_engine
from tests.cli import REPO, process_group_alive
from tests.conftest import hf_greedy
from tests.services.up import pdserve_up

MAX_TOKENS = 12
FOLLOWER_MARK = "spawn_main"  # the command line of a process started by multiprocessing's spawn


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, 4000, (n,), generator=g).tolist() for n in (40, 23, 57)]


def _followers(pid: int) -> list[psutil.Process]:
    """The tensor-parallel follower processes a worker spawned."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if any(FOLLOWER_MARK in part for part in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def _metric(address: str, name: str, labels: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    match = re.search(rf"^[\w:]*{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, transport",
    [(2, 1, "grpc"), (1, 2, "shm")],
    ids=["prefill-tp2-decode-tp1-grpc", "prefill-tp1-decode-tp2-shm"],
)
def test_pools_of_different_tensor_parallel_sizes_hand_off(model_dir, hf_reference, prompts, tmp_path, prefill_tp,
                                                           decode_tp, transport):
    with pdserve_up("--model", model_dir, "--log-dir", str(tmp_path), "--worker-arg=--kv-cache-memory=2e7",
                    f"--prefill-arg=--tensor-parallel-size={prefill_tp}", f"--prefill-arg=--kv-transport={transport}",
                    f"--decode-arg=--tensor-parallel-size={decode_tp}") as info:
        workers = {w.id: w for w in WorkerRegistry(connect(info["redis"])).list_workers()}
        followers = {wid: _followers(w.pid) for wid, w in workers.items()}
        assert {wid: len(f) for wid, f in followers.items()} == {"prefill-0": prefill_tp - 1,
                                                                 "decode-0": decode_tp - 1}
        with Client(info["router"], timeout_s=120) as client:
            results = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts]
        reference = hf_reference(model_dir)
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            assert (result.prefill_worker_id, result.decode_worker_id) == ("prefill-0", "decode-0")
            assert result.token_ids == hf_greedy(reference, prompt, MAX_TOKENS), f"prompt {i} (len {len(prompt)})"
            assert result.finish_reason == "length"
        # every hand-off went over the transport asked for
        sent = _metric(workers["prefill-0"].metrics_address, "kv_transfer_seconds_count", f'transport="{transport}"')
        assert sent == len(prompts)
    assert info["returncode"] == 0
    spawned = [p for f in followers.values() for p in f]
    _, alive = psutil.wait_procs(spawned, timeout=15)
    assert not alive, f"tensor-parallel followers outlived the cluster: {alive}"
    # The SIGTERM drain stopped them through the engine (the stop message), not a signal to the process group.
    tp_worker = "prefill-0" if prefill_tp > 1 else "decode-0"
    log = (tmp_path / f"{tp_worker}.log").read_text()
    assert "tensor parallel engine ready: 2 ranks" in log
    assert "could not send the stop" not in log and "did not stop in" not in log, log[-3000:]


@pytest.mark.parametrize(
    "settings, flags",
    [
        ({"quantization": "int8-weight-only"}, "--quantization int8-weight-only"),
        ({"kv_host_cache_blocks": 64}, "--kv-host-cache-blocks"),
        ({"kv_shared_cache_blocks": 64}, "--kv-shared-cache-blocks"),
    ],
)
def test_settings_refused_with_tensor_parallelism_fail_the_start(model_dir, settings, flags):
    config = WorkerConfig(model=model_dir, tensor_parallel_size=2, **settings)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 does not work with") as err:
        build_engine(config)  # refused before the model loads or any process starts
    assert flags in str(err.value)


def test_a_failed_start_stops_the_followers(model_dir):
    """The engine is up (two ranks) when the gRPC port turns out taken: the worker exits non-zero and its
    follower process (same process group) is stopped by the engine's close, not left behind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "pdserve", "prefill", "--model", model_dir, "--tensor-parallel-size", "2",
                "--port", str(port), "--redis-url", "redis://127.0.0.1:1/0"]
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=180)
        finally:
            leftover = process_group_alive(proc.pid, wait_s=15.0)
            if leftover:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == EXIT_PORT_TAKEN, err[-3000:]  # `pdserve up` would start it again on another port
    assert "tensor parallel engine ready: 2 ranks" in err, err[-3000:]
    assert f"pdserve prefill: error: cannot listen on 127.0.0.1:{port}: Address already in use" in err, err[-3000:]
    assert "could not send the stop" not in err and "did not stop in" not in err, err[-3000:]
    assert not leftover, "a follower outlived the worker's failed start by 15 s"
