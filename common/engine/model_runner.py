"""Turns a scheduled step into one packed forward pass of the model and returns last-token logits.

Packed layout of a step (T tokens): first the sequences with exactly one new token (the decode group, in
scheduling order), then the others (the prefill group). Metadata is built as tensors once per step and
shared by every layer (see :mod:`common.engine.attention`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from common.engine.attention import METADATA_KWARG, AttentionGroup, AttentionMetadata
from common.engine.cuda_graphs import DecodeGraphs
from common.engine.flat_forward import FlatForward
from common.engine.kv_cache import PagedKVCache
from common.engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    input_ids: torch.Tensor | None  # [1, T] int64 (None: a graph step)
    position_ids: torch.Tensor | None  # [1, T] int64
    attn: AttentionMetadata | None
    logits_index: torch.Tensor  # [S] int64: packed index of the last token of each sampling request
    sampling_requests: list[Request]  # the S requests that get a new token this step, in logits order
    # a decode step for ModelRunner.graphs, instead of the three fields above: (token ids, positions, slots, block
    # tables), one entry a sequence (not an init field: never sent to tensor-parallel followers, which have none)
    graph_step: tuple[list[int], list[int], list[int], list[list[int]]] | None = field(default=None, init=False)


class ModelRunner:
    """Owns the model and the KV cache on the device; one :meth:`run` per engine step."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        device: torch.device,
        decode_kernel: bool = False,
        flat_forward: bool = True,
        prefill_kernel: bool = False,
    ) -> None:
        """``decode_kernel``: decode groups carry their block table and lengths for
        ``torch.ops.pdserve.paged_decode_attention`` (the caller checked that the kernel loaded).
        ``prefill_kernel``: prefill groups attend by ``torch.ops.pdserve.prefill_attention`` (whole prompts) or
        ``paged_prefill_attention`` (chunks continuing their sequences; the caller checked that they run here).
        ``flat_forward``: run the model through :class:`~common.engine.flat_forward.FlatForward` where it fits."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = device
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.flat = FlatForward.of(model) if flat_forward else None  # the layer loop without the module tree
        self.graphs: DecodeGraphs | None = None  # set by the engine with EngineConfig.cuda_graphs

    def use_graphs(self, *, max_batch: int, max_blocks: int, scratch_block: int) -> DecodeGraphs:
        """Run decode steps through :class:`~common.engine.cuda_graphs.DecodeGraphs` (CUDA graphs on a CUDA
        device; on the CPU the same static-shape path, eagerly)."""
        self.graphs = DecodeGraphs(self.forward, self.kv_cache, max_batch=max_batch, max_blocks=max_blocks,
                                   scratch_block=scratch_block, capture=self.device.type == "cuda")  # fmt: skip
        return self.graphs

    def prepare(self, scheduled: list[tuple[Request, int]], *, graphs: bool = True) -> StepBatch:
        """The packed batch of a scheduled step. ``graphs=False``: not through :attr:`graphs` (a step whose
        attention metadata the caller needs, e.g. to stream a prompt's KV layer by layer)."""
        if all(n == 1 for _, n in scheduled):
            return self._prepare_decode([r for r, _ in scheduled], graphs=graphs)
        decode = [(r, n) for r, n in scheduled if n == 1]
        prefill = [(r, n) for r, n in scheduled if n != 1]
        ordered = decode + prefill
        ids: list[int] = []
        starts: list[int] = []  # first new position of each sequence
        lengths: list[int] = []  # new tokens of each sequence
        for r, n in ordered:
            s = r.num_computed_tokens
            ids.extend(r.all_token_ids[s : s + n])
            starts.append(s)
            lengths.append(n)
        num_seqs = len(ordered)
        bs = self.block_size
        max_blocks = max(len(r.block_ids) for r, _ in ordered)
        table = torch.tensor(
            [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r, _ in ordered], dtype=torch.long
        )  # [N, nb]
        start_t = torch.tensor(starts, dtype=torch.long)
        len_t = torch.tensor(lengths, dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), len_t)  # [T]
        offsets = torch.cumsum(len_t, 0) - len_t  # packed index of each sequence's first new token
        positions = start_t[seq_of_token] + (torch.arange(len(ids)) - offsets[seq_of_token])  # [T]
        slot_mapping = table[seq_of_token, positions // bs] * bs + positions % bs
        dev = self.device
        table = table.to(dev)

        groups: list[AttentionGroup] = []
        num_decode = len(decode)
        if num_decode:
            nb = (int(start_t[:num_decode].max()) // bs) + 1
            decode_table = table[:num_decode, :nb]
            if self.decode_kernel:
                group = AttentionGroup(gather_index=None, query_pos=start_t[:num_decode, None],
                                       block_table=decode_table.contiguous(), seq_lens=start_t[:num_decode] + 1)
            else:
                group = AttentionGroup(gather_index=self.kv_cache.gather_index(decode_table),
                                       query_pos=start_t[:num_decode, None])  # fmt: skip
            groups.append(group)
        if prefill:
            p_len = len_t[num_decode:]
            p_start = start_t[num_decode:]
            q = torch.arange(int(p_len.max()))
            valid = q < p_len[:, None]  # [Bp, Q]
            token_index = torch.where(valid, offsets[num_decode:, None] + q, 0)
            query_pos = torch.where(valid, p_start[:, None] + q, 0)
            nb = -(-int((p_start + p_len).max()) // bs)
            group = AttentionGroup(
                gather_index=self.kv_cache.gather_index(table[num_decode:, :nb]),
                query_pos=query_pos,
                token_index=token_index,
                valid=valid,
            )
            if not any(starts[num_decode:]):  # whole prompts, each from position 0: their own K/V suffice
                group.fresh_prompt, group.token_start = len(prefill), int(offsets[num_decode])
                group.num_keys = max(lengths[num_decode:])
                group.fresh_bounds = torch.tensor([0] + lengths[num_decode:]).cumsum(0, dtype=torch.int32)
                group.cpu_prefill_kernel = self.prefill_kernel
            elif self.prefill_kernel:  # chunks continuing their sequences: keys read in place from the cache
                group.kernel_table = table[num_decode:, :nb].contiguous()
                group.kernel_spans = torch.stack((offsets[num_decode:], p_start, p_len), dim=1).contiguous()
                group.num_keys = int((p_start + p_len).max())
            elif len(prefill) > 1 and _padding_waste(starts[num_decode:], lengths[num_decode:]) > PER_SEQUENCE_WASTE:
                # each sequence over its own keys: padded to the longest, the attention would do much more work
                group.seq_spans = torch.stack((offsets[num_decode:], p_start, p_len), dim=1)
            groups.append(group)

        sampling = [i for i, (r, n) in enumerate(ordered) if r.num_computed_tokens + n == r.num_tokens]
        logits_index = (offsets + len_t - 1)[sampling]
        return StepBatch(
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=positions.unsqueeze(0).to(dev),
            attn=AttentionMetadata(
                kv_cache=self.kv_cache,
                write_index=self.kv_cache.write_index(slot_mapping.to(dev)),
                groups=[_to_device(g, dev) for g in groups],
            ),
            logits_index=logits_index.to(dev),
            sampling_requests=[ordered[i][0] for i in sampling],
        )

    def _prepare_decode(self, reqs: list[Request], graphs: bool = True) -> StepBatch:
        """:meth:`prepare` for a step of one new token per sequence (the steady state of decoding): the same
        batch, from Python lists with a few tensor constructions (~0.1 ms instead of ~0.3 ms a step here).

        A single sequence whose blocks are consecutive ids (the common case of a lone stream) is attended
        straight from the cache, without a gather (:attr:`AttentionGroup.first_block`)."""
        bs = self.block_size
        pos = [r.num_computed_tokens for r in reqs]
        nb = max(pos) // bs + 1
        tables = [r.block_ids[:nb] for r in reqs]
        dev = self.device
        if graphs and self.graphs is not None and self.graphs.fits(len(reqs), nb):
            return self._graph_decode(reqs, pos, tables)
        table = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.long, device=dev)
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, pos)], dtype=torch.long, device=dev)
        position_ids = torch.tensor([pos], dtype=torch.long, device=dev)
        query_pos = position_ids.view(-1, 1)
        if self.decode_kernel:  # the kernel reads the table itself: no gather index
            seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.long)
            group = AttentionGroup(gather_index=None, query_pos=query_pos, block_table=table, seq_lens=seq_lens)
        else:
            group = AttentionGroup(gather_index=self.kv_cache.gather_index(table), query_pos=query_pos)
            if len(reqs) == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + nb)):
                group.first_block, group.num_keys = tables[0][0], pos[0] + 1
        sampling = [i for i, r in enumerate(reqs) if r.num_computed_tokens + 1 == r.num_tokens]
        return StepBatch(
            input_ids=torch.tensor([[r.all_token_ids[p] for r, p in zip(reqs, pos)]], dtype=torch.long, device=dev),
            position_ids=position_ids,
            attn=AttentionMetadata(
                kv_cache=self.kv_cache, write_index=self.kv_cache.write_index(slots), groups=[group]
            ),
            logits_index=torch.tensor(sampling, dtype=torch.long, device=dev),
            sampling_requests=[reqs[i] for i in sampling],
        )

    def _graph_decode(self, reqs: list[Request], pos: list[int], tables: list[list[int]]) -> StepBatch:
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
        sampling = [i for i, r in enumerate(reqs) if r.num_computed_tokens + 1 == r.num_tokens]
        batch = StepBatch(input_ids=None, position_ids=None, attn=None,
                          logits_index=torch.tensor(sampling, dtype=torch.long, device=self.device),
                          sampling_requests=[reqs[i] for i in sampling])  # fmt: skip
        batch.graph_step = ([r.all_token_ids[p] for r, p in zip(reqs, pos)], pos, slots, tables)
        return batch

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Forward the packed batch; returns float32 logits [S, V] of the sampling requests (S may be 0).

        Through :attr:`flat` where the model has its layout. The first step that samples also runs the model's
        own forward after it (the same K/V written twice; layers streamed out only by the second) and keeps the
        flat loop only if the logits are equal bit for bit. A graph step goes to :attr:`graphs`."""
        if batch.graph_step is not None:
            return self.graphs.run(*batch.graph_step)[batch.logits_index].float()
        flat = self.flat
        if flat is not None and len(batch.logits_index):
            if flat.verified:
                return flat(batch.input_ids, batch.position_ids, batch.attn, batch.logits_index)[0].float()
            streamed, batch.attn.on_layer_written = batch.attn.on_layer_written, None
            logits = flat(batch.input_ids, batch.position_ids, batch.attn, batch.logits_index)
            batch.attn.on_layer_written = streamed
            own = self._model_logits(batch)
            if torch.equal(logits, own):
                flat.verified = True
            else:
                log.warning("the flat forward's logits differ from the model's own: running the model's")
                self.flat = None
            return own[0].float()
        own = self._model_logits(batch)
        if not len(batch.logits_index):
            return own.new_empty((0, own.shape[-1]), dtype=torch.float32)
        return own[0].float()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Logits [1, S, V] (the model's dtype) of the packed tokens at ``logits_index`` [S] (S > 0): through the
        flat loop once it was verified, else the model's own forward."""
        if self.flat is not None and self.flat.verified:
            return self.flat(input_ids, position_ids, attn, logits_index)
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          logits_to_keep=logits_index, **{METADATA_KWARG: attn}).logits  # fmt: skip

    def _model_logits(self, batch: StepBatch) -> torch.Tensor:
        """The model's own forward: logits [1, S, V] (the last token's when no request samples)."""
        keep = batch.logits_index if len(batch.logits_index) else 1
        return self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            logits_to_keep=keep,
            **{METADATA_KWARG: batch.attn},
        ).logits


# a prefill group of several sequences attends one sequence at a time when padding them to one shape would multiply
# the attention's work by more than this (measured on the 60M model: chunks of 20-160 new tokens after cached
# prefixes of 64-512, 1.38x a step one by one; 16 equal chunks of 8 after 32, 0.97x: the loop's own cost)
PER_SEQUENCE_WASTE = 1.2


def _padding_waste(starts: list[int], lengths: list[int]) -> float:
    """(queries x keys of the padded group) / (the sum over its sequences of their own queries x keys)."""
    keys = [s + n for s, n in zip(starts, lengths)]
    return len(lengths) * max(lengths) * max(keys) / sum(n * k for n, k in zip(lengths, keys))


def _to_device(group: AttentionGroup, device: torch.device) -> AttentionGroup:
    if device.type == "cpu":
        return group
    return AttentionGroup(
        gather_index=group.gather_index,
        query_pos=group.query_pos.to(device),
        token_start=group.token_start,
        first_block=group.first_block,
        num_keys=group.num_keys,
        fresh_prompt=group.fresh_prompt,
        fresh_bounds=group.fresh_bounds,
        cpu_prefill_kernel=group.cpu_prefill_kernel,
        kernel_table=group.kernel_table,
        kernel_spans=group.kernel_spans,
        seq_spans=group.seq_spans,
        block_table=group.block_table,
        seq_lens=group.seq_lens,
        token_index=None if group.token_index is None else group.token_index.to(device),
        valid=None if group.valid is None else group.valid.to(device),
    )
