"""Tensor parallelism: one engine over N processes, each holding 1/N of every layer.

The model is sharded by transformers' own tensor-parallel plan (the config's ``base_model_tp_plan`` and the
class's ``_tp_plan``: q/k/v/gate/up projections column-wise, o/down projections row-wise followed by an
all-reduce, the input embeddings vocabulary-parallel, the LM head column-wise with its output gathered), loaded
with ``from_pretrained(distributed_config=DistributedConfig(tp_size=N))`` over ``torch.distributed`` (gloo on
the CPU, NCCL on CUDA). Each rank holds the query and KV heads of its shard, so its paged KV cache has
``num_kv_heads / N`` heads and the paged attention function runs on them unchanged.

Roles, by rank:

- rank 0, the *driver*, runs the engine as on one process (scheduler, block pool, sampler, requests); before
  each forward pass its engine calls :meth:`TensorParallelGroup.send_step` with the step's packed batch;
- ranks 1..N-1, the *followers*, build the same engine from the same :class:`EngineConfig` and run
  :func:`run_follower`: receive a step (:meth:`TensorParallelGroup.receive_step`), run its forward pass, drop
  the logits, until the driver's :meth:`TensorParallelGroup.close` sends the stop. All ranks agree on the KV
  block count (:meth:`TensorParallelGroup.agree_min`) and have equal local head counts, so the batch's index
  tensors (slots, block tables) mean the same on every rank and travel as they are.

Every forward pass is a collective, so only the driver's engine is ever stepped and the followers run its steps
in its order. Steps travel on a separate gloo group of CPU tensors whose timeout is long (a follower waits there
while the server idles); the model's own collectives use the default group, whose timeout bounds start-up.

Life cycle of each rank: :meth:`TensorParallelGroup.initialize` →
``load_model(..., tensor_parallel=group)`` → ``LLMEngine(loaded, config)`` → driver: steps, then
``engine.close()``; follower: ``run_follower(engine)``, then ``group.close()``. :mod:`common.engine.tp_launcher`
does all of it on one host.

Not supported with tensor parallelism yet (the engine raises ValueError): the disaggregated KV hand-off
(``prefill_only``, ``kv_layer_sink``, ``reserve_kv``/``import_kv``), KV spill tiers, quantization; the CPU
packed-linear path is skipped (the weights are DTensor shards with TP forward hooks).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from common.engine.attention import AttentionGroup, AttentionMetadata
from common.engine.model_runner import StepBatch

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from common.engine.engine import LLMEngine
    from common.engine.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0  # the default group: rendezvous, loading, every collective of a forward pass
DEFAULT_IDLE_TIMEOUT_S = 365 * 24 * 3600.0  # the step group: how long a follower waits for the next step
HEADER_INTS = 256  # fixed length of a step header (int64)

_STEP, _STOP = 1, 0  # header[0]
_NONE, _INT, _TENSOR, _LIST = 0, 1, 2, 3  # value kinds in a header
# dtypes a step tensor may have, by code
_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32, torch.bfloat16,
           torch.float16)
# fields that stay on the driver (requests) or that each rank fills with its own object
_LOCAL_FIELDS = frozenset({"sampling_requests", "kv_cache", "on_layer_written"})
_NESTED = {"attn": AttentionMetadata}  # StepBatch fields holding a dataclass
_LISTS = {"groups": AttentionGroup}  # fields holding a list of dataclasses


class TensorParallelGroup:
    """This process's place in a tensor-parallel engine: rank, world size, the step channel, and shutdown.

    Called on every rank, in the same order: :meth:`initialize`, :meth:`local_kv_heads`, :meth:`agree_min`
    (the engine does the last two); then only the driver calls :meth:`send_step` and only followers
    :meth:`receive_step`; :meth:`close` on every rank.
    """

    def __init__(self, rank: int, world_size: int, step_group: Any, *, owns_process_group: bool,
                 followers: Sequence[BaseProcess] = ()) -> None:
        self.rank = rank
        self.world_size = world_size
        self._step_group = step_group
        self._owns_process_group = owns_process_group
        self._followers = list(followers)
        self._closed = False

    @classmethod
    def initialize(cls, rank: int, world_size: int, *, device: str | torch.device = "cpu",
                   init_method: str = "env://", startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                   idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                   followers: Sequence[BaseProcess] = ()) -> TensorParallelGroup:
        """Join (or, when torch.distributed is not initialized yet, create) the process group; collective.

        The backend is NCCL for a CUDA ``device``, gloo otherwise. ``startup_timeout_s`` bounds the rendezvous
        and each collective of the model; ``idle_timeout_s`` how long followers wait between steps.
        ``followers``: the driver's spawned follower processes, joined by :meth:`close`. Raises ValueError
        for a bad rank or world size, or a process group of another size.
        """
        if world_size < 2:
            raise ValueError(f"tensor parallelism needs a world size >= 2, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        owns = not dist.is_initialized()
        if owns:
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=startup_timeout_s))
        elif (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise ValueError(f"torch.distributed runs rank {dist.get_rank()} of {dist.get_world_size()}, "
                             f"not rank {rank} of {world_size}")
        step_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=idle_timeout_s))
        return cls(rank, world_size, step_group, owns_process_group=owns, followers=followers)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def distributed_config(self):
        """What ``from_pretrained`` needs to shard the model by its own plan over this group."""
        from transformers.distributed import DistributedConfig

        return DistributedConfig(tp_size=self.world_size)

    def local_kv_heads(self, model: torch.nn.Module, num_kv_heads: int) -> int:
        """KV heads of ``model`` on this rank under its plan (transformers' own count); ValueError if uneven."""
        from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

        local = get_kv_heads_per_rank(model.tp_plan, num_kv_heads, self.world_size)
        if local is None:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split evenly over {self.world_size} ranks")
        return int(local)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over all ranks (collective)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._step_group)
        return int(t.item())

    # -- the step channel -------------------------------------------------------------------------------------

    def send_step(self, batch: StepBatch) -> None:
        """Driver: send one step's batch to every follower (before running it here)."""
        header, body = encode_step(batch)
        self._broadcast(header, body)

    def receive_step(self, kv_cache: PagedKVCache, device: torch.device) -> StepBatch | None:
        """Follower: the driver's next step, rebuilt on this rank's cache and device; None once it stops.

        Blocks until the driver sends (at most the idle timeout)."""
        header = torch.empty(HEADER_INTS, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._step_group)
        ints = header.tolist()
        if ints[0] == _STOP:
            return None
        body = torch.empty(ints[1], dtype=torch.uint8)
        if ints[1]:
            dist.broadcast(body, src=0, group=self._step_group)
        return decode_step(ints, body, kv_cache, device)

    def _broadcast(self, header: torch.Tensor, body: torch.Tensor | None) -> None:
        dist.broadcast(header, src=0, group=self._step_group)
        if body is not None and body.numel():
            dist.broadcast(body, src=0, group=self._step_group)

    # -- shutdown ---------------------------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Driver: stop the followers and join the processes it spawned (terminated past ``timeout_s``).
        Every rank: leave the process group if :meth:`initialize` created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.is_driver:
            try:
                header = torch.zeros(HEADER_INTS, dtype=torch.int64)
                header[0] = _STOP
                self._broadcast(header, None)
            except RuntimeError as exc:  # a follower already gone: nothing left to stop there
                log.warning("tensor parallel: could not send the stop to every follower: %s", exc)
        self._reap(timeout_s)
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def abort(self) -> None:
        """Driver, after a failed start: terminate the spawned followers and leave the process group."""
        self._closed = True
        for proc in self._followers:
            proc.terminate()
        self._reap(5.0)
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def _reap(self, timeout_s: float) -> None:
        for proc in self._followers:
            proc.join(timeout_s)
            if proc.is_alive():
                log.warning("tensor parallel: follower %s did not stop in %.0f s; terminating it", proc.name,
                            timeout_s)
                proc.terminate()
                proc.join(5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5.0)


def run_follower(engine: LLMEngine) -> int:
    """Run the driver's steps on this follower rank until the driver stops; returns the number of steps."""
    group = engine.loaded.tensor_parallel
    if group is None or group.is_driver:
        raise ValueError("run_follower needs an engine of a follower rank (tensor_parallel rank >= 1)")
    num_steps = 0
    while (batch := group.receive_step(engine.kv_cache, engine.device)) is not None:
        engine.runner.run(batch)
        num_steps += 1
    return num_steps


# -- encoding a step: a header of ints and one body of tensor bytes --------------------------------------------
#
# The header lists the values of StepBatch's fields (and of the dataclasses inside it) in declaration order, less
# _LOCAL_FIELDS: None → [_NONE]; int → [_INT, v]; tensor → [_TENSOR, dtype code, on device?, ndim, *shape];
# list of dataclasses → [_LIST, n] then each item's fields. header[0] is _STEP, header[1] the body's bytes.


def encode_step(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [HEADER_INTS] int64, body [bytes] uint8) of a step; TypeError naming a field it cannot send."""
    ints: list[int] = [_STEP, 0]
    tensors: list[torch.Tensor] = []
    _encode_fields(batch, ints, tensors, "StepBatch")
    if len(ints) > HEADER_INTS:
        raise ValueError(f"a step header of {len(ints)} ints exceeds HEADER_INTS ({HEADER_INTS})")
    flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    body = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    ints[1] = body.numel()
    header = torch.zeros(HEADER_INTS, dtype=torch.int64)
    header[: len(ints)] = torch.tensor(ints, dtype=torch.int64)
    return header, body


def decode_step(ints: list[int], body: torch.Tensor, kv_cache: PagedKVCache, device: torch.device) -> StepBatch:
    """The StepBatch that :func:`encode_step` encoded, on ``kv_cache`` and ``device``, with no requests."""
    reader = _Reader(ints, body, device)
    reader.pos = 2
    local = {"sampling_requests": [], "kv_cache": kv_cache, "on_layer_written": None}
    return _decode_fields(StepBatch, reader, local)


def _sent_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def _encode_fields(obj: Any, ints: list[int], tensors: list[torch.Tensor], where: str) -> None:
    for f in _sent_fields(type(obj)):
        if f.name in _LOCAL_FIELDS:
            continue
        value, at = getattr(obj, f.name), f"{where}.{f.name}"
        if f.name in _NESTED:
            _encode_fields(value, ints, tensors, at)
        elif value is None:
            ints.append(_NONE)
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _DTYPES:
                raise TypeError(f"{at}: cannot send a {value.dtype} tensor to the follower ranks")
            ints += [_TENSOR, _DTYPES.index(value.dtype), int(value.device.type != "cpu"), value.dim(),
                     *value.shape]
            tensors.append(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            ints += [_INT, value]
        elif isinstance(value, list) and f.name in _LISTS:
            ints += [_LIST, len(value)]
            for i, item in enumerate(value):
                _encode_fields(item, ints, tensors, f"{at}[{i}]")
        else:
            raise TypeError(f"{at}: cannot send a {type(value).__name__} to the follower ranks")


class _Reader:
    def __init__(self, ints: list[int], body: torch.Tensor, device: torch.device) -> None:
        self.ints, self.body, self.device = ints, body, device
        self.pos = 0
        self.offset = 0  # bytes of the body consumed

    def take(self, n: int = 1) -> list[int]:
        out = self.ints[self.pos : self.pos + n]
        self.pos += n
        return out

    def value(self) -> Any:
        (kind,) = self.take()
        if kind == _NONE:
            return None
        if kind == _INT:
            return self.take()[0]
        if kind != _TENSOR:
            raise ValueError(f"step header: unexpected value kind {kind} at {self.pos - 1}")
        code, on_device, ndim = self.take(3)
        shape = self.take(ndim)
        dtype = _DTYPES[code]
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = self.body[self.offset : self.offset + nbytes]
        self.offset += nbytes
        t = raw.clone().view(dtype).reshape(shape)
        return t.to(self.device) if on_device else t


def _decode_fields(cls: type, reader: _Reader, local: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for f in _sent_fields(cls):
        if f.name in _LOCAL_FIELDS:
            kwargs[f.name] = local[f.name]
        elif f.name in _NESTED:
            kwargs[f.name] = _decode_fields(_NESTED[f.name], reader, local)
        elif f.name in _LISTS:
            kind, n = reader.take(2)
            if kind != _LIST:
                raise ValueError(f"step header: {cls.__name__}.{f.name} is not a list (kind {kind})")
            kwargs[f.name] = [_decode_fields(_LISTS[f.name], reader, local) for _ in range(n)]
        else:
            kwargs[f.name] = reader.value()
    return cls(**kwargs)
