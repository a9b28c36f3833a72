"""Engine configuration: one dataclass, validated on construction, with memory-budget resolution."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.engine.block_pool import PLACEMENTS

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30  # like vLLM's CPU backend default of 4 GiB
DEFAULT_CUDA_KV_CACHE_FRACTION = 0.8
WEIGHT_LAYOUTS = ("decode", "prefill")
PREFILL_ATTENTIONS = ("auto", "kernel", "sdpa")


@dataclass
class EngineConfig:
    """How one engine runs a model.

    ``kv_cache_memory``: bytes of KV cache when > 1, a fraction of the device's free memory when in (0, 1],
    or ``None`` for the default (CPU: min(4 GiB, 25% of available RAM); CUDA: 80% of free memory after the
    weights). ``num_kv_blocks`` overrides the budget with an exact block count (tests, benchmarks). The pool
    is never made larger than ``max_num_seqs * max_model_len`` tokens need.
    """

    block_size: int = 16
    kv_cache_memory: float | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's context length
    max_num_batched_tokens: int = 2048  # token budget of one step
    prefill_chunk_size: int | None = None  # most new tokens of one sequence in one step; default: the budget
    seed: int = 0  # seed of the sampler's generator for requests without their own seed
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's choice
    cpu_packed_linear: bool = True  # oneDNN matmuls over pre-packed weights on the CPU (see cpu_linear)
    cpu_kernels: bool = True  # the engine's C++ CPU kernels: decode attention from the paged cache, RMSNorm
    flat_forward: bool = True  # Llama/Qwen2/Mistral over the fused modules: one loop over the layers (see flat_forward)
    # decode steps replayed from CUDA graphs, one per batch and context bucket (see cuda_graphs); on the CPU the
    # same padded, static-shape path runs eagerly (slower: for tests)
    cuda_graphs: bool = False
    prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (see prefix_cache)
    prefix_cache_ttl_s: float | None = None  # forget cached blocks unused this long (None: only LRU eviction)
    kv_block_placement: str = "lru"  # which free blocks a request gets: "lru" or "contiguous" (see block_pool)
    # what the packed weights' layouts are chosen for: "decode" (steps of a few rows: the engine's own kernels) or
    # "prefill" (batches of prompt tokens: oneDNN's GEMM layout for bf16 on AMX CPUs; see cpu_linear)
    weight_layout: str = "decode"
    # how prefill steps attend on the CPU: "kernel" (the engine's flash attention, common/engine/csrc/
    # prefill_attention.cpp: bf16 on AVX512-BF16 CPUs, on AMX tiles where the CPU has them, fp32 on AVX-512, both in
    # float on AVX2 CPUs without AVX-512), "sdpa"
    # (torch's SDPA; chunks continuing their sequences gathered and masked), "auto" (the kernel where built, except
    # bf16 on AMX CPUs for head dims the AMX path does not cover: torch's attention runs on AMX tiles there)
    prefill_attention: str = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_kv_blocks", "max_model_len", "prefill_chunk_size", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_block_placement not in PLACEMENTS:
            raise ValueError(
                f"kv_block_placement must be one of {', '.join(PLACEMENTS)}, got {self.kv_block_placement!r}"
            )
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}, got {self.weight_layout!r}")
        if self.prefill_attention not in PREFILL_ATTENTIONS:
            raise ValueError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTIONS)}, "
                             f"got {self.prefill_attention!r}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 (bytes, or a fraction <= 1), got {self.kv_cache_memory!r}")

    @classmethod
    def from_settings(cls, settings) -> EngineConfig:
        """From any object with the CLI's names (``threads`` for ``num_threads``): parsed flags, a service's
        settings dataclass."""
        return cls(
            block_size=settings.block_size,
            kv_cache_memory=settings.kv_cache_memory,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            prefill_chunk_size=settings.prefill_chunk_size,
            num_threads=settings.threads,
            prefix_caching=getattr(settings, "prefix_caching", True),
            prefix_cache_ttl_s=getattr(settings, "prefix_cache_ttl_s", None) or None,
            cuda_graphs=bool(getattr(settings, "cuda_graphs", False)),
            kv_block_placement=getattr(settings, "kv_block_placement", "lru"),
            weight_layout=getattr(settings, "weight_layout", "decode"),
            prefill_attention=getattr(settings, "prefill_attention", "auto"),
        )

    @property
    def chunk_size(self) -> int:
        return min(self.prefill_chunk_size or self.max_num_batched_tokens, self.max_num_batched_tokens)

    def kv_cache_bytes(self, device: torch.device) -> int:
        """The KV budget in bytes on ``device`` (see the class docstring)."""
        free = _free_memory_bytes(device)
        if self.kv_cache_memory is None:
            if device.type == "cuda":
                return int(free * DEFAULT_CUDA_KV_CACHE_FRACTION)
            return min(DEFAULT_CPU_KV_CACHE_BYTES, free // 4)
        if self.kv_cache_memory <= 1:
            return int(free * self.kv_cache_memory)
        return int(self.kv_cache_memory)


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        # memory torch's allocator holds but no tensor uses (the full-precision weights an int8 quantization
        # replaced) counts as free only once handed back to the driver
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
