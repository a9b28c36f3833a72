"""Mixture-of-experts layers on the engine's CPU kernels: each expert's gated MLP over packed weights.

transformers keeps a MoE block's experts as two 3-D parameters (``gate_up_proj`` [experts, 2 x inter, hidden],
``down_proj`` [experts, hidden, inter]) and computes them through its experts interface
(``transformers.integrations.moe``); on the CPU the default, torch's grouped matmul, loops over every expert
whether a token chose it or not, over transposed weights. :class:`PackedExperts` stands where such a module stood
and runs ``torch.ops.pdserve.moe_experts`` (``common/engine/csrc/moe.cpp``): only the experts hit, each through
the engine's linear kernel over its packed weight, with transformers' roundings.

:func:`fuse_experts` swaps the experts in where the module is one transformers' default arithmetic covers (concatenated
gate and up, not transposed, no biases, a SiLU gate, no norm after the experts, no expert parallelism: Qwen2/3-MoE,
Mixtral, OLMoE, GLM-4-MoE, ERNIE 4.5 MoE and their kin) or GPT-OSS's (transposed weights, gate and up columns
interleaved, biases, a clamped gate: the columns taken apart into gate rows then up rows, the biases added by the
linear kernels, the gate computed with torch's roundings, ``moe_experts``' ``gpt_oss`` gate), and its output
matches the module's own on random tokens and routing.

:class:`PackedRouter` computes a top-k router's logits (Qwen2/3-MoE's, OLMoE's, Mixtral's, GPT-OSS's with its bias)
from a packed layer.

:class:`Int8Experts`: such a module (either arithmetic) with its experts quantized to int8 as ``--quantization
int8-weight-only`` quantizes a linear layer (torchao's ``Int8WeightOnlyConfig``: one symmetric scale per output
feature of each expert), computed as torchao computes such a layer; :func:`quantize_experts` swaps it in
(common/engine/quantization.py), and :class:`PackedExperts` takes its int8 values into the kernels' layouts, which
the linear kernels widen as they load.
"""

from __future__ import annotations

import logging

import torch

from common.engine.cpu_linear import PackedLinear, _int8_blocks, _int8_pairs, _own_layout, packing_supported
from common.engine.module_match import same_forward

log = logging.getLogger(__name__)

_LAYOUTS = ("fp32_blocks", "bf16_pairs", "bf16_amx")
# top-k routers whose forward PackedRouter repeats (and their copies, module_match.py: Qwen2-MoE's, OLMoE's, ...)
_ROUTERS = ("qwen3_moe.Qwen3MoeTopKRouter", "mixtral.MixtralTopKRouter", "gpt_oss.GptOssTopKRouter",
            "glm4_moe.Glm4MoeTopkRouter")
_PACK = {"fp32_blocks": "pack_fp32_blocks", "bf16_pairs": "pack_bf16_pairs", "bf16_amx": "pack_bf16_pairs"}


class Int8Experts(torch.nn.Module):
    """An experts module of transformers' default arithmetic or GPT-OSS's (see the module doc) with each expert's
    weights int8, one symmetric scale per output feature, as torchao's ``Int8WeightOnlyConfig`` quantizes a linear
    layer; each product computed as torchao computes one (the activations times the int8 values cast to their
    dtype, then times the scales, then plus the bias), the rest op for op transformers' eager experts loop (GPT-OSS's
    with its own gate). The engine's kernels run it through :class:`PackedExperts`; this forward runs where they do
    not, and is their reference."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        from torchao.quantization import Int8WeightOnlyConfig
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

        granularity = Int8WeightOnlyConfig(set_inductor_config=False).granularity
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        # GPT-OSS's: transposed (each expert's output features as rows, as a linear layer's), gate and up rows
        # interleaved, biases, its own gate
        self.gpt_oss = _gpt_oss_arithmetic(experts)
        if self.gpt_oss:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            self.register_buffer("gate_up_bias", experts.gate_up_proj_bias.detach().clone())
            self.register_buffer("down_bias", experts.down_proj_bias.detach().clone())
            self.alpha, self.limit = experts.alpha, experts.limit
            self.apply_gate = type(experts)._apply_gate  # GptOssExperts', over this module's alpha and limit
        else:
            self.register_buffer("gate_up_bias", None)
            self.register_buffer("down_bias", None)
            self.act_fn = experts.act_fn
        self.dtype = gate_up.dtype
        self.num_experts, two_inter, self.hidden = gate_up.shape
        self.inter = two_inter // 2
        for name, weight in (("gate_up", gate_up), ("down", down)):
            # the experts' rows one after another: a scale per row is a scale per expert and output feature
            q = Int8Tensor.from_hp(weight.reshape(-1, weight.shape[2]), granularity)
            self.register_buffer(name, q.qdata.reshape(weight.shape).contiguous())
            self.register_buffer(f"{name}_scale", q.scale.reshape(weight.shape[:2]).to(self.dtype).contiguous())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token_idx, top_k_pos = torch.where(top_k_index == e)
            rows = hidden_states[token_idx]
            gate_up = self._product(rows, "gate_up", e)
            if self.gpt_oss:
                act = self.apply_gate(self, gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = self.act_fn(gate) * up
            y = self._product(act, "down", e) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def _product(self, rows: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """Expert ``e``'s product ``name`` as torchao computes a weight-only int8 layer's: over the int8 values cast to
        the input dtype, times the scales, plus the bias."""
        y = torch.mm(rows, getattr(self, name)[e].t().to(rows.dtype)) * getattr(self, f"{name}_scale")[e]
        bias = getattr(self, f"{name}_bias")
        if bias is not None:
            y += bias[e]
        return y

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, int8"


def quantize_experts(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Replace each experts module of ``model`` of transformers' default arithmetic or GPT-OSS's (see the module
    doc) by an :class:`Int8Experts`; returns the qualified names of those replaced and of the experts modules kept in
    full precision (any other arithmetic)."""
    done, kept = [], []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, Int8Experts) or not _has_experts(child):
                continue
            if _default_arithmetic(child) or _gpt_oss_arithmetic(child):
                setattr(parent, name, Int8Experts(child))
                done.append(qualified)
            else:
                kept.append(qualified)
    return done, kept


class PackedExperts(torch.nn.Module):
    """An experts module's weights packed for the engine's linear kernel of ``layout``, one stack per projection
    (an :class:`Int8Experts`'s int8 values in that kernel's layout, and its scales); called as the module it
    replaces: ``(hidden_states [tokens, hidden], top_k_index, top_k_weights)``."""

    def __init__(self, experts: torch.nn.Module, layout: str) -> None:
        super().__init__()
        self.layout = layout
        self.int8 = isinstance(experts, Int8Experts)
        self.gate, self.alpha, self.limit = "silu", 0.0, 0.0
        scales = biases = None
        if self.int8:  # each expert's output features as rows: [E, 2I, H], [E, H, I]
            gate_up, down = experts.gate_up, experts.down
            pack = _int8_blocks if layout == "fp32_blocks" else _int8_pairs
            scales = [experts.gate_up_scale, experts.down_scale]
            gpt_oss = experts.gpt_oss
            if gpt_oss:  # added after the scaling, in the experts' dtype (moe.cpp)
                biases = [experts.gate_up_bias, experts.down_bias]
        else:
            gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
            pack = getattr(torch.ops.pdserve, _PACK[layout])
            gpt_oss = _gpt_oss_arithmetic(experts)
            if gpt_oss:  # [E, H, 2I] and [E, I, H] transposed; the kernels add a bias in float: converted once
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
                biases = [experts.gate_up_proj_bias.detach().float(), experts.down_proj_bias.detach().float()]
        if gpt_oss:  # gate and up rows interleaved -> the gate rows first, then the up rows
            two_inter = gate_up.shape[1]
            order = torch.cat([torch.arange(0, two_inter, 2), torch.arange(1, two_inter, 2)])
            gate_up = gate_up[:, order]
            biases[0] = biases[0][:, order]
            if scales is not None:
                scales[0] = scales[0][:, order]
            self.gate, self.alpha, self.limit = "gpt_oss", float(experts.alpha), float(experts.limit)
        for name, tensors in (("scale", scales), ("bias", biases)):
            for prefix, t in zip(("gate_up", "down"), tensors or (None, None)):
                self.register_buffer(f"{prefix}_{name}", None if t is None else t.contiguous())
        self.num_experts, two_inter, self.hidden = gate_up.shape
        self.inter = two_inter // 2
        self.gate_up = torch.nn.Parameter(torch.stack([pack(w) for w in gate_up]), requires_grad=False)
        self.down = torch.nn.Parameter(torch.stack([pack(w) for w in down]), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return torch.ops.pdserve.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up, self.down,
                                             self.inter, self.layout, self.gate_up_scale, self.down_scale,
                                             self.gate_up_bias, self.down_bias, self.gate, self.alpha,
                                             self.limit)  # fmt: skip

    def extra_repr(self) -> str:
        int8 = ", int8" if self.int8 else ""
        gate = f", gate={self.gate}" if self.gate != "silu" else ""
        return (f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, layout={self.layout}"
                f"{int8}{gate}")  # fmt: skip


class PackedRouter(torch.nn.Module):
    """A top-k router of :data:`_ROUTERS` (or a copy) with its logits from a packed linear layer (the stock one is
    ``F.linear`` over the plain weight: 53 us a layer in bf16 at one token on a Zen 4 VM, where the paged attention
    took 14); the rest op for op the reference's forward."""

    def __init__(self, router: torch.nn.Module, kind: str, prefill: bool = False) -> None:
        super().__init__()
        weight = router.weight.detach()
        bias = router.bias if kind == "GptOssTopKRouter" else None
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.linear = PackedLinear(linear, kernel=True, prefill=prefill)
        self.mixtral = kind == "MixtralTopKRouter"  # a softmax of the logits in fp32, fp32 weights out
        self.gpt_oss = kind == "GptOssTopKRouter"  # the logits with a bias, a softmax of the top k in their dtype
        # GLM-4-MoE (DeepSeek-V3's routing): float logits (the weight float, the tokens made float), sigmoid scores,
        # the top k chosen by score plus a correction bias within the best groups, their scores normalized, scaled
        self.glm = kind == "Glm4MoeTopkRouter"
        if self.glm:
            self.register_buffer("correction_bias", router.e_score_correction_bias.detach().float().clone())
            self.num_group, self.topk_group = int(router.num_group), int(router.topk_group)
            self.routed_scaling_factor = router.routed_scaling_factor
        self.top_k, self.hidden_dim = int(router.top_k), int(router.hidden_dim)
        self.norm_topk_prob = bool(getattr(router, "norm_topk_prob", True))

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        if self.glm:
            return self._glm(hidden_states)
        logits = self.linear(hidden_states)
        if self.gpt_oss:
            top, index = torch.topk(logits, self.top_k, dim=-1)
            return logits, torch.nn.functional.softmax(top, dim=1, dtype=top.dtype), index
        if self.mixtral:
            top, index = torch.topk(torch.nn.functional.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
            top /= top.sum(dim=-1, keepdim=True)
            return logits, top, index
        top, index = torch.topk(torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    def _glm(self, hidden_states: torch.Tensor):
        """Glm4MoeTopkRouter's forward over the packed float weight; with one group (GLM-4.5's) its group mask keeps
        every expert, so it is not built."""
        logits = self.linear(hidden_states.float())
        scores = logits.sigmoid()
        choice = scores + self.correction_bias
        if self.num_group > 1:
            experts = choice.shape[-1]
            group_scores = choice.view(-1, self.num_group, experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, experts // self.num_group)
            choice = choice.masked_fill(~score_mask.reshape(-1, experts).bool(), float("-inf"))
        index = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return logits, weights * self.routed_scaling_factor, index


def fuse_experts(model: torch.nn.Module, prefill: bool = False) -> int:
    """Replace each fitting experts module of ``model`` (see the module doc) by a :class:`PackedExperts`, and each
    router of :data:`_ROUTERS` (or a copy) by a :class:`PackedRouter`, whose output matches it on random tokens
    and routing; returns how many. Needs the engine's CPU kernels (the caller checked that they loaded).
    ``prefill``: the routers' layout of a prefill worker (as for the linear layers); its experts are packed as a
    decode engine's (see :func:`_fitting`)."""
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = _router_kind(child)
            if kind is not None:
                router = PackedRouter(child, kind, prefill)
                if _same_routing(router, child):
                    setattr(parent, name, router)
                    done += 1
                else:
                    log.warning("keeping %s for %s: the packed router differs", type(child).__name__, name)
                continue
            layout = _fitting(child)
            if layout is None:
                continue
            packed = PackedExperts(child, layout)
            if _same_output(packed, child):
                setattr(parent, name, packed)
                done += 1
            else:
                log.warning("keeping %s for %s: packed experts differ", type(child).__name__, name)
    return done


def _router_kind(module: torch.nn.Module) -> str | None:
    """The reference router ``module``'s forward repeats, where its weight is a plain packable [experts, hidden]."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(weight) is not torch.nn.Parameter or weight.dim() != 2:
        return None
    if bias is not None and (type(bias) is not torch.nn.Parameter or bias.shape != weight.shape[:1]):
        return None
    if not packing_supported(weight.dtype, weight.device):
        return None
    if not isinstance(getattr(module, "top_k", None), int) or getattr(module, "hidden_dim", None) != weight.shape[1]:
        return None
    return same_forward(type(module), _ROUTERS)


def _same_routing(router: PackedRouter, module: torch.nn.Module) -> bool:
    """Whether ``router`` picks ``module``'s experts with its weights (and logits) on 9 random tokens."""
    weight = module.weight
    x = torch.randn(9, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        got, want = router(x), module(x)
    tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
    if any(g.dtype != w.dtype or g.shape != w.shape for g, w in zip(got, want)) or not torch.equal(got[2], want[2]):
        return False
    return all(torch.allclose(g.float(), w.float(), rtol=tol, atol=tol) for g, w in zip(got[:2], want[:2]))


def _fitting(module: torch.nn.Module) -> str | None:
    """The packed layout for ``module``'s experts, or None where transformers' default arithmetic does not cover
    it or the engine's kernels do not take its weights. A prefill worker's experts take this layout too: oneDNN's,
    which its linear layers take on AMX CPUs, is no layout of ``moe_experts``, and the model's own experts ran a
    1,024-token Qwen3-MoE prefill (bf16, 2-core Xeon with AMX) in 160 ms against 107 ms on AMX tiles. int8 experts
    (:class:`Int8Experts`) take the layouts where the kernels widen int8 values: fp32's blocks, bf16's pairs (not
    the AMX tiles, which load bf16 alone)."""
    if isinstance(module, Int8Experts):
        if not packing_supported(module.dtype, module.gate_up.device) or module.hidden % 2 or module.inter % 2:
            return None
        if module.dtype == torch.float32 and torch.ops.pdserve.fp32_linear_supported():
            return "fp32_blocks"
        if module.dtype == torch.bfloat16 and torch.ops.pdserve.bf16_linear_supported():
            return "bf16_pairs"
        return None
    if _gpt_oss_arithmetic(module):  # transposed: each expert's [hidden, 2 x inter] and [inter, hidden]
        gate_up, down = module.gate_up_proj.transpose(1, 2), module.down_proj.transpose(1, 2)
    elif _default_arithmetic(module):
        gate_up, down = module.gate_up_proj, module.down_proj
    else:
        return None
    layout = _own_layout(gate_up[0])
    if layout not in _LAYOUTS or _own_layout(down[0]) != layout:
        return None
    return layout


def _gpt_oss_arithmetic(module: torch.nn.Module) -> bool:
    """Whether ``module``'s experts compute GPT-OSS's arithmetic over plain weights: transposed, interleaved gate
    and up columns, biases, its clamped gate (``GptOssExperts._apply_gate``), the experts loop of transformers'
    default path."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    params = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")]
    if any(type(p) is not torch.nn.Parameter or type(p.data) is not torch.Tensor for p in params):
        return False
    if getattr(type(module), "_apply_gate", None) is not GptOssExperts._apply_gate:
        return False
    if not (getattr(module, "has_bias", False) and getattr(module, "is_transposed", False)) or any(
            getattr(module, flag, True) for flag in ("is_concatenated", "has_post_expert_norm",
                                                     "_is_expert_parallel")):  # fmt: skip
        return False
    if not all(isinstance(getattr(module, n, None), (int, float)) for n in ("alpha", "limit")):
        return False
    gate_up, down, gate_up_bias, down_bias = params
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2] % 2:
        return False
    experts, hidden, two_inter = gate_up.shape
    return down.shape == (experts, two_inter // 2, hidden) and gate_up_bias.shape == (experts, two_inter) \
        and down_bias.shape == (experts, hidden)  # fmt: skip


def _has_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds experts as transformers does: 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) \
        and gate_up.dim() == 3 and down.dim() == 3  # fmt: skip


def _default_arithmetic(module: torch.nn.Module) -> bool:
    """Whether ``module``'s experts compute transformers' default arithmetic (the module doc) over plain weights."""
    from transformers.integrations.moe import _default_apply_gate

    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if type(gate_up) is not torch.nn.Parameter or type(down) is not torch.nn.Parameter:  # DTensors, quantized
        return False
    if type(gate_up.data) is not torch.Tensor or type(down.data) is not torch.Tensor:
        return False
    if not (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)) or any(
            getattr(module, flag, True) for flag in ("has_bias", "is_transposed", "has_post_expert_norm",
                                                     "_is_expert_parallel")):  # fmt: skip
        return False
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        return False
    if type(getattr(module, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
        return False
    return not (gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] or gate_up.shape[1] % 2
                or down.shape[1:] != (gate_up.shape[2], gate_up.shape[1] // 2))  # fmt: skip


def _same_output(packed: PackedExperts, module: torch.nn.Module) -> bool:
    """Whether ``packed`` gives ``module``'s output on 7 random tokens, each routed to distinct random experts."""
    dtype = packed.gate_up_scale.dtype if packed.int8 else packed.gate_up.dtype
    generator = torch.Generator().manual_seed(0)
    top_k = min(2, packed.num_experts)
    x = torch.randn(7, packed.hidden, generator=generator).to(dtype)
    index = torch.stack([torch.randperm(packed.num_experts, generator=generator)[:top_k] for _ in range(7)])
    weights = torch.rand(7, top_k, generator=generator).softmax(-1).to(dtype)
    with torch.inference_mode():
        got, want = packed(x, index, weights).float(), module(x, index, weights).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()))
