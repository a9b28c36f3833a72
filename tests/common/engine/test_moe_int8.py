"""int8 experts (``--quantization int8-weight-only`` on a MoE model; common/engine/moe.py, csrc/moe.cpp).

Each expert must be quantized as torchao quantizes a linear layer of its weight and computed as torchao computes
one (bit for bit against transformers' eager experts loop over torchao's layers); the engine's kernels over the
packed int8 values must give that module's output up to their order of summation, on any thread count bit for bit;
an engine over an int8 MoE checkpoint must give stock ``generate``'s tokens on the same int8 model, with and
without the kernels.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from common.engine import cpu_kernels
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.moe import Int8Experts, PackedExperts, _fitting, fuse_experts, quantize_experts
from common.engine.quantization import quantize_model, weight_bytes
from common.engine.sampling_params import SamplingParams
from tests.common.engine.moe_models import build_moe
from tests.common.engine.test_moe import AMX_INTER, EXPERTS, HIDDEN, INTER, experts, gpt_oss_experts, routing
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels unavailable")

INT8 = "int8-weight-only"


def int8_layout(module: Int8Experts) -> str:
    found = _fitting(module)
    if found is None:
        pytest.skip(f"no engine linear kernel widens int8 weights for {module.dtype} inputs on this CPU")
    return found


def torchao_experts_loop(module, x, index, weights):
    """transformers' eager experts loop (Qwen3MoeExperts.forward) over torchao's int8 layers of each expert's
    weights; returns the output and the layers."""
    layers = []
    for e in range(module.num_experts):
        inter = module.intermediate_dim
        pair = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, 2 * inter, bias=False),
                                    torch.nn.Linear(inter, HIDDEN, bias=False)]).to(x.dtype)  # fmt: skip
        with torch.no_grad():
            pair[0].weight.copy_(module.gate_up_proj[e])
            pair[1].weight.copy_(module.down_proj[e])
        quantize_(pair, Int8WeightOnlyConfig(set_inductor_config=False))
        layers.append(pair)
    out = torch.zeros_like(x)
    for e in index.unique().tolist():
        token_idx, top_k_pos = torch.where(index == e)
        gate, up = layers[e][0](x[token_idx]).chunk(2, dim=-1)
        y = layers[e][1](module.act_fn(gate) * up) * weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out, layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_is_quantized_and_computed_as_torchao_does_a_linear_layer(dtype):
    module = experts(dtype)
    quantized = Int8Experts(module)
    x, index, weights = routing(23, dtype)
    with torch.inference_mode():
        want, layers = torchao_experts_loop(module, x, index, weights)
        got = quantized(x, index, weights)
    for e, (gate_up, down) in enumerate(layers):
        assert torch.equal(quantized.gate_up[e], gate_up.weight.qdata)
        assert torch.equal(quantized.down[e], down.weight.qdata)
        assert torch.equal(quantized.gate_up_scale[e], gate_up.weight.scale.to(dtype).flatten())
        assert torch.equal(quantized.down_scale[e], down.weight.scale.to(dtype).flatten())
    assert quantized.gate_up.dtype == quantized.down.dtype == torch.int8
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_are_quantized_and_computed_as_torchao_does_their_linear_layers(dtype):
    """GPT-OSS's experts (transposed, biases, its own gate): each expert's products as torchao's int8 layers of its
    weights and biases, the rest GPT-OSS's eager experts loop, bit for bit."""
    module = gpt_oss_experts(dtype)
    quantized = Int8Experts(module)
    assert quantized.gpt_oss
    x, index, weights = routing(23, dtype)
    x = x * 3  # gates past the clamp
    layers = []
    for e in range(EXPERTS):
        pair = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, 2 * INTER), torch.nn.Linear(INTER, HIDDEN)]).to(dtype)
        with torch.no_grad():
            pair[0].weight.copy_(module.gate_up_proj[e].t())
            pair[0].bias.copy_(module.gate_up_proj_bias[e])
            pair[1].weight.copy_(module.down_proj[e].t())
            pair[1].bias.copy_(module.down_proj_bias[e])
        quantize_(pair, Int8WeightOnlyConfig(set_inductor_config=False))
        layers.append(pair)
    want = torch.zeros_like(x)
    with torch.inference_mode():
        for e in index.unique().tolist():
            token_idx, top_k_pos = torch.where(index == e)
            y = layers[e][1](module._apply_gate(layers[e][0](x[token_idx])))
            want.index_add_(0, token_idx, (y * weights[token_idx, top_k_pos, None]).to(dtype))
        got = quantized(x, index, weights)
    assert torch.equal(got, want)
    assert torch.equal(quantized.gate_up[2], layers[2][0].weight.qdata)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 16, 67])
def test_packed_int8_gpt_oss_experts_give_the_int8_modules_output(dtype, tokens):
    quantized = Int8Experts(gpt_oss_experts(dtype))
    packed = PackedExperts(quantized, int8_layout(quantized))
    assert packed.int8 and packed.gate == "gpt_oss" and packed.gate_up_bias.dtype == dtype
    x, index, weights = routing(tokens, dtype)
    x = x * 3
    with torch.inference_mode():
        got, want = packed(x, index, weights), quantized(x, index, weights)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # bf16 roundings apart: the module's own error against the same int8 arithmetic in fp32 bounds it
        exact_module = copy.deepcopy(quantized).float()
        with torch.inference_mode():
            exact = exact_module(x.float(), index, weights.float())
        assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max() + 1e-2


@pytest.mark.parametrize("inter", [INTER, AMX_INTER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 3, 16, 67, 200])  # 200: ~67 rows an expert, on AMX tiles in bf16 there
def test_packed_int8_experts_give_the_int8_modules_output(dtype, tokens, inter):
    quantized = Int8Experts(experts(dtype, inter=inter))
    packed = PackedExperts(quantized, int8_layout(quantized))
    assert packed.int8 and packed.gate_up.dtype == torch.int8 and packed.layout in ("fp32_blocks", "bf16_pairs")
    x, index, weights = routing(tokens, dtype)
    with torch.inference_mode():
        got, want = packed(x, index, weights), quantized(x, index, weights)
    assert got.dtype == want.dtype == dtype and got.shape == (tokens, HIDDEN)
    if dtype == torch.float32 or tokens == 0:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # bf16 roundings apart: the module's own error against the same int8 arithmetic in fp32 bounds it
        exact_module = copy.deepcopy(quantized).float()  # the scales in fp32, the int8 values as they are
        with torch.inference_mode():
            exact = exact_module(x.float(), index, weights.float())
        assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max() + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 16, 67, 200])
def test_int8_experts_give_the_same_bits_on_any_thread_count(dtype, tokens):
    quantized = Int8Experts(experts(dtype, inter=AMX_INTER))
    packed = PackedExperts(quantized, int8_layout(quantized))
    x, index, weights = routing(tokens, dtype)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                outputs.append(packed(x, index, weights))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outputs)


def test_int8_weights_without_their_scales_are_an_error():
    quantized = Int8Experts(experts(torch.float32))
    packed = PackedExperts(quantized, int8_layout(quantized))
    x, index, weights = routing(2, torch.float32)
    with pytest.raises(RuntimeError, match="come with their scales"):
        torch.ops.pdserve.moe_experts(x, index, weights, packed.gate_up, packed.down, packed.inter, packed.layout)
    with pytest.raises(RuntimeError, match=r"scales \[E, 2 x inter\]"):
        torch.ops.pdserve.moe_experts(x, index, weights, packed.gate_up, packed.down, packed.inter, packed.layout,
                                      packed.down_scale, packed.gate_up_scale)  # fmt: skip


def test_a_routed_int8_expert_changes_exactly_its_tokens():
    quantized = Int8Experts(experts(torch.float32))
    x, index, weights = routing(9, torch.float32)
    base = PackedExperts(quantized, int8_layout(quantized))(x, index, weights)
    chosen = int(index[0, 0])
    quantized.down_scale[chosen].zero_()
    out = PackedExperts(quantized, int8_layout(quantized))(x, index, weights)
    assert {t for t in range(9) if not torch.equal(out[t], base[t])} == {t for t in range(9) if chosen in index[t]}


def test_fuse_experts_swaps_in_packed_int8_experts():
    parent = torch.nn.Module()
    parent.experts = Int8Experts(experts(torch.float32))
    int8_layout(parent.experts)
    assert fuse_experts(parent) == 1 and isinstance(parent.experts, PackedExperts) and parent.experts.int8


def test_quantizing_frees_the_experts_full_precision_weights_and_keeps_experts_of_their_own_arithmetic():
    class ClampedGate(type(experts(torch.float32))):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=7.0)) * up

    model = torch.nn.Module()
    model.block = torch.nn.Module()
    model.block.experts = experts(torch.float32)
    model.custom = ClampedGate(model.block.experts.config)
    before = weight_bytes(model)
    freed = weakref.ref(model.block.experts.gate_up_proj)
    assert quantize_experts(model) == (["block.experts"], ["custom"])
    gc.collect()
    assert freed() is None and isinstance(model.block.experts, Int8Experts)
    assert type(model.custom) is ClampedGate
    experts_bytes = EXPERTS * 3 * INTER * HIDDEN
    # int8 values plus fp32 scales against fp32 weights
    assert before - weight_bytes(model) == 4 * experts_bytes - experts_bytes - 4 * EXPERTS * (2 * INTER + HIDDEN)


def _moe_int8(family: str, dtype: str, tiny_model_dir, tmp_path):
    """The family's checkpoint, its full-precision weight bytes and its int8 model loaded twice (one for the
    engine, one for stock transformers)."""
    path = build_moe(family, tmp_path, tiny_model_dir("llama"))
    full = weight_bytes(load_model(path, dtype=dtype).model)
    loaded = load_model(path, dtype=dtype, quantization=INT8)
    # the experts too (with the experts kept, the bf16 Qwen3-MoE would keep 0.78 of its bytes: its embeddings stay)
    assert weight_bytes(loaded.model) < (0.6 if dtype == "float32" else 0.7) * full
    reference = load_model(path, dtype=dtype, quantization=INT8).model
    assert {type(m).__name__ for m in reference.modules() if "xperts" in type(m).__name__} == {"Int8Experts"}
    return path, loaded, reference


def _packed_int8(engine: LLMEngine) -> None:
    packed = [m for m in engine.loaded.model.modules() if isinstance(m, PackedExperts)]
    if _fitting(Int8Experts(experts(engine.loaded.dtype))) is not None:
        assert packed and all(m.int8 for m in packed)


PROMPT_LENGTHS = (1, 17, 60)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, 4096, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_an_int8_moe_engine_generates_what_stock_generate_does_on_the_int8_model(family, tiny_model_dir, tmp_path):
    """fp32: the engine's tokens, with its kernels and without them, are stock ``generate``'s on the int8 model."""
    path, loaded, reference = _moe_int8(family, "float32", tiny_model_dir, tmp_path)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    want = [hf_greedy(reference, prompt, greedy.max_new_tokens) for prompt in prompts]
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    _packed_int8(engine)
    assert [r.token_ids for r in engine.generate(prompts, [greedy] * len(prompts))] == want
    plain = LLMEngine(load_model(path, quantization=INT8), EngineConfig(num_kv_blocks=64, cpu_kernels=False))
    assert not any(isinstance(m, PackedExperts) for m in plain.loaded.model.modules())
    assert [r.token_ids for r in plain.generate(prompts, [greedy] * len(prompts))] == want


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_a_bf16_int8_moe_engine_stays_within_bf16_rounding_of_stock_on_the_int8_model(family, tiny_model_dir,
                                                                                      tmp_path):  # fmt: skip
    """bf16: the engine's logits of a decode step over three sequences are as far from stock fp32's on the same
    int8 weights as stock bf16's are (greedy tokens of random bf16 models part at near ties)."""
    path, loaded, reference = _moe_int8(family, "bfloat16", tiny_model_dir, tmp_path)
    exact = load_model(path, quantization=INT8).model
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    _packed_int8(engine)
    for prompt in _prompts():
        engine.add_request(prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # the prefill step, then decode steps
        engine.step()
    scheduled = engine.scheduler.schedule().scheduled
    assert len(scheduled) == len(PROMPT_LENGTHS) and all(k == 1 for _, k in scheduled)
    batch = engine.runner.prepare(scheduled)
    logits = engine.runner.run(batch)
    with torch.no_grad():
        for row, request in zip(logits, batch.sampling_requests):
            ids = torch.tensor([request.all_token_ids])
            stock, truth = reference(ids).logits[0, -1].float(), exact(ids).logits[0, -1]
            stock_error = (stock - truth).abs().max().item()
            assert (row.float() - truth).abs().max().item() <= 1.5 * stock_error + 1e-3, stock_error


def test_dynamic_int8_keeps_the_experts_in_full_precision(tiny_model_dir, tmp_path):
    path = build_moe("qwen3_moe", tmp_path, tiny_model_dir("llama"))
    model = load_model(path).model
    names = quantize_model(model, "int8-dynamic")
    assert names and not any("experts" in name for name in names)
    assert not any(isinstance(m, Int8Experts) for m in model.modules())
