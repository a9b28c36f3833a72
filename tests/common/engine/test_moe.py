"""Mixture-of-experts layers on the engine's kernels (common/engine/moe.py, csrc/moe.cpp) and the module copies the
fused paths recognize by their forward (common/engine/module_match.py).

The experts' output must be transformers' own (its default grouped-matmul path) up to the order of summation, for
any routing, in fp32 and bf16; an engine over a MoE checkpoint must run its experts packed and still give stock
``generate``'s tokens (tests/common/engine/test_architectures.py holds the greedy oracle over the MoE families);
what the kernel does not compute as transformers does keeps the model's own module.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralAttention, MixtralRMSNorm, MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeRMSNorm, Qwen3MoeTopKRouter

from common.engine import cpu_kernels
from common.engine.config import EngineConfig
from common.engine.cpu_linear import _LLAMA_STYLE_NORMS
from common.engine.engine import LLMEngine
from common.engine.fused_attention import _REFERENCES as ATTENTIONS
from common.engine.fused_attention import RopeAttention
from common.engine.loader import load_model
from common.engine.module_match import same_forward
from common.engine.moe import PackedExperts, PackedRouter, _fitting, _router_kind, fuse_experts
from common.engine.sampling_params import SamplingParams
from tests.common.engine.moe_models import build_moe
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels unavailable")

HIDDEN, INTER, EXPERTS, TOP_K = 96, 80, 6, 2
# an intermediate size AMX tiles take (a multiple of 32: else bf16 experts keep the model's module on AMX CPUs)
AMX_INTER = 64


def experts(dtype: torch.dtype, seed: int = 0, inter: int = INTER) -> Qwen3MoeExperts:
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=inter, num_experts=EXPERTS,
                                         num_experts_per_tok=TOP_K)  # fmt: skip
    module = Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) * 0.1)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) * 0.1)
    return module.to(dtype).eval()


def routing(tokens: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, TOP_K, dtype=torch.long)  # fmt: skip
    weights = torch.rand(tokens, TOP_K, generator=g).softmax(-1).to(dtype)
    return x, index, weights


def layout(dtype: torch.dtype, inter: int = INTER) -> str:
    found = _fitting(experts(dtype, inter=inter))
    if found is None:
        pytest.skip(f"no engine linear kernel takes {dtype} weights of {inter} features on this CPU")
    return found


@pytest.mark.parametrize("inter", [INTER, AMX_INTER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 3, 16, 67])
def test_packed_experts_give_transformers_output(dtype, tokens, inter):
    module = experts(dtype, inter=inter)
    packed = PackedExperts(module, layout(dtype, inter))
    x, index, weights = routing(tokens, dtype)
    with torch.inference_mode():
        got, want = packed(x, index, weights), module(x, index, weights)
    assert got.dtype == want.dtype == dtype and got.shape == (tokens, HIDDEN)
    if dtype == torch.float32 or tokens == 0:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # one bf16 rounding of each product apart at most: stock's own error against fp32 bounds it
        exact = experts(torch.float32, inter=inter)(x.float(), index, weights.float())
        assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max() + 1e-3


def test_every_routed_expert_counts_and_no_other():
    """Zeroing an expert no token chose changes nothing; zeroing a chosen one changes exactly its tokens."""
    module = experts(torch.float32)
    x, index, weights = routing(9, torch.float32)
    unused = sorted(set(range(EXPERTS)) - set(index.flatten().tolist()))
    base = PackedExperts(module, layout(torch.float32))(x, index, weights)
    chosen = int(index[0, 0])
    for expert, changed in ((unused[0] if unused else None, set()),
                            (chosen, {t for t in range(9) if chosen in index[t].tolist()})):  # fmt: skip
        if expert is None:
            continue
        with torch.no_grad():
            copy = experts(torch.float32)
            copy.down_proj[expert].zero_()
        out = PackedExperts(copy, layout(torch.float32))(x, index, weights)
        assert {t for t in range(9) if not torch.equal(out[t], base[t])} == changed


def test_expert_ids_out_of_range_are_an_error():
    module = experts(torch.float32)
    x, index, weights = routing(2, torch.float32)
    index[1, 0] = EXPERTS
    with pytest.raises(RuntimeError, match="expert id 6 out of"):
        PackedExperts(module, layout(torch.float32))(x, index, weights)


def test_experts_with_their_own_arithmetic_keep_the_model_module():
    """A custom gate (GPT-OSS's clamped one), biases or a transposed layout are not what the kernel computes."""
    module = experts(torch.float32)
    layout(torch.float32)

    class ClampedGate(Qwen3MoeExperts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=7.0)) * up

    custom = ClampedGate(module.config)
    assert _fitting(custom) is None
    module.has_bias = True
    assert _fitting(module) is None
    module.has_bias, module.is_transposed = False, True
    assert _fitting(module) is None


def test_a_packing_that_differs_keeps_the_module(caplog, monkeypatch):
    """fuse_experts checks the packed output against the module's before it swaps."""
    parent = torch.nn.Module()
    parent.experts = experts(torch.float32)
    if layout(torch.float32) != "fp32_blocks":
        pytest.skip("fp32 weights take another layout here")
    original = torch.ops.pdserve.pack_fp32_blocks
    with monkeypatch.context() as patch:
        patch.setattr(torch.ops.pdserve, "pack_fp32_blocks", lambda w: original(w * 1.01))  # off by 1%
        assert fuse_experts(parent) == 0
    assert isinstance(parent.experts, Qwen3MoeExperts) and "packed experts differ" in caplog.text
    assert fuse_experts(parent) == 1 and isinstance(parent.experts, PackedExperts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,config", [
    (Qwen3MoeTopKRouter, transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2,
                                                     norm_topk_prob=True)),
    (Qwen3MoeTopKRouter, transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2,
                                                     norm_topk_prob=False)),
    (OlmoeTopKRouter, transformers.OlmoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2)),
    (MixtralTopKRouter, transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                                   num_experts_per_tok=2)),
], ids=["qwen3_moe-normed", "qwen3_moe", "olmoe-copy", "mixtral"])  # fmt: skip
def test_packed_routers_pick_what_the_model_picks(cls, config, dtype):
    """The logits from a packed layer, then the reference's own steps: the same experts, the same weights (in the
    reference's dtype: Mixtral's stay fp32), for tokens in a batch."""
    router = cls(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(4)))
    router = router.to(dtype)
    kind = _router_kind(router)
    assert kind == ("MixtralTopKRouter" if cls is MixtralTopKRouter else "Qwen3MoeTopKRouter")
    packed = PackedRouter(router, kind)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.inference_mode():
        got, want = packed(x), router(x)
    assert torch.equal(got[2], want[2])
    for g, w in zip(got[:2], want[:2]):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_gpt_oss_router_picks_what_the_model_picks(dtype):
    """GPT-OSS's router: logits with a bias, the top k, a softmax over them in the logits' dtype."""
    router = GptOssTopKRouter(transformers.GptOssConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                                        num_experts_per_tok=TOP_K))  # fmt: skip
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.bias.copy_(torch.randn(router.bias.shape, generator=g) * 3)  # a bias that changes the choice
    router = router.to(dtype)
    assert _router_kind(router) == "GptOssTopKRouter"
    packed = PackedRouter(router, "GptOssTopKRouter")
    x = torch.randn(11, HIDDEN, generator=g).to(dtype)
    with torch.inference_mode():
        got, want = packed(x), router(x)
        unbiased = torch.topk(torch.nn.functional.linear(x, router.weight), TOP_K, dim=-1).indices
    assert torch.equal(got[2], want[2]) and not torch.equal(got[2], unbiased)
    for g_, w in zip(got[:2], want[:2]):
        assert g_.dtype == w.dtype and g_.shape == w.shape
        torch.testing.assert_close(g_.float(), w.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,best", [(1, 1), (3, 2)], ids=["one-group", "groups"])
def test_a_packed_glm4_moe_router_picks_what_the_model_picks(dtype, groups, best):
    """GLM-4-MoE's router (DeepSeek-V3's routing): float logits, sigmoid scores, the top k by score plus a correction
    bias within the best groups, their scores normalized and scaled: the same experts and weights, the logits within
    float rounding; with one group (GLM-4.5's) no group mask is built. The bias changes the choice."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = transformers.Glm4MoeConfig(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                        n_group=groups, topk_group=best, routed_scaling_factor=2.5)  # fmt: skip
    router = Glm4MoeTopkRouter(config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.1)
        router.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=g))
    assert _router_kind(router) == "Glm4MoeTopkRouter"
    packed = PackedRouter(router, "Glm4MoeTopkRouter")
    x = torch.randn(13, HIDDEN, generator=g).to(dtype)
    with torch.inference_mode():
        got, want = packed(x), router(x)
        plain = torch.topk(torch.nn.functional.linear(x.float(), router.weight).sigmoid(), TOP_K).indices
    assert torch.equal(got[2], want[2]) and not torch.equal(got[2].sort().values, plain.sort().values)
    for g_, w in zip(got[:2], want[:2]):
        assert g_.dtype == w.dtype == torch.float32 and g_.shape == w.shape
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-6)


def test_a_router_of_its_own_keeps_the_model_module():
    class Jittered(Qwen3MoeTopKRouter):
        def forward(self, hidden_states):
            return super().forward(hidden_states * 1.01)

    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2)
    assert _router_kind(Jittered(config)) is None and _router_kind(Qwen3MoeTopKRouter(config)) is not None


def test_copies_of_the_reference_modules_are_recognized_by_their_forward():
    assert same_forward(Qwen3MoeRMSNorm, _LLAMA_STYLE_NORMS) == "LlamaRMSNorm"
    assert same_forward(MixtralRMSNorm, _LLAMA_STYLE_NORMS) == "LlamaRMSNorm"
    assert same_forward(MixtralAttention, ATTENTIONS) == "MistralAttention"  # the config's sliding window
    assert same_forward(GemmaRMSNorm, _LLAMA_STYLE_NORMS) is None  # x * (1 + weight)

    class Scaled(Qwen3MoeRMSNorm):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    assert same_forward(Scaled, _LLAMA_STYLE_NORMS) is None


def test_an_engine_over_a_moe_checkpoint_runs_packed_experts_and_fused_layers(tiny_model_dir, tmp_path, hf_reference):
    """Qwen3-MoE: every MoE layer's experts and router packed, its attention, norms fused; greedy tokens are
    stock's."""
    build_moe("qwen3_moe", tmp_path, tiny_model_dir("llama"))
    engine = LLMEngine(load_model(str(tmp_path)), EngineConfig(num_kv_blocks=64))
    model = engine.loaded.model
    layers = model.model.layers
    assert [type(layer.mlp.experts).__name__ if hasattr(layer.mlp, "experts") else "dense" for layer in layers] == \
        ["PackedExperts", "dense", "PackedExperts"]  # fmt: skip
    assert [type(layer.mlp.gate).__name__ for layer in layers if hasattr(layer.mlp, "experts")] == ["PackedRouter"] * 2
    assert all(isinstance(layer.self_attn, RopeAttention) for layer in layers)
    assert not any(type(m).__name__ == "Qwen3MoeRMSNorm" for m in model.modules())
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(4, 4096, (n,), generator=g).tolist() for n in (1, 30, 90)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    results = engine.generate(batch, [greedy] * len(batch))
    reference = hf_reference(str(tmp_path))
    for prompt, result in zip(batch, results):
        assert result.token_ids == hf_greedy(reference, prompt, greedy.max_new_tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_worker_packs_its_experts_as_a_decode_engine_does(dtype, tiny_model_dir, tmp_path):
    """A prefill worker (``weight_layout="prefill"``: oneDNN's layout for its bf16 linear layers on AMX CPUs) runs
    its experts on the engine's kernel in a decode engine's layout, not the model's own module."""
    build_moe("qwen3_moe", tmp_path, tiny_model_dir("llama"))
    found = []
    for weight_layout in ("decode", "prefill"):
        engine = LLMEngine(load_model(str(tmp_path), dtype=dtype),
                           EngineConfig(num_kv_blocks=64, weight_layout=weight_layout))  # fmt: skip
        found.append([getattr(layer.mlp.experts, "layout", type(layer.mlp.experts).__name__)
                      for layer in engine.loaded.model.model.layers if hasattr(layer.mlp, "experts")])  # fmt: skip
    if found[0] == ["Qwen3MoeExperts"] * 2:
        pytest.skip(f"no engine linear kernel takes {dtype} weights on this CPU")
    assert found[1] == found[0] and found[0][0] in ("fp32_blocks", "bf16_pairs", "bf16_amx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 16, 67])
def test_whole_experts_a_thread_give_the_same_output(dtype, tokens):
    """Decode-sized batches run whole experts a thread (``moe_experts``); larger ones split each product over the
    threads. Either way each output comes from the same code: the same bits as on one thread."""
    module = experts(dtype, inter=AMX_INTER)
    packed = PackedExperts(module, layout(dtype, AMX_INTER))
    x, index, weights = routing(tokens, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            alone = packed(x, index, weights)
        torch.set_num_threads(2)
        with torch.inference_mode():
            shared = packed(x, index, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)
    torch.testing.assert_close(shared.float(), module(x, index, weights).float(), rtol=2e-2, atol=2e-2)


def gpt_oss_experts(dtype: torch.dtype, inter: int = INTER) -> GptOssExperts:
    """GPT-OSS's experts (transposed, interleaved gate and up columns, biases, a gate clamped at 7), weights large
    enough for the clamps to bite."""
    module = GptOssExperts(transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=inter,
                                                     num_local_experts=EXPERTS, num_experts_per_tok=TOP_K))  # fmt: skip
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.to(dtype).eval()


@pytest.mark.parametrize("inter", [INTER, AMX_INTER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 16, 67])
def test_gpt_oss_experts_packed_give_the_models_output(dtype, tokens, inter):
    module = gpt_oss_experts(dtype, inter)
    found = _fitting(module)
    if found is None:
        pytest.skip(f"no engine linear kernel takes {dtype} weights of {inter} features on this CPU")
    packed = PackedExperts(module, found)
    assert packed.gate == "gpt_oss" and packed.gate_up_bias.dtype == torch.float32
    x, index, weights = routing(tokens, dtype)
    x = x * 3  # gates past the clamp of 7
    with torch.inference_mode():
        got, want = packed(x, index, weights), module(x, index, weights)
        gate_up = x.float() @ module.gate_up_proj.float()[index[0, 0]] + module.gate_up_proj_bias.float()[index[0, 0]]
    assert (gate_up[..., ::2] > module.limit).any() and (gate_up[..., 1::2].abs() > module.limit).any()
    assert got.dtype == want.dtype == dtype and got.shape == (tokens, HIDDEN)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # bf16 roundings apart: stock's own error against fp32 bounds it
        exact = gpt_oss_experts(torch.float32, inter)
        exact.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
        with torch.inference_mode():
            truth = exact(x.float(), index, weights.float())
        assert (got.float() - truth).abs().max() <= 2 * (want.float() - truth).abs().max() + 1e-2


def test_gpt_oss_experts_of_another_gate_keep_the_model_module():
    class OtherGate(GptOssExperts):
        def _apply_gate(self, gate_up):
            return gate_up[..., ::2] * gate_up[..., 1::2]

    module = gpt_oss_experts(torch.float32)
    layout(torch.float32)
    assert _fitting(module) is not None
    assert _fitting(OtherGate(module.config)) is None
    module.has_bias = False
    assert _fitting(module) is None
