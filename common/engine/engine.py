"""The engine: continuous batching of requests over one model and one paged KV cache.

In-process API (the services wrap it):

- :meth:`LLMEngine.add_request` queues a prompt; :meth:`LLMEngine.step` runs one scheduled forward pass
  and returns what each request produced; :meth:`LLMEngine.abort` stops a request and frees its blocks;
  :meth:`LLMEngine.generate` runs prompts to completion (blocking).
- The disaggregated hand-off: a request added with ``prefill_only=True`` stops after its first token and
  holds its blocks; :meth:`LLMEngine.export_kv` returns its KV and frees them; another engine's
  :meth:`LLMEngine.import_kv` writes the KV into its own blocks and continues decoding. The KV travels with
  every KV head of the model (:attr:`LLMEngine.handoff_spec`), so either side may be tensor-parallel.

Each step reads: schedule → prepare the packed batch → forward → sample → stop checks → report.
The engine is not thread-safe: one caller drives it (a service runs it in one thread).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from common.engine import attention, cpu_kernels
from common.engine.block_pool import BlockPool, NoFreeBlocksError
from common.engine.config import EngineConfig
from common.engine.counters import EngineCounters, RequestTimings
from common.engine.cpu_linear import fuse_gated_mlps, fuse_rms_norms, pack_linear_layers, packing_supported
from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.disagg import KVHandoffMixin
from common.engine.fused_attention import fuse_rope_attention
from common.engine.kv_cache import KVCacheSpec, PagedKVCache
from common.engine.kv_tiers import KVTiers
from common.engine.model_runner import ModelRunner
from common.engine.model_support import UnsupportedModelError, check_model
from common.engine.moe import fuse_experts
from common.engine.prefix_cache import block_hashes
from common.engine.quantization import trim_heap
from common.engine.request import (
    CompletionResult,
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
)
from common.engine.reservations import ReservationTable
from common.engine.sampler import Sampler, TokenLogprobs
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.stop_strings import StopStringMatcher
from common.malloc import tune_malloc

if TYPE_CHECKING:
    from common.engine.loader import LoadedModel

log = logging.getLogger(__name__)
MAX_UNDRAINED_TIMINGS = 65536

Prompt = str | Sequence[int]
KVLayerSink = Callable[[str, int, torch.Tensor, torch.Tensor], None]
KVBlockSink = Callable[[str, int, list[int]], bool]


class LLMEngine(KVHandoffMixin):
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        kv_layer_sink: KVLayerSink | None = None,
    ) -> None:
        """``kv_layer_sink(request_id, layer, k, v)`` receives the prompt KV of ``prefill_only`` requests
        layer by layer, during the forward pass that completes their prompt, right after each layer is
        computed (k/v: copies, [n, bs, H, D]). It runs on the engine's thread and must not block.

        ``kv_block_sink(request_id, layer, block_ids)`` (an attribute, None by default), when set, is asked first
        with the blocks of this engine's cache that hold the layer: True means it took them by block id (a
        transport that reads the cache in place, :mod:`common.kv_transfer.nixl_blocks`), and no copy is made for
        ``kv_layer_sink``. Such a reader relies on the blocks staying as they are until the request is exported
        or aborted: a prefilled request's blocks are not written again."""
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        self.tensor_parallel = tp = loaded.tensor_parallel  # None on one process (common/engine/tensor_parallel)
        if kv_layer_sink is not None:
            self._check_single_process("kv_layer_sink (layer-by-layer KV streaming)")
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(loaded.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            tune_malloc()  # a prefill's large activations stay on the heap instead of being faulted in again
        model_cfg = loaded.config.get_text_config()
        self.vocab_size = int(model_cfg.vocab_size)
        self.max_model_len = self._resolve_max_model_len(loaded.max_model_len, config.max_model_len)
        # what every layer hands its attention, seen by a probe (model_support.py: refuses what the engine would
        # compute differently): the cache's KV heads and head size, and any logit extras (a soft cap, sinks)
        attends = check_model(loaded.model, self.max_model_len)
        num_kv_heads = attends.num_kv_heads
        if tp is not None:  # the probe saw this rank's share of the heads; the hand-off speaks of all of them
            num_kv_heads = int(getattr(model_cfg, "num_key_value_heads", None) or model_cfg.num_attention_heads)
            planned = tp.local_kv_heads(loaded.model, num_kv_heads)
            if planned != attends.num_kv_heads:
                raise UnsupportedModelError(f"tensor parallelism: this rank's layers attend over "
                                            f"{attends.num_kv_heads} KV heads, not the {planned} its plan gives")
        self.kv_spec = KVCacheSpec(
            num_layers=int(model_cfg.num_hidden_layers),
            num_kv_heads=attends.num_kv_heads,
            head_dim=attends.head_dim,
            block_size=config.block_size,
            dtype=loaded.dtype,
        )  # this rank's cache: with tensor parallelism, its share of the KV heads
        self._handoff_spec = dataclasses.replace(self.kv_spec, num_kv_heads=num_kv_heads)
        num_blocks = self._resolve_num_blocks()
        if tp is not None:  # every rank must hold the same block ids
            num_blocks = tp.agree_min(num_blocks)
        loaded.model.set_attn_implementation(attention.register())
        kernels = config.cpu_kernels and self.device.type == "cpu" and cpu_kernels.load()
        if config.cpu_packed_linear and packing_supported(loaded.dtype, self.device) and tp is None:
            pack_linear_layers(loaded.model, kernel=kernels, prefill=config.weight_layout == "prefill")
            fuse_rms_norms(loaded.model, kernel=kernels)
            if kernels:
                fuse_gated_mlps(loaded.model)
                fuse_rope_attention(loaded.model)
                fuse_experts(loaded.model, prefill=config.weight_layout == "prefill")
            # the layers replaced by fused copies (an int8 model's on the heap, not on the checkpoint's map; torchao's
            # weights in reference cycles): 194 MiB of the 0.35B int8 model's RSS
            gc.collect()
            trim_heap()
        graphs = config.cuda_graphs and tp is None
        if config.cuda_graphs and not graphs:
            log.warning("cuda_graphs: off with tensor parallelism (the follower ranks replay no graphs)")
        self.block_pool = BlockPool(num_blocks, self.config.kv_block_placement)
        # with graphs, one block more than the pool hands out: where the padding rows of a graph step write
        self.kv_cache = PagedKVCache(self.kv_spec, num_blocks + graphs, self.device)
        self.kv_cache.write_kernel = kernels
        # a soft cap or sink logits (attends.extras): the CPU attention kernels compute them, other devices' in plain
        # tensor ops (attention_math.py)
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.device, decode_kernel=kernels,
                                  flat_forward=config.flat_forward,
                                  prefill_kernel=kernels
                                  and attention.cpu_prefill_kernel_chosen(config.prefill_attention, loaded.dtype,
                                                                           self.kv_spec.head_dim,
                                                                           extras=bool(attends.extras)))
        if graphs:
            max_blocks = -(-self.max_model_len // config.block_size)
            self.runner.use_graphs(max_batch=config.max_num_seqs, max_blocks=max_blocks, scratch_block=num_blocks)
        self.scheduler = Scheduler(
            self.block_pool,
            config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_chunk_size=config.chunk_size,
            watermark_blocks=max(1, num_blocks // 100),
            prefix_caching=config.prefix_caching,
        )
        self.sampler = Sampler(seed=config.seed)
        self.reservations = ReservationTable(self.block_pool, config.block_size)
        self.kv_layer_sink = kv_layer_sink
        self._staged: deque = deque()  # (request id, layer, k, v, event): CUDA layers on their way to the host
        self.kv_block_sink: KVBlockSink | None = None
        self._requests: dict[str, Request] = {}  # every request not yet finished and reported
        self.counters = EngineCounters()
        self.kv_tiers: KVTiers | None = None
        # requests that left since the last drain_timings() (bounded: an engine nobody drains keeps the newest)
        self._left: deque[RequestTimings] = deque(maxlen=MAX_UNDRAINED_TIMINGS)
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d",
            loaded.model_dir, num_blocks, config.block_size,
            num_blocks * self.kv_spec.bytes_per_block / 2**20, self.max_model_len,
        )

    # -- configuration ------------------------------------------------------------------------------------

    @staticmethod
    def _resolve_max_model_len(model_len: int, asked: int | None) -> int:
        if asked is None:
            return model_len
        if asked > model_len:
            raise ValueError(f"max_model_len {asked} exceeds the model's context of {model_len} tokens")
        return asked

    def _resolve_num_blocks(self) -> int:
        bs = self.config.block_size
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        else:
            num_blocks = self.config.kv_cache_bytes(self.device) // self.kv_spec.bytes_per_block
            needed = -(-self.config.max_num_seqs * self.max_model_len // bs)
            num_blocks = min(num_blocks, needed)
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"a KV cache of {num_blocks} blocks ({num_blocks * bs} tokens) cannot hold one request of "
                f"max_model_len {self.max_model_len} tokens: raise the KV cache memory or lower max_model_len"
            )
        return num_blocks

    @property
    def handoff_spec(self) -> KVCacheSpec:
        """Layout of the KV this engine exports and imports: :attr:`kv_spec` with every KV head of the model
        (equal to it on one process; a tensor-parallel rank's cache holds only its share of the heads)."""
        return self._handoff_spec

    def _check_single_process(self, feature: str) -> None:
        if self.tensor_parallel is not None:
            raise ValueError(f"{feature}: not supported with tensor parallelism (tensor_parallel_size "
                             f"{self.tensor_parallel.world_size}) yet")

    def close(self) -> None:
        """Release what the engine holds besides memory. With tensor parallelism, on the driver: stop the
        follower ranks and leave the process group (the engine cannot step afterwards). Idempotent."""
        if self.tensor_parallel is not None and self.tensor_parallel.is_driver:
            self.tensor_parallel.close()

    # -- requests -----------------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` exactly as stock transformers' tokenizer for this model gives them."""
        return list(self.tokenizer(text)["input_ids"])

    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> str:
        """Queue a prompt (text or token ids); returns the request id. Raises ValueError on bad input."""
        sampling = sampling or SamplingParams()
        sampling.validate(self.vocab_size)
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_prompt(prompt_ids)
        request = self._new_request(request_id, prompt_ids, sampling, prefill_only=prefill_only)
        self.scheduler.add(request)
        return request.request_id

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context of {self.max_model_len} tokens "
                "leaves no room to generate"
            )
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _new_request(
        self,
        request_id: str | None,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        prefill_only: bool = False,
        output_ids: Sequence[int] = (),
    ) -> Request:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_ids),
            sampling=sampling,
            eos_token_ids=frozenset(self.loaded.eos_token_ids),
            max_model_len=self.max_model_len,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stop_matcher=StopStringMatcher(sampling.stop),
            generator=generator,
            prefill_only=prefill_only,
            output_token_ids=list(output_ids),
        )
        self._requests[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once; False if it is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return self.reservations.release(request_id)
        if request.status is RequestStatus.PREFILLED:  # its timings were recorded when it was prefilled
            self.block_pool.free(request.block_ids)
            request.block_ids = []
        else:
            self.scheduler.remove(request)
            self._record_left(request, "abort")
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ABORT
        return True

    def attach_kv_tiers(self, tiers: KVTiers) -> None:
        """Spill evicted prefix blocks to ``tiers`` and look missing prefixes up there (prefix caching on)."""
        self._check_single_process("KV spill tiers")
        self.kv_tiers = tiers
        self.block_pool.on_evict = lambda block, name: tiers.put(name, self.kv_cache.copy_block(block))
        self.scheduler.tier_loader = self._load_from_tiers

    def _load_from_tiers(self, names: Sequence[bytes]) -> list[int]:
        """Fresh blocks holding the KV the tiers have for ``names`` from the first on (named, ref 1 each)."""
        kvs = self.kv_tiers.get_run(names)[: self.block_pool.num_free_blocks]
        if not kvs:
            return []
        blocks = self.block_pool.allocate(len(kvs))
        for block, name, kv in zip(blocks, names, kvs):
            self.kv_cache.load_block(block, kv)
            self.block_pool.name(block, name)
        return blocks

    def pin_prefixes(self, prompts: Sequence[Sequence[int]]) -> int:
        """Pin the cached full blocks of each prompt (computed before, e.g. by a 1-token request) so they are
        never evicted: warm-up of frequent prefixes. Returns the number of blocks newly pinned."""
        bs = self.config.block_size
        pinned = 0
        for prompt in prompts:
            names = block_hashes([int(t) for t in prompt], bs)
            pinned += self.block_pool.pin(self.block_pool.lookup(names))
        return pinned

    def drain_timings(self) -> list[RequestTimings]:
        """Stage times of the requests that left the engine since the last call (oldest first)."""
        left = list(self._left)
        self._left.clear()
        return left

    def _record_left(self, request: Request, reason: str) -> None:
        t = request.times
        self._left.append(RequestTimings(
            request.request_id, t.arrival_s, t.first_scheduled_s, t.first_token_s, time.monotonic(),
            len(request.prompt_token_ids), len(request.output_token_ids) - request.num_imported_tokens, reason,
            request.imported,
        ))  # fmt: skip

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_requests_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_requests_waiting(self) -> int:
        return self.scheduler.num_waiting

    # -- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; returns an output for every request that produced something."""
        self.reservations.expire()
        if self.config.prefix_cache_ttl_s is not None:
            self.block_pool.expire_cached(self.config.prefix_cache_ttl_s)
        sched = self.scheduler.schedule()
        self.counters.num_preemptions += len(sched.preempted)
        if not sched.scheduled:
            return []
        now = time.monotonic()
        for request, _ in sched.scheduled:
            if request.times.first_scheduled_s is None:
                request.times.first_scheduled_s = now
                if not request.imported and self.config.prefix_caching:
                    self.counters.num_prefix_cache_queries += request.num_tokens
                    self.counters.num_prefix_cache_hits += request.num_cached_tokens
        completing = []  # prompts whose KV streams out layer by layer during this step
        if self.kv_layer_sink is not None:
            completing = [r for r, n in sched.scheduled if r.prefill_only and r.num_computed_tokens + n == r.num_tokens]
        batch = self.runner.prepare(sched.scheduled, graphs=not completing)
        if self.tensor_parallel is not None:  # the follower ranks run the same forward pass
            self.tensor_parallel.send_step(batch)
        if completing:
            self._staged.clear()  # (left only by a step that raised: its requests failed)
            batch.attn.on_layer_written = partial(self._stream_layer, completing)
        logits = self.runner.run(batch)  # [S, V]
        if completing:
            self._deliver_staged(wait=True)
        touched = [r for r, _ in sched.scheduled]
        for request, n in sched.scheduled:
            request.num_computed_tokens += n
            self.scheduler.name_computed_blocks(request)
        if batch.sampling_requests:
            reqs = batch.sampling_requests
            sampled = self.sampler(
                logits,
                [r.sampling for r in reqs],
                [r.generator for r in reqs],
                [r.prompt_token_ids for r in reqs],
                [r.output_token_ids for r in reqs],
            )
            logprobs = sampled.logprobs or [None] * len(reqs)
            for request, token, lp in zip(reqs, sampled.token_ids.tolist(), logprobs):
                self._append_token(request, token, lp)
        return [out for r in touched if (out := self._report(r)) is not None]

    def _append_token(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
        request.pending_token_ids.append(token)
        request.pending_logprobs.append(logprobs)
        self.counters.num_generation_tokens += 1
        if request.times.first_token_s is None:
            request.times.first_token_s = time.monotonic()
            if not request.imported:
                self.counters.num_prompt_tokens += len(request.prompt_token_ids)
        sp = request.sampling
        if (not sp.ignore_eos and token in request.eos_token_ids) or token in sp.stop_token_ids:
            self._finish(request, FinishReason.STOP)  # the stop token itself is never detokenized
            return
        if self._emit_text(request, request.detokenizer.add(token)):
            self._finish(request, FinishReason.STOP, stopped_on_string=True)
        elif len(request.output_token_ids) >= sp.max_new_tokens or request.num_tokens >= request.max_model_len:
            self._finish(request, FinishReason.LENGTH)
        elif request.prefill_only:
            self.scheduler.remove(request, free_blocks=False)
            request.status = RequestStatus.PREFILLED
            self._record_left(request, "prefilled")

    def _emit_text(self, request: Request, delta: str) -> bool:
        """Pass detokenized text through the stop-string matcher; True if a stop string ended it."""
        if not delta:
            return False
        safe, stopped = request.stop_matcher.feed(delta)
        request.pending_text += safe
        return stopped

    def _finish(self, request: Request, reason: FinishReason, *, stopped_on_string: bool = False) -> None:
        if not stopped_on_string:
            if self._emit_text(request, request.detokenizer.flush()):
                reason = FinishReason.STOP
            else:
                request.pending_text += request.stop_matcher.flush()
                if request.stop_matcher.stopped:  # the held-back tail completed a stop string
                    reason = FinishReason.STOP
        self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._record_left(request, reason.value)

    def _report(self, request: Request) -> RequestOutput | None:
        if not (request.pending_token_ids or request.pending_text or request.is_finished):
            return None
        wants_logprobs = request.sampling.logprobs is not None
        out = RequestOutput(
            request_id=request.request_id,
            new_token_ids=request.pending_token_ids,
            new_text=request.pending_text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            new_logprobs=request.pending_logprobs if wants_logprobs else None,
            prefilled=request.status is RequestStatus.PREFILLED,
        )
        if out.finished or out.prefilled:
            out.times = request.times
        request.pending_token_ids, request.pending_text, request.pending_logprobs = [], "", []
        if request.is_finished:
            self._requests.pop(request.request_id, None)
        return out

    # -- blocking generation ------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[CompletionResult]:
        """Run every prompt to completion in one continuous batch; results in input order."""
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        requests = {rid: self._requests[rid] for rid in ids}
        acc = {
            rid: CompletionResult(rid, list(r.prompt_token_ids), [], "", FinishReason.LENGTH)
            for rid, r in requests.items()
        }
        with_logprobs = {rid for rid, sp in zip(ids, params) if sp.logprobs is not None}
        remaining = set(ids)
        while remaining:
            outputs = self.step()
            if not outputs and not self.scheduler.num_running:
                raise RuntimeError(
                    f"{len(remaining)} requests cannot be scheduled: {self.block_pool.num_used_blocks} KV blocks "
                    "are held by prefilled requests awaiting export_kv"
                )
            for out in outputs:
                result = acc.get(out.request_id)
                if result is None:
                    continue
                result.token_ids += out.new_token_ids
                result.text += out.new_text
                if out.request_id in with_logprobs:
                    result.logprobs = (result.logprobs or []) + (out.new_logprobs or [])
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.num_preemptions = requests[out.request_id].num_preemptions
                    remaining.discard(out.request_id)
        return [acc[rid] for rid in ids]

__all__ = ["LLMEngine", "NoFreeBlocksError"]
