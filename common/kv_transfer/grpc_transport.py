"""KV over gRPC (the default transport, works across hosts): the prefill side's sender.

One client-streaming ``DecodeService.PushKv`` call per request carries its chunks in the wire format of
:mod:`common.kv_transfer.wire`. The receiving side is the decode servicer, which feeds each chunk to a
:class:`~common.kv_transfer.wire.TransferAssembler` bound to the request's reservation.

Who calls what (prefill worker):

- :meth:`GrpcKVSender.send_layer`: the engine thread, right after a layer is computed (through the engine's
  ``kv_layer_sink``). Never blocks: it only enqueues the tensors; chunks are encoded (crc32 included) on
  gRPC's sending thread as the stream pulls them, so compute and transfer overlap.
- :meth:`GrpcKVSender.finish`: the servicer thread, after the prefill step. Blocks until the decode
  worker acknowledged the whole stream or ``timeout_s`` passed; never longer.
- :meth:`GrpcKVSender.abort`: anyone, any time; idempotent.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from common.kv_transfer.wire import DEFAULT_MAX_CHUNK_BYTES, iter_layer_chunks
from pdserve.v1 import worker_pb2

_END = object()
_PUSH_KV_METHOD = "/pdserve.v1.DecodeService/PushKv"
_PROBE_LINK_METHOD = "/pdserve.v1.DecodeService/ProbeLink"


def _field1_view(message: bytes) -> memoryview | None:
    """The bytes of field 1 of a serialized message that is exactly that field, as a view (no copy); None
    for anything else (written by another implementation, or a later proto version with more fields)."""
    view = memoryview(message)
    if len(view) > 1 and view[0] == 0x0A:
        length, shift, pos = 0, 0, 1
        while pos < len(view) and pos < 11:
            byte = view[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            if not byte & 0x80:
                return view[pos:] if pos + length == len(view) else None
            shift += 7
    return None


def chunk_of_push_kv_request(message: bytes) -> memoryview | bytes:
    """The ``chunk`` of a serialized PushKvRequest without copying it (the decode side's deserializer)."""
    view = _field1_view(message)
    return view if view is not None else worker_pb2.PushKvRequest.FromString(message).chunk


def size_of_probe_link_request(message: bytes) -> int:
    """How many data bytes a serialized ProbeLinkRequest carries (the decode side's deserializer)."""
    view = _field1_view(message)
    return len(view) if view is not None else len(worker_pb2.ProbeLinkRequest.FromString(message).data)


def probe_link(channel: grpc.Channel, total_bytes: int, message_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
               timeout_s: float = 120.0) -> float:
    """Raw gRPC throughput (bytes/s) to a decode worker: ``total_bytes`` in messages of ``message_bytes``
    through ``DecodeService.ProbeLink``, serialized once up front. The baseline KV transfer is judged by."""
    probe = channel.stream_unary(
        _PROBE_LINK_METHOD,
        request_serializer=lambda message: message,
        response_deserializer=worker_pb2.ProbeLinkResponse.FromString,
    )
    message = _field1_prefix(message_bytes) + os.urandom(message_bytes)
    count = max(1, total_bytes // message_bytes)
    t0 = time.perf_counter()
    response = probe(iter([message] * count), timeout=timeout_s)
    seconds = time.perf_counter() - t0
    if response.num_bytes != count * message_bytes:
        raise RuntimeError(f"probe sent {count * message_bytes} bytes, the worker counted {response.num_bytes}")
    return response.num_bytes / seconds


def _field1_prefix(length: int) -> bytes:
    """Protobuf key and length of ``bytes chunk = 1``: tag 0x0A then the length as a varint."""
    out = bytearray(b"\x0a")
    while True:
        byte = length & 0x7F
        length >>= 7
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out)


@dataclass
class PushResult:
    ok: bool
    num_bytes: int
    num_chunks: int
    seconds: float  # from the first chunk queued to the acknowledgement
    error: str = ""
    code: grpc.StatusCode | None = None
    # Unix time of the acknowledgement (or the failure); ``finished_at - seconds``: the first chunk queued.
    finished_at: float = field(default_factory=time.time)


class GrpcKVSender:
    def __init__(
        self,
        channel: grpc.Channel,
        request_id: str,
        num_layers: int,
        *,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        timeout_s: float = 60.0,
        corrupt_chunk_seq: int | None = None,
        stall_chunk_seq: int | None = None,
        metadata: list[tuple[str, str]] | None = None,
    ) -> None:
        """``metadata``: of the PushKv call (the trace context). Test-only faults: ``corrupt_chunk_seq``: that
        chunk's payload gets one byte flipped after its checksum was computed, so the receiver must reject it;
        ``stall_chunk_seq``: the stream stops before that chunk and stays open, sending nothing, until the
        transfer is aborted or times out (a stalled transfer: the chunks before it arrived, the rest never do)."""
        self.request_id = request_id
        self.num_layers = num_layers
        self.max_chunk_bytes = max_chunk_bytes
        self._corrupt_seq = corrupt_chunk_seq
        self._stall_seq = stall_chunk_seq
        self._ended = threading.Event()  # set by abort() and a timed-out finish(): a stalled stream gives up
        self._queue: queue.Queue = queue.Queue()
        self._num_bytes = 0
        self._num_chunks = 0
        self._t0: float | None = None
        # The stream's messages are serialized here, not by protobuf: a PushKvRequest is exactly the bytes
        # field 1 (tag 0x0A, varint length, chunk), so one join copies the chunk once into the wire message
        # (protobuf would copy it twice more). Same method, same bytes on the wire as the generated stub.
        push = channel.stream_unary(
            _PUSH_KV_METHOD,
            request_serializer=lambda message: message,
            response_deserializer=worker_pb2.PushKvResponse.FromString,
        )
        self._call = push.future(self._requests(), timeout=timeout_s, metadata=metadata)

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue one layer's KV ``[n, bs, H, D]`` (tensors owned by the sender from now on)."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self._queue.put((layer, k, v))

    def finish(self, timeout_s: float) -> PushResult:
        """Close the stream and wait for the decode worker's acknowledgement (at most ``timeout_s``)."""
        self._queue.put(_END)
        try:
            response = self._call.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            self._ended.set()
            self._call.cancel()
            error = f"no acknowledgement within {timeout_s:.1f} s"
            return self._result(False, error, grpc.StatusCode.DEADLINE_EXCEEDED)
        except grpc.RpcError as exc:
            return self._result(False, exc.details() or str(exc), exc.code())
        if not response.complete:
            return self._result(False, "the decode worker reports the KV incomplete", grpc.StatusCode.DATA_LOSS)
        return self._result(True)

    def abort(self) -> None:
        self._ended.set()
        self._queue.put(_END)
        self._call.cancel()

    def _result(self, ok: bool, error: str = "", code: grpc.StatusCode | None = None) -> PushResult:
        seconds = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        return PushResult(ok, self._num_bytes, self._num_chunks, seconds, error, code)

    def _requests(self):
        """The request stream (runs on gRPC's thread): encode queued layers into chunks as they are pulled."""
        seq = 0
        while True:
            item = self._queue.get()
            if item is _END:
                return
            layer, k, v = item
            last = layer == self.num_layers - 1
            chunks = iter_layer_chunks(self.request_id, layer, k, v, self.max_chunk_bytes, first_seq=seq, last=last)
            for chunk in chunks:
                if seq == self._stall_seq:
                    self._ended.wait()
                    return
                message = b"".join((_field1_prefix(chunk.num_bytes), chunk.header_buf, *chunk.payload_parts))
                if seq == self._corrupt_seq:
                    message = message[:-1] + bytes([message[-1] ^ 0xFF])
                seq += 1
                self._num_chunks += 1
                self._num_bytes += chunk.num_bytes
                yield message
