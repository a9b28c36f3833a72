"""Tensor parallelism: a model sharded over two gloo processes on the CPU generates exactly what one process and
stock ``generate`` do (fp32, greedy), through ``pdserve run --tensor-parallel-size 2``; the step message the
driver sends its followers rebuilds the batch field for field; a size that does not divide the heads is refused
before any process starts."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import ModelLoadError, load_model
from common.engine.sampling_params import SamplingParams
from common.engine.tensor_parallel import decode_step, encode_step
from common.engine.tp_launcher import launch_engine
from tests.cli import REPO, process_group_alive
from tests.conftest import hf_greedy

TP_TIMEOUT_S = 240


def _assert_same(a, b, where: str) -> None:
    """Field-by-field equality of two step batches (tensors: dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            if f.name.startswith("_") or f.name in ("sampling_requests", "kv_cache", "on_layer_written"):
                continue
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_step_message_rebuilds_the_batch(tiny_model_dir):
    """A step with a decode group and a prefill group survives encode → decode unchanged, on the given cache."""
    config = EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=128)
    engine = LLMEngine(load_model(tiny_model_dir("llama")), config)
    engine.add_request(list(range(10, 19)), SamplingParams(max_new_tokens=4))
    engine.step()  # the first request now decodes
    engine.add_request(list(range(30, 37)), SamplingParams(max_new_tokens=4))
    sched = engine.scheduler.schedule()
    batch = engine.runner.prepare(sched.scheduled)
    assert [g.token_index is None for g in batch.attn.groups] == [True, False]
    header, body = encode_step(batch)
    rebuilt = decode_step(header.tolist(), body, engine.kv_cache, engine.device)
    _assert_same(batch, rebuilt, "StepBatch")
    assert rebuilt.attn.kv_cache is engine.kv_cache
    assert rebuilt.sampling_requests == [] and rebuilt.attn.on_layer_written is None
    # the rebuilt batch runs: same logits as the original (the KV it writes is the same too)
    expected = engine.runner.run(batch)
    assert torch.equal(engine.runner.run(rebuilt), expected)


@pytest.mark.parametrize("size", [3, 4])
def test_size_that_does_not_split_the_heads_is_refused(tiny_model_dir, size):
    """Tiny llama has 4 query heads and 2 KV heads: 3 splits neither, 4 not the KV heads."""
    with pytest.raises(ModelLoadError, match=f"tensor_parallel_size {size} must divide"):
        launch_engine(tiny_model_dir("llama"), EngineConfig(), tensor_parallel_size=size)


def _pdserve_run(*args: str, env: dict[str, str] | None = None) -> list[dict]:
    """``pdserve run ARGS --json`` in its own process group; every process of the group is gone afterwards."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "run", *args, "--json"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TP_TIMEOUT_S)
    finally:
        leftover = process_group_alive(proc.pid, wait_s=15.0)  # processes the driver spawned, reaped by init once gone
        if leftover:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert not leftover, "a process spawned by pdserve run outlived it by 15 s"
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.slow
def test_two_ranks_generate_what_one_process_and_generate_do(tiny_model_dir, hf_reference, tmp_path):
    """Prompts of 1..70 tokens, two sharing a 40-token prefix (prefix-cache hits), chunked prefill mixed with
    decodes (chunk 8, blocks of 4): the two-rank engine, a one-process engine and stock generate agree."""
    model_dir = tiny_model_dir("llama")
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(4, 4000, (40,), generator=g).tolist()
    prompts = [torch.randint(4, 4000, (n,), generator=g).tolist() for n in (1, 5, 17, 70)]
    prompts += [shared + [7, 8, 9], shared + [11]]
    max_tokens = [12, 9, 12, 6, 12, 10]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": p, "max_tokens": n}) + "\n" for p, n in zip(prompts, max_tokens)))
    flags = ["--block-size", "4", "--prefill-chunk-size", "8", "--max-num-batched-tokens", "32", "--threads", "1",
             "--ignore-eos", "--model", model_dir, "--prompts-file", str(f)]

    sharded = _pdserve_run(*flags, "--tensor-parallel-size", "2")

    engine = LLMEngine(load_model(model_dir), EngineConfig(block_size=4, prefill_chunk_size=8,
                                                           max_num_batched_tokens=32))
    single = engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
                                       for n in max_tokens])
    reference = hf_reference(model_dir)
    assert len(sharded) == len(prompts)
    for i, (obj, one, prompt, n) in enumerate(zip(sharded, single, prompts, max_tokens)):
        assert obj["prompt_token_ids"] == prompt
        assert obj["token_ids"] == one.token_ids, f"prompt {i}: two ranks differ from one process"
        assert obj["token_ids"] == hf_greedy(reference, prompt, n), f"prompt {i}: differs from stock generate"
        assert obj["finish_reason"] == "length"


# Imported first by every Python process the test starts (the driver and the follower it spawns): torch then says
# this host's accelerator is CUDA, as it does on a GPU host. transformers builds its tensor-parallel device mesh on
# that accelerator, and binding a CUDA device fails at once on this CPU-only torch.
_GPU_HOST = """
import torch
torch._C._get_accelerator = lambda *args, **kwargs: torch.device("cuda")
"""


@pytest.mark.slow
def test_cpu_ranks_on_a_gpu_host_shard_on_the_cpu(tiny_model_dir, tmp_path):
    """``--device cpu --tensor-parallel-size 2`` where torch reports a GPU: the shards and the mesh stay on the
    CPU, and the two ranks generate what one process does."""
    model_dir = tiny_model_dir("llama")
    prompts = [list(range(20, 33)), list(range(100, 105))]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": p, "max_tokens": 8}) + "\n" for p in prompts))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_GPU_HOST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}

    sharded = _pdserve_run("--device", "cpu", "--tensor-parallel-size", "2", "--threads", "1", "--ignore-eos",
                           "--model", model_dir, "--prompts-file", str(f), env=env)

    engine = LLMEngine(load_model(model_dir), EngineConfig())
    single = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    assert [obj["token_ids"] for obj in sharded] == [one.token_ids for one in single]
