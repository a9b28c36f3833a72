"""The flat forward (one loop over the fused layers of a Llama/Qwen2/Qwen3/Mistral/Phi-3/Granite, Qwen2/3-MoE/Mixtral
or Gemma/Gemma 2/3 model, :mod:`common.engine.flat_forward`): taken where the model has that layout, its logits the
model's own bit for bit on mixed prefill/decode steps, stock ``generate``'s tokens; the model's own forward kept
when the one check fails; a layer-streaming prefill streams each layer once; refused for hooked models and
without the kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine import cpu_kernels
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.flat_forward import FlatForward
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.moe_models import MOE_FAMILIES, build_checkpoint, build_moe
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts
from tests.conftest import hf_greedy

# Gemma's families and OLMo's (their own flat loop, GPT-OSS's too: moe_models.py): two layers, a window of 24 on the
# first of Gemma 2's, Gemma 3's and OLMo 3's (Gemma 2's soft caps on the attention and final logits at
# transformers' defaults: 50, 30)
_BASE = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)  # fmt: skip
_WINDOWED = dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"])
OWN_LOOP_FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", _WINDOWED),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", _WINDOWED),
    # the same loop: a norm after the attention and the MLP, none before; q/k norms over all the heads
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", _WINDOWED),
    # the Llama loop: Phi-3 (one q|k|v and one gate|up layer, dropouts after the sublayers, idle), Granite (Granite
    # 3.0's multipliers: embeddings x12, each sublayer's output x0.22 before its addition, logits / 8)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                     logits_scaling=8.0)),
}


def build_own_loop(family: str, out: Path, tokenizer_dir: str) -> str:
    config_cls, model_cls, overrides = OWN_LOOP_FAMILIES[family]
    return build_checkpoint(config_cls, model_cls, {**_BASE, **overrides}, out, tokenizer_dir)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """``model_dir(arch, **overrides)``: build-tiny's model of that arch, or a MoE family's (moe_models.py), or a
    Gemma family's."""
    built: dict[str, str] = {}

    def get(arch: str, **overrides) -> str:
        if arch not in MOE_FAMILIES and arch not in OWN_LOOP_FAMILIES:
            return tiny_model_dir(arch, **overrides)
        if arch not in built:
            build = build_moe if arch in MOE_FAMILIES else build_own_loop
            built[arch] = build(arch, tmp_path_factory.mktemp(arch), tiny_model_dir("llama"))
        return built[arch]

    return get


@pytest.fixture(autouse=True)
def kernels():
    if not cpu_kernels.load():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def experts_packed(arch: str) -> bool:
    """Whether this build packs ``arch``'s fp32 experts (a MoE family's flat loop needs them packed): not with a
    build without the fp32 linear kernel (plain x86-64, aarch64), whose MoE layers keep transformers' modules."""
    return arch not in MOE_FAMILIES or torch.ops.pdserve.fp32_linear_supported()


def engine_for(model_dir: str, **config) -> LLMEngine:
    return LLMEngine(load_model(model_dir), EngineConfig(prefix_caching=False, **config))


def test_taken_where_the_layout_fits(model_dir, tiny_model_dir):
    for arch in ("llama", "qwen2", "qwen3", "mistral", *MOE_FAMILIES, *OWN_LOOP_FAMILIES):
        assert (engine_for(model_dir(arch)).runner.flat is not None) == experts_packed(arch), arch
        assert engine_for(model_dir(arch), flat_forward=False).runner.flat is None
        assert engine_for(model_dir(arch), cpu_kernels=False).runner.flat is None  # no RopeAttention
    hooked = load_model(tiny_model_dir("llama"))
    hooked.model.model.layers[1].register_forward_hook(lambda *args: None)
    assert LLMEngine(hooked, EngineConfig()).runner.flat is None  # a hook would be skipped


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("qwen2", {"sliding_window": 24}),
                                            ("qwen3", {}), ("qwen3", {"sliding_window": 24}),
                                            ("mistral", {"sliding_window": 24}), ("qwen3_moe", {}), ("mixtral", {}),
                                            ("qwen2_moe", {}), ("gemma", {}), ("gemma2", {}), ("gemma3", {}),
                                            ("gpt_oss", {}), ("olmo2", {}), ("olmo3", {}), ("olmoe", {}),
                                            ("phi3", {}), ("granite", {}), ("glm4_moe", {})],
                         ids=["llama", "qwen2", "qwen2-window", "qwen3", "qwen3-window", "mistral-window", "qwen3_moe",
                              "mixtral", "qwen2_moe", "gemma", "gemma2", "gemma3", "gpt_oss", "olmo2", "olmo3",
                              "olmoe", "phi3", "granite", "glm4_moe"])  # fmt: skip
def test_logits_equal_the_models_own_on_every_step(arch, overrides, model_dir, hf_reference):
    """Prompts arriving while others decode (steps of decode + prefill), every step's logits both ways (the
    runner's one check made to run on every step). MoE models: packed experts in the layers' sparse blocks. Gemma
    2 and 3: sandwich norms, a window on one layer of two, soft caps (Gemma 2), rotations by layer type (Gemma
    3). Phi-3 and Granite: the Llama loop, Granite's multipliers applied where its forward applies them."""
    if not experts_packed(arch):
        pytest.skip(f"this build packs no fp32 experts ({arch}'s MoE layers keep transformers' modules)")
    d = model_dir(arch, **overrides)
    engine = engine_for(d, max_num_batched_tokens=64)
    runner = engine.runner
    flat = runner.flat
    steps = {"compared": 0, "mixed": 0}
    model_run = runner._model_logits

    def both(batch):
        want = model_run(batch)
        if len(batch.logits_index):
            got = flat(batch.input_ids, batch.position_ids, batch.attn, batch.logits_index)
            assert torch.equal(got, want)
            steps["compared"] += 1
            steps["mixed"] += len(batch.attn.groups) > 1
        return want

    runner._model_logits = both
    prompts = make_prompts(engine.vocab_size, lens=[5, 40, 90, 1], seed=11)
    params = SamplingParams(max_new_tokens=30, **GREEDY)
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(prompt, params, request_id=str(i))
        for out in engine.step():
            results[out.request_id] += out.new_token_ids
        assert runner.flat is flat
        flat.verified = False
    assert steps["compared"] >= 30 and steps["mixed"] >= 2
    reference = hf_reference(d)
    for i, prompt in enumerate(prompts):
        assert results[str(i)] == hf_greedy(reference, prompt, 30), f"prompt {i}"


def test_a_failed_check_keeps_the_models_forward(tiny_model_dir, hf_reference, monkeypatch, caplog):
    d = tiny_model_dir("llama")
    engine = engine_for(d)
    calls = {"flat": 0}
    real = FlatForward.__call__

    def off_by_a_bit(self, *args):
        calls["flat"] += 1
        return real(self, *args) * (1 + 2**-20)

    monkeypatch.setattr(FlatForward, "__call__", off_by_a_bit)
    prompt = make_prompts(engine.vocab_size, lens=[12], seed=3)[0]
    result = engine.generate([prompt], SamplingParams(max_new_tokens=12, **GREEDY))[0]
    assert calls["flat"] == 1 and engine.runner.flat is None
    assert "differ from the model's own" in caplog.text
    assert result.token_ids == hf_greedy(hf_reference(d), prompt, 12)


def test_layer_streaming_prefill_streams_each_layer_once(tiny_model_dir, monkeypatch):
    """The prefill worker's steps stream each layer out as it is written: the checked step (both forwards)
    reports each layer once, after the model's own write; the later steps take the flat loop."""
    order: list[tuple[str, int]] = []
    streamed: dict[str, dict[int, tuple]] = {}

    def sink(rid, layer, k, v):
        order.append((rid, layer))
        streamed.setdefault(rid, {})[layer] = (k.clone(), v.clone())

    engine = LLMEngine(load_model(tiny_model_dir("llama")), EngineConfig(max_num_batched_tokens=64), kv_layer_sink=sink)
    calls = {"flat": 0}
    real = FlatForward.__call__

    def counted(self, *args):
        calls["flat"] += 1
        return real(self, *args)

    monkeypatch.setattr(FlatForward, "__call__", counted)
    prompts = make_prompts(engine.vocab_size, lens=[30, 50, 20], seed=4)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=5, **GREEDY), prefill_only=True) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.flat.verified and calls["flat"] >= 2
    layers = engine.kv_spec.num_layers
    for rid in ids:
        assert [layer for r, layer in order if r == rid] == list(range(layers))
        handoff = engine.export_kv(rid)
        for layer, (k, v) in enumerate(handoff.layers):
            assert torch.equal(k, streamed[rid][layer][0]) and torch.equal(v, streamed[rid][layer][1])
