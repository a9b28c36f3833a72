"""benchmarks/gpu_check.py on the CPU: every section runs and reports numbers; the fp32 oracle is exact."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTIONS = ["env", "setup", "oracle", "prefill", "decode", "cuda_graphs", "kv_transfer", "ttft", "short_requests",
            "stream_rate"]  # fmt: skip


def run_check(*args: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--threads", "1", "--json",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
def test_quick_cpu_run_reports_every_section_with_numbers_and_an_exact_oracle():
    rc, result = run_check()
    sections = result["sections"]
    assert list(sections) == SECTIONS
    assert rc == 0, {name: s["text"] for name, s in sections.items() if s["status"] != "ok"}
    assert (result["device"], result["dtype"], result["quick"]) == ("cpu", "float32", True)
    for name, s in sections.items():
        assert s["status"] == "ok" and s["text"], name
        assert s["values"], name
        for key, value in s["values"].items():
            assert type(value) in (int, float) and math.isfinite(value), (name, key, value)
    assert sections["env"]["info"]["torch"] == torch.__version__

    oracle = sections["oracle"]
    assert oracle["info"]["first_divergence"] == [None, None, None, None]
    values = oracle["values"]
    assert values["num_divergent_prompts"] == 0
    assert values["num_agreeing_tokens"] == values["num_tokens_compared"] == 4 * values["num_new_tokens"]
    assert values["tolerance"] == 1e-4 and values["max_logit_diff"] <= 1e-4
    assert oracle["targets"] == [{"name": "oracle", "value": values["max_logit_diff"], "unit": "logit",
                                  "target": "<= 0.0001", "pass": True}]  # fmt: skip

    kv = sections["kv_transfer"]["values"]
    # 256 tokens x 4 layers x (K, V) x 2 KV heads x head_dim 32 x 4 bytes: the tiny Llama's KV, all of it
    assert kv["kv_bytes"] == 256 * 4 * 2 * 2 * 32 * 4 and kv["round_trip_exact"] == 1
    assert all(kv[k] > 0 for k in ("extract_gb_s", "stage_encode_gb_s", "receive_gb_s", "copy_pinned_gb_s"))
    info = sections["kv_transfer"]["info"]["nixl"]  # NIXL is in the test extra: DRAM to DRAM here
    assert kv["nixl_write_gb_s"] > 0 and info.startswith("DRAM to DRAM "), info
    info = sections["kv_transfer"]["info"]["nixl_blocks"]  # the block transport, the engine's cache to another
    assert kv["nixl_blocks_gb_s"] > 0 and info.startswith("DRAM to DRAM ") and "in 16 blocks" in info, info

    decode = sections["decode"]["values"]
    assert set(decode) == {"batch_1_tok_s", "batch_4_tok_s", "batch_8_tok_s", "stock_batch_1_tok_s"}
    graphs = sections["cuda_graphs"]  # on the CPU: the graphs' static-shape path, run eagerly
    assert {"batch_1_tok_s", "batch_4_tok_s", "batch_8_tok_s", "captured", "graph_steps"} <= set(graphs["values"])
    assert graphs["values"]["captured"] == 0 and graphs["values"]["graph_steps"] > 0
    assert graphs["values"]["tokens_agree"] == graphs["values"]["tokens_compared"] > 0
    assert graphs["info"]["enabled"] is True and graphs["text"].startswith("on vs off")
    targets = [t for s in sections.values() for t in s["targets"]]
    assert [t["name"] for t in targets] == ["oracle", "ttft_max", "short_requests_per_s", "stream_tok_s_min"]
    assert all(isinstance(t["pass"], bool) for t in targets)


def test_past_the_deadline_every_section_is_skipped_with_a_note():
    rc, result = run_check("--deadline-s", "0")
    assert rc == 1
    assert {name: s["status"] for name, s in result["sections"].items()} == dict.fromkeys(SECTIONS, "skipped")
    assert result["sections"]["oracle"]["text"].startswith("skipped: the global deadline of 0 s passed")


def test_a_step_that_raises_leaves_the_engine_empty(tiny_model_dir, monkeypatch):
    """A section whose step raised must not leave its requests behind for the sections after it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_measure

    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model
    from common.engine.sampling_params import SamplingParams

    engine = LLMEngine(load_model(tiny_model_dir("llama")), EngineConfig(num_kv_blocks=200))
    check = type("Check", (), {"engine": engine, "greedy": staticmethod(
        lambda n: SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))})()  # fmt: skip
    step = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        gpu_measure.timed_run(check, [[5, 6, 7], [8, 9]], 8)
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    monkeypatch.setattr(engine, "step", step)
    assert gpu_measure.timed_run(check, [[5, 6, 7]], 4).token_times  # the next section runs on it
