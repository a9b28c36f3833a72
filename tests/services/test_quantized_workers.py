"""Workers with ``--quantization``, in an in-process cluster: a mixed pair refuses to move KV, naming the
setting; an int8 pair (weight-only, dynamic) serves what one engine of the same int8 generates."""

from __future__ import annotations

import grpc
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from pdserve.client import Client
from tests.services.inprocess import inprocess_cluster
from tests.services.test_handoff_faults import wait_all_blocks_free

INT8 = "int8-weight-only"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.mark.slow
def test_a_quantized_and_an_unquantized_worker_refuse_to_move_kv(model_dir):
    prefill = [{"worker_id": "prefill-0", "quantization": INT8}]
    with inprocess_cluster(model_dir, prefill=prefill, decode=[{"worker_id": "decode-0"}],
                           router={"max_retries": 0}) as cluster:
        with Client(cluster.router, timeout_s=60) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate([5, 6, 7], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "quantization: 'int8-weight-only' != 'none'" in err.value.details()  # prefill's view
        assert all(w.kv_blocks_used == 0 for w in wait_all_blocks_free(cluster.redis_url))


@pytest.mark.slow
@pytest.mark.parametrize("method", [INT8, "int8-dynamic"])
def test_an_int8_pair_serves_what_one_int8_engine_generates(model_dir, method):
    prompts = [[5, 6, 7, 8] * 3, [9, 10] * 40]
    engine = LLMEngine(load_model(model_dir, quantization=method), EngineConfig(num_kv_blocks=200))
    expected = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    workers = {"prefill": [{"worker_id": "prefill-0", "quantization": method}],
               "decode": [{"worker_id": "decode-0", "quantization": method}]}
    with inprocess_cluster(model_dir, **workers) as cluster:
        with Client(cluster.router, timeout_s=60) as client:
            got = [client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids for p in prompts]
    assert got == [r.token_ids for r in expected]
