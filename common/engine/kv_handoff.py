"""The KV hand-off between two engines: what a prefill engine exports and a decode engine imports.

A :class:`KVHandoff` carries one request's prompt KV (every layer, whole blocks in the request's token
order) plus what the receiver needs to continue exactly where the sender stopped: the tokens sampled so
far and the state of the request's seeded generator. Block ids are not carried: the receiver writes the
blocks into whatever ids its own pool hands out. The KV always has every KV head of the model (``spec`` is
the sender's ``LLMEngine.handoff_spec``), whatever the tensor-parallel size of the sender or the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.kv_cache import KVCacheSpec


@dataclass
class KVHandoff:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled by the sender (the first token); the receiver continues from here
    num_kv_tokens: int  # tokens whose KV the blocks hold (the prompt): positions [0, num_kv_tokens)
    spec: KVCacheSpec  # num_kv_heads: the model's full count
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each [num_blocks, block_size, Hkv, D]
    model_fingerprint: str
    generator_state: torch.Tensor | None = None  # torch.Generator.get_state() of a seeded request

    @property
    def num_blocks(self) -> int:
        return -(-self.num_kv_tokens // self.spec.block_size)

    @property
    def num_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def check_compatible(self, spec: KVCacheSpec, model_fingerprint: str) -> None:
        """Raise ValueError naming the mismatch if this KV cannot be used by an engine with ``spec``."""
        if self.model_fingerprint != model_fingerprint:
            raise ValueError(
                f"KV of request {self.request_id} comes from model {self.model_fingerprint[:12]}, "
                f"this engine runs model {model_fingerprint[:12]}"
            )
        if self.spec != spec:
            raise ValueError(f"KV of request {self.request_id} has layout {self.spec}, this engine uses {spec}")
        if len(self.layers) != spec.num_layers:
            raise ValueError(
                f"KV of request {self.request_id} has {len(self.layers)} layers, expected {spec.num_layers}"
            )
        shape = spec.block_shape(self.num_blocks)
        for i, (k, v) in enumerate(self.layers):
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(
                    f"KV of request {self.request_id}, layer {i}: shape {tuple(k.shape)}, expected {shape}"
                )
        if not 0 < self.num_kv_tokens <= len(self.prompt_token_ids) + len(self.output_token_ids):
            raise ValueError(f"KV of request {self.request_id} claims {self.num_kv_tokens} tokens")
