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
  :func:`run_follower`: receive the driver's next message (:meth:`TensorParallelGroup.receive`) and act on
  it, until the driver's :meth:`TensorParallelGroup.close` sends the stop: a step (run its forward pass, drop
  the logits) or a KV command of the hand-off (below). All ranks agree on the KV block count
  (:meth:`TensorParallelGroup.agree_min`) and have equal local head counts, so the batch's index tensors
  (slots, block tables) and block ids mean the same on every rank and travel as they are.

Every forward pass is a collective, so only the driver's engine is ever stepped and the followers run its steps
in its order. Steps travel on a separate gloo group of CPU tensors whose timeout is long (a follower waits there
while the server idles); the model's own collectives use the default group, whose timeout bounds start-up.

Life cycle of each rank: :meth:`TensorParallelGroup.initialize` →
``load_model(..., tensor_parallel=group)`` → ``LLMEngine(loaded, config)`` → driver: steps, then
``engine.close()``; follower: ``run_follower(engine)``, then ``group.close()``. :mod:`common.engine.tp_launcher`
does all of it on one host.

The disaggregated KV hand-off (:mod:`common.engine.disagg`) works across layouts: its format is canonical, every
KV head of the model (``LLMEngine.handoff_spec``), whatever the tensor-parallel size of either side. Rank r
holds the KV heads ``[r*Hl, (r+1)*Hl)`` (Hl = its local count; transformers' column-wise q/k/v shards split the
heads in rank order). Two commands on the step channel, driver → every follower, in order with the steps:

- *gather KV* (:meth:`TensorParallelGroup.gather_kv`, from ``export_kv``): every rank reads its heads of the
  given blocks in every layer, the driver gathers them and concatenates the heads in rank order;
- *write KV* (:meth:`TensorParallelGroup.write_kv`, from ``write_kv``/``import_kv``): the driver writes its
  heads of all-head blocks into its cache and broadcasts them whole; each follower writes its own heads into
  the same block ids (only the driver allocates blocks; every rank has the same count).

Both are collectives with the followers, so the driver calls them on the engine's own thread between steps.

Not supported with tensor parallelism yet (the engine raises ValueError): ``kv_layer_sink`` (layer-by-layer
streaming during the forward pass; export after it with ``export_kv(with_kv=True)`` instead), KV spill tiers,
quantization; the CPU packed-linear path is skipped (the weights are DTensor shards with TP forward hooks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
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

_STEP, _STOP, _GATHER_KV, _WRITE_KV = 1, 0, 2, 3  # header[0]: what the message is
_NONE, _INT, _TENSOR, _LIST = 0, 1, 2, 3  # value kinds in a header
# dtypes a step tensor may have, by code
_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32, torch.bfloat16,
           torch.float16)
# fields that stay on the driver (requests) or that each rank fills with its own object
_LOCAL_FIELDS = frozenset({"sampling_requests", "kv_cache", "on_layer_written"})
_NESTED = {"attn": AttentionMetadata}  # StepBatch fields holding a dataclass
_LISTS = {"groups": AttentionGroup}  # fields holding a list of dataclasses


@dataclasses.dataclass(frozen=True)
class GatherKV:
    """Follower's part of the driver's :meth:`TensorParallelGroup.gather_kv`: send this rank's heads of
    ``block_ids`` in all ``num_layers`` layers (:meth:`TensorParallelGroup.serve`)."""

    num_layers: int
    block_ids: list[int]


@dataclasses.dataclass(frozen=True)
class WriteKV:
    """Follower's part of the driver's :meth:`TensorParallelGroup.write_kv`: write this rank's heads of
    ``key``/``value`` ([n, bs, all KV heads, D], on the CPU) into ``block_ids`` of ``layer``."""

    layer: int
    block_ids: list[int]
    key: torch.Tensor
    value: torch.Tensor


KVCommand = GatherKV | WriteKV


class TensorParallelGroup:
    """This process's place in a tensor-parallel engine: rank, world size, the step channel, and shutdown.

    Called on every rank, in the same order: :meth:`initialize`, :meth:`local_kv_heads`, :meth:`agree_min`
    (the engine does the last two); then only the driver calls :meth:`send_step`, :meth:`gather_kv` and
    :meth:`write_kv`, and only followers :meth:`receive` (and :meth:`serve` for the KV commands);
    :meth:`close` on every rank. A lock keeps each driver message whole.
    """

    def __init__(self, rank: int, world_size: int, step_group: Any, *, owns_process_group: bool,
                 followers: Sequence[BaseProcess] = (), device: str | torch.device = "cpu") -> None:
        self.rank = rank
        self.world_size = world_size
        self.device_type = torch.device(device).type
        self._step_group = step_group
        self._owns_process_group = owns_process_group
        self._followers = list(followers)
        self._closed = False
        self._channel = threading.Lock()  # one driver message (header, body, gather) at a time

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
        return cls(rank, world_size, step_group, owns_process_group=owns, followers=followers, device=device)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def distributed_config(self):
        """What ``from_pretrained`` needs to shard the model by its own plan over this group."""
        from transformers.distributed import DistributedConfig

        return DistributedConfig(tp_size=self.world_size)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Around ``from_pretrained(distributed_config=...)``: transformers builds the device mesh, and places the
        shards, on the host's accelerator (``torch._C._get_accelerator()``) whatever device the caller asked for,
        so a CPU rank on a GPU host would bind a GPU and shard onto it (and a mesh of one kind over a gloo group
        of CPU tensors). Inside this block the accelerator reads as this group's device kind; outside, it is
        torch's own again. Nothing changes where the two agree (a CPU host, or CUDA ranks on a GPU host)."""
        detect = torch._C._get_accelerator
        if detect().type == self.device_type:
            yield
            return
        log.info("tensor parallel: the model is sharded on the %s, not on this host's %s", self.device_type,
                 detect().type)
        torch._C._get_accelerator = lambda *args, **kwargs: torch.device(self.device_type)
        try:
            yield
        finally:
            torch._C._get_accelerator = detect

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
        with self._channel:
            self._broadcast(header, body)

    def receive(self, kv_cache: PagedKVCache, device: torch.device) -> StepBatch | KVCommand | None:
        """Follower: the driver's next message: a step, rebuilt on this rank's cache and device, a KV command
        (:meth:`serve` it), or None once the driver stops. Blocks until the driver sends (at most the idle
        timeout)."""
        header = torch.empty(HEADER_INTS, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._step_group)
        ints = header.tolist()
        if ints[0] == _STOP:
            return None
        body = torch.empty(ints[1], dtype=torch.uint8)
        if ints[1]:
            dist.broadcast(body, src=0, group=self._step_group)
        if ints[0] == _STEP:
            return decode_step(ints, body, kv_cache, device)
        if ints[0] == _GATHER_KV:
            return GatherKV(ints[2], body.view(torch.int64).tolist())
        if ints[0] == _WRITE_KV:
            layer, n, total_heads = ints[2:5]
            spec = kv_cache.spec
            ids_bytes = 8 * n
            kv = body[ids_bytes:].view(spec.dtype).view(2, n, spec.block_size, total_heads, spec.head_dim)
            return WriteKV(layer, body[:ids_bytes].view(torch.int64).tolist(), kv[0], kv[1])
        raise ValueError(f"tensor parallel: unknown message kind {ints[0]} from the driver")

    def _broadcast(self, header: torch.Tensor, body: torch.Tensor | None) -> None:
        dist.broadcast(header, src=0, group=self._step_group)
        if body is not None and body.numel():
            dist.broadcast(body, src=0, group=self._step_group)

    # -- KV commands of the hand-off: canonical all-head KV <-> each rank's heads -------------------------------

    def head_slice(self, local_heads: int, total_heads: int) -> slice:
        """The KV heads of the model (``total_heads``) that this rank holds: ``[rank*Hl, (rank+1)*Hl)``, or all
        of them when the plan does not shard the heads. ValueError if the counts do not fit either."""
        if local_heads == total_heads:
            return slice(0, total_heads)
        if local_heads * self.world_size != total_heads:
            raise ValueError(f"{local_heads} local KV heads on each of {self.world_size} ranks do not make the "
                             f"model's {total_heads}")
        return slice(self.rank * local_heads, (self.rank + 1) * local_heads)

    def gather_kv(self, kv_cache: PagedKVCache, block_ids: Sequence[int],
                  total_heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Driver: K and V of ``block_ids`` in every layer with all ``total_heads`` KV heads ([n, bs, H, D]
        each), gathered from every rank (collective with the followers): in host memory where the heads were
        gathered (over gloo, on the host: a sender would stage them back to it), else on the cache's device."""
        spec = kv_cache.spec
        block_ids = [int(b) for b in block_ids]
        self.head_slice(spec.num_kv_heads, total_heads)  # the counts must fit before the followers are told
        if spec.num_kv_heads == total_heads or not block_ids:  # every rank holds every head: nothing to gather
            return [kv_cache.read_blocks(layer, block_ids) for layer in range(spec.num_layers)]
        body = torch.tensor(block_ids, dtype=torch.int64).view(torch.uint8)
        header = _header(_GATHER_KV, body.numel(), spec.num_layers, len(block_ids))
        with self._channel:
            self._broadcast(header, body)
            local = _read_layers(kv_cache, block_ids)  # [L, 2, n, bs, Hl, D*elem] uint8
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.gather(local, parts, dst=0, group=self._step_group)
        full = torch.cat(parts, dim=4).view(spec.dtype)  # heads in rank order
        return [(full[layer, 0], full[layer, 1]) for layer in range(spec.num_layers)]

    def write_kv(self, kv_cache: PagedKVCache, layer: int, block_ids: Sequence[int], key: torch.Tensor,
                 value: torch.Tensor) -> None:
        """Driver: write all-head K/V blocks (``key``/``value`` [n, bs, H, D], n == len(block_ids)) into
        ``block_ids`` of ``layer`` on every rank, each rank its own heads (collective with the followers).
        ValueError, before anything is written or sent, if the shapes do not fit."""
        spec = kv_cache.spec
        block_ids = [int(b) for b in block_ids]
        total_heads = key.shape[2] if key.dim() == 4 else -1
        expected = (len(block_ids), spec.block_size, total_heads, spec.head_dim)
        if tuple(key.shape) != expected or tuple(value.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(key.shape)}/{tuple(value.shape)} do not fit {expected}")
        if not 0 <= layer < spec.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {spec.num_layers})")
        heads = self.head_slice(spec.num_kv_heads, total_heads)
        kv_cache.write_blocks(layer, block_ids, key[:, :, heads], value[:, :, heads])
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.int64).view(torch.uint8)
        kv = [t.detach().to(device="cpu", dtype=spec.dtype).contiguous().reshape(-1).view(torch.uint8)
              for t in (key, value)]
        body = torch.cat([ids, *kv])
        with self._channel:
            self._broadcast(_header(_WRITE_KV, body.numel(), layer, len(block_ids), total_heads), body)

    def serve(self, kv_cache: PagedKVCache, command: KVCommand) -> None:
        """Follower: this rank's part of a KV command from :meth:`receive`."""
        spec = kv_cache.spec
        if isinstance(command, GatherKV):
            if command.num_layers != spec.num_layers:
                raise ValueError(f"gather of {command.num_layers} layers; this rank has {spec.num_layers}")
            dist.gather(_read_layers(kv_cache, command.block_ids), None, dst=0, group=self._step_group)
        elif isinstance(command, WriteKV):
            heads = self.head_slice(spec.num_kv_heads, command.key.shape[2])
            kv_cache.write_blocks(command.layer, command.block_ids, command.key[:, :, heads],
                                  command.value[:, :, heads])
        else:
            raise TypeError(f"not a KV command: {type(command).__name__}")

    # -- shutdown ---------------------------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Driver: stop the followers and join the processes it spawned (terminated past ``timeout_s``).
        Every rank: leave the process group if :meth:`initialize` created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.is_driver:
            try:
                with self._channel:
                    self._broadcast(_header(_STOP, 0), None)
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
    """Run the driver's steps and KV commands on this follower rank, in the driver's order, until the driver
    stops; returns the number of steps."""
    group = engine.loaded.tensor_parallel
    if group is None or group.is_driver:
        raise ValueError("run_follower needs an engine of a follower rank (tensor_parallel rank >= 1)")
    num_steps = 0
    while (message := group.receive(engine.kv_cache, engine.device)) is not None:
        if isinstance(message, StepBatch):
            engine.runner.run(message)
            num_steps += 1
        else:
            group.serve(engine.kv_cache, message)
    return num_steps


def _header(kind: int, body_bytes: int, *values: int) -> torch.Tensor:
    """A message header: [kind, body bytes, *values], zero-padded to HEADER_INTS."""
    header = torch.zeros(HEADER_INTS, dtype=torch.int64)
    header[: 2 + len(values)] = torch.tensor([kind, body_bytes, *values], dtype=torch.int64)
    return header


def _read_layers(kv_cache: PagedKVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """This rank's K and V of ``block_ids`` in every layer, on the CPU, as bytes: [L, 2, n, bs, Hl, D*elem]
    uint8 (gloo moves plain bytes of any dtype)."""
    spec = kv_cache.spec
    out = torch.empty((spec.num_layers, 2, *spec.block_shape(len(block_ids))), dtype=spec.dtype)
    for layer in range(spec.num_layers):
        k, v = kv_cache.read_blocks(layer, list(block_ids))
        out[layer, 0].copy_(k)
        out[layer, 1].copy_(v)
    return out.view(torch.uint8)


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
        elif isinstance(value, int):  # a bool goes as 0 / 1 (read back as an int: the same truth)
            ints += [_INT, int(value)]
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
