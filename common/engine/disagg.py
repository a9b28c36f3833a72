"""The disaggregated hand-off API of :class:`~common.engine.engine.LLMEngine` (a mixin).

Prefill side (sender):

- ``add_request(..., prefill_only=True)`` runs a prompt to its first token; with a ``kv_layer_sink`` the
  engine hands each layer's prompt KV to the sink during that forward pass (:meth:`_stream_layer`), or its block
  ids to the ``kv_block_sink`` where that takes them;
- :meth:`export_kv` ends the request here: its tokens, generator state and (optionally) its KV.

Decode side (receiver):

- :meth:`reserve_kv` takes blocks under a lease before the KV is sent;
- :meth:`write_kv` lands chunks of blocks, layer by layer, in any order;
- :meth:`admit_reserved` starts decoding once everything arrived; :meth:`release_kv` gives up;
- :meth:`import_kv` does all three for a whole :class:`KVHandoff` at once.

The hand-off format is canonical: a :class:`KVHandoff` and every :meth:`write_kv` chunk carry all the model's
KV heads (``[n, bs, H, D]``, laid out by ``LLMEngine.handoff_spec``), whatever the tensor-parallel layout of
either engine, so a tensor-parallel prefill engine can hand off to a one-process decode engine and the other way
round. On one process that is the cache's own layout. With tensor parallelism (the driver's engine) each rank
caches only its share of the heads: :meth:`export_kv` gathers them from every rank and :meth:`write_kv` sends
every rank its heads, over the step channel of :mod:`common.engine.tensor_parallel`; ``kv_layer_sink`` is not
supported there (export after the prefill with ``export_kv(with_kv=True)`` instead).

The methods use the engine's pool, cache, scheduler and request table; like the engine, they are not
thread-safe. On one process :meth:`write_kv` is the exception: it touches only the reservation's own blocks,
so it may run beside a step. With tensor parallelism :meth:`export_kv`, :meth:`write_kv` and
:meth:`import_kv` are collectives with the follower ranks: call them on the engine's own thread, between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from common.engine.kv_handoff import KVHandoff
from common.engine.request import Request, RequestStatus
from common.engine.sampling_params import SamplingParams
from common.kv_transfer.staging import stage_async

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from common.engine.engine import LLMEngine


class KVHandoffMixin:
    def _stream_layer(self: LLMEngine, requests: list[Request], layer: int) -> None:
        """Hand one layer's prompt KV of prefill-only requests to the sink (attention calls it per layer). On
        CUDA the copies go to pinned host memory at once, asynchronously (``stage_async``), and reach the sink in
        order as they complete: at the next layers' calls, the rest at the step's end (:meth:`_deliver_staged`)."""
        for request in requests:
            num_blocks = -(-request.num_tokens // self.kv_spec.block_size)
            blocks = request.block_ids[:num_blocks]
            if self.kv_block_sink is not None and self.kv_block_sink(request.request_id, layer, blocks):
                continue  # taken in place, by block id
            k, v = self.kv_cache.read_blocks(layer, blocks)
            if k.is_cuda:
                self._staged.append((request.request_id, layer, *stage_async(k, v)))
            else:
                self.kv_layer_sink(request.request_id, layer, k, v)
        self._deliver_staged(wait=False)

    def _deliver_staged(self: LLMEngine, *, wait: bool) -> None:
        """Hand the sink the staged layers whose copies to the host completed, in the order staged; every one if
        ``wait`` (the step's end)."""
        while self._staged:
            request_id, layer, k, v, ready = self._staged[0]
            if not wait and not ready.query():
                return
            ready.synchronize()
            self._staged.popleft()
            self.kv_layer_sink(request_id, layer, k, v)

    def export_kv(self: LLMEngine, request_id: str, *, with_kv: bool = True) -> KVHandoff:
        """The KV of a prefilled request (see ``prefill_only``); frees its blocks here. Called once.

        ``with_kv=False`` leaves ``layers`` empty: for a request whose KV already left layer by layer
        through ``kv_layer_sink``, the hand-off then carries only the tokens and the generator state.
        The KV has every KV head of the model (``spec`` is :attr:`handoff_spec`); with tensor parallelism
        it is gathered from every rank (a collective: call between steps, on the engine's thread).
        """
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.PREFILLED:
            state = "unknown" if request is None else request.status.value
            raise ValueError(f"request {request_id!r} has no exportable KV (state: {state})")
        num_blocks = -(-request.num_computed_tokens // self.kv_spec.block_size)
        blocks = request.block_ids[:num_blocks]
        layers = []
        if with_kv and self.tensor_parallel is not None:  # every rank's heads, gathered on the step channel
            layers = self.tensor_parallel.gather_kv(self.kv_cache, blocks, self.handoff_spec.num_kv_heads)
        elif with_kv:
            layers = [self.kv_cache.read_blocks(layer, blocks) for layer in range(self.kv_spec.num_layers)]
        handoff = KVHandoff(
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            num_kv_tokens=request.num_computed_tokens,
            spec=self.handoff_spec,
            layers=layers,
            model_fingerprint=self.loaded.fingerprint,
            generator_state=None if request.generator is None else request.generator.get_state(),
        )
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.status = RequestStatus.FINISHED
        del self._requests[request_id]
        return handoff

    def import_kv(
        self, handoff: KVHandoff, sampling: SamplingParams, *, request_id: str | None = None
    ) -> str:
        """Continue a request prefilled elsewhere, with all its KV at hand (reserve + write + admit).

        Raises ValueError if the KV does not fit this engine's model or layout (:attr:`handoff_spec`: all KV
        heads, whatever either side's tensor-parallel size), NoFreeBlocksError if the pool cannot hold it now;
        nothing is left allocated on failure.
        """
        handoff.check_compatible(self.handoff_spec, self.loaded.fingerprint)
        rid = request_id or handoff.request_id
        self.reserve_kv(rid, handoff.num_kv_tokens, lease_s=60.0)
        try:
            for layer, (k, v) in enumerate(handoff.layers):
                self.write_kv(rid, layer, 0, k, v)
            return self.admit_reserved(
                rid, handoff.prompt_token_ids, handoff.output_token_ids, sampling, handoff.generator_state
            )
        except Exception:
            self.reservations.release(rid)
            raise

    # -- the decode side of the hand-off: reserve, receive layer by layer, admit ---------------------------

    def reserve_kv(self: LLMEngine, request_id: str, num_tokens: int, *, lease_s: float) -> list[int]:
        """Reserve blocks for ``num_tokens`` tokens of KV that another engine will send; returns block ids.

        The lease ends after ``lease_s`` seconds: unless :meth:`admit_reserved` or :meth:`release_kv` came
        first, the next :meth:`step` frees the blocks. Raises NoFreeBlocksError when the pool is short.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if num_tokens >= self.max_model_len:
            raise ValueError(f"{num_tokens} tokens of KV leave no room to generate (context {self.max_model_len})")
        return list(self.reservations.reserve(request_id, num_tokens, lease_s).block_ids)

    def write_kv(
        self: LLMEngine, request_id: str, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write received KV ([n, bs, H, D] each, all the model's KV heads: :attr:`handoff_spec`) into blocks
        ``first_block .. first_block + n`` of a reservation.

        On one process it touches only the reservation's own blocks, so it may run beside a step that computes
        other blocks. With tensor parallelism it sends every rank its heads over the step channel: call it on
        the engine's thread, between steps.
        """
        reservation = self.reservations.get(request_id)
        n = k.shape[0]
        if not 0 <= layer < self.kv_spec.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.kv_spec.num_layers})")
        if first_block < 0 or first_block + n > len(reservation.block_ids):
            raise ValueError(
                f"blocks [{first_block}, {first_block + n}) are outside the {len(reservation.block_ids)} reserved "
                f"for request {request_id!r}"
            )
        blocks = reservation.block_ids[first_block : first_block + n]
        if self.tensor_parallel is None:
            self.kv_cache.write_blocks(layer, blocks, k, v)
            return
        expected = self.handoff_spec.block_shape(n)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(k.shape)}/{tuple(v.shape)} do not fit {expected} (every "
                             "KV head of the model)")
        self.tensor_parallel.write_kv(self.kv_cache, layer, blocks, k, v)

    def admit_reserved(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        sampling: SamplingParams,
        generator_state: torch.Tensor | None = None,
        *,
        report_imported: bool = True,
    ) -> str:
        """Turn a reservation whose KV has fully arrived into a running request that continues decoding.

        ``output_token_ids`` are the tokens the sender already sampled; ``sampling`` the request's original
        parameters (``max_new_tokens`` counts those tokens too); ``generator_state`` continues a seeded
        request's random stream. The first output reports the imported tokens and their text as well, unless
        ``report_imported`` is False (the sender already reported them: the text of what follows then
        continues exactly where the sender's text stopped, since detokenizer and stop-string state are
        rebuilt from the same tokens).
        """
        reservation = self.reservations.get(request_id)
        sampling.validate(self.vocab_size)
        prompt_ids = [int(t) for t in prompt_token_ids]
        self._check_prompt(prompt_ids)
        if reservation.num_tokens > len(prompt_ids) + len(output_token_ids):
            raise ValueError(
                f"request {request_id!r} reserved {reservation.num_tokens} tokens of KV but has only "
                f"{len(prompt_ids) + len(output_token_ids)} tokens"
            )
        request = self._new_request(request_id, prompt_ids, sampling, output_ids=output_token_ids)
        request.imported, request.num_imported_tokens = True, len(output_token_ids)
        request.block_ids = self.reservations.take(request_id).block_ids
        request.num_computed_tokens = reservation.num_tokens
        if request.generator is not None and generator_state is not None:
            try:
                request.generator.set_state(generator_state)
            except RuntimeError as exc:  # another device kind's generator (a CPU prefill worker, a CUDA decode one)
                log.warning("request %s: the prefill side's sampling state does not fit this %s generator (%s); "
                            "sampling goes on from the request's seed", request_id, self.device, exc)  # fmt: skip
        for token in output_token_ids:
            if self._emit_text(request, request.detokenizer.add(token)):
                break
        if report_imported:
            request.pending_token_ids = list(output_token_ids)
            request.pending_logprobs = [None] * len(output_token_ids)
        else:
            request.pending_text = ""
        self.scheduler.add(request)
        return request_id

    def hold_kv(self: LLMEngine, request_id: str, key: str) -> bool:
        """Keep a reservation's blocks under ``key``, freeing ``request_id`` for a new reservation (a retry of the
        request) while another engine may still write the old blocks; :meth:`release_kv` with ``key`` frees them.
        False if there is no reservation."""
        return self.reservations.rename(request_id, key)

    def release_kv(self: LLMEngine, request_id: str) -> bool:
        """Free a reservation (its transfer failed or was cancelled); False if there is none."""
        return self.reservations.release(request_id)
