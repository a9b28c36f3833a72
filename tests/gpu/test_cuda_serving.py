"""The cluster on a CUDA device: ``pdserve up`` with a prefill and a decode worker on the GPU, the KV staged to
pinned host memory layer by layer and sent over gRPC or shared memory; concurrent greedy requests through the
router equal one CUDA engine's output in fp32. Marked ``gpu``: skipped without a CUDA device (tests/conftest.py);
``GPU_CHECK_TESTS=1 benchmarks/gpu_check.sh`` runs it on a lent GPU."""

from __future__ import annotations

import shutil

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_cuda_cluster_equals_one_cuda_engine(transport, tiny_model_dir, tmp_path):
    for module in ("grpc", "redis", "google.protobuf"):  # a lent GPU machine has what it has: skip, not fail
        pytest.importorskip(module)
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on the PATH (pdserve up starts one)")
    from tests.services.up import generate_concurrently, pdserve_up

    model_dir = tiny_model_dir("llama")
    prompts = make_prompts(4096, lens=[1, 9, 17, 64, 130, 250, 300, 33], seed=41)
    new_tokens = [12 + i for i in range(len(prompts))]
    engine = LLMEngine(load_model(model_dir, dtype="float32", device="cuda"), EngineConfig(num_kv_blocks=400))
    want = [r.token_ids for r in engine.generate(prompts, [SamplingParams(max_new_tokens=n, **GREEDY)
                                                            for n in new_tokens])]  # fmt: skip
    del engine
    torch.cuda.empty_cache()
    with pdserve_up("--model", model_dir, "--prefill", "1", "--decode", "1", "--log-dir", str(tmp_path),
                    "--worker-arg=--device=cuda", "--worker-arg=--dtype=float32",
                    f"--prefill-arg=--kv-transport={transport}") as info:  # fmt: skip
        results, errors = generate_concurrently(info["router"], prompts, new_tokens)
    assert not errors, errors
    assert [results[i].token_ids for i in range(len(prompts))] == want
    assert info["returncode"] == 0
