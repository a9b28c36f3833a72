"""``pdserve.v1.PrefillService``: the prefill side of the disaggregated hand-off.

Life cycle of a request on a prefill worker:

1. ``Prefill`` (router) names the decode worker holding the reservation and its identity; a mismatch with
   this worker's model, dtype, block size, tokenizer or protocol fails at once (FAILED_PRECONDITION).
2. The prompt joins the engine's batch (prompts that arrive together share forward passes). During the pass
   that completes it, the engine hands each layer's KV to a :class:`GrpcKVSender` the moment the layer is
   computed; chunks stream to the decode worker's ``PushKv`` while later layers compute. A tensor-parallel
   engine (``--tensor-parallel-size`` > 1) cannot stream per layer (each rank holds its share of the heads):
   once the request is prefilled, ``export_kv(with_kv=True)`` gathers every rank's heads on the engine thread
   and the servicer thread sends the layers through the same sender, in the same all-heads wire chunks.
3. The first token is sampled; the sender waits for the decode worker's acknowledgement; the engine
   forgets the request (blocks freed) and the response carries the first token and the generator state.
4. A failed or late transfer answers with its gRPC status (DATA_LOSS, DEADLINE_EXCEEDED, UNAVAILABLE) and
   frees the blocks; a cancelled call aborts the request here. Never a hang.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

import grpc

from common.cluster.net import wait_for_tcp
from common.engine.counters import unix_time_of
from common.engine.engine_loop import EngineLoop, StreamClosed
from common.engine.identity import ModelIdentity
from common.kv_transfer.connector import KVSender, SenderPool
from common.kv_transfer.grpc_transport import GrpcKVSender, PushResult
from common.kv_transfer.nixl import NixlKVSender
from common.kv_transfer.nixl_blocks import BlockEndpoint, BlocksRefused, NixlBlockSender, blocks_enabled
from common.kv_transfer.shm import ShmKVSender
from common.kv_transfer.wire import KV_UNDELIVERED_KEY
from common.metrics.worker import WorkerMetrics
from common.obs import Tracing, call_scope
from common.rpc import convert
from common.rpc.server import channel
from common.rpc.tls import TlsFiles
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

REACH_TIMEOUT_S = 3.0  # a host that is there answers a TCP connect in milliseconds; 3 s covers two lost SYNs


class _Unreachable(ConnectionError):
    """The decode worker does not answer a TCP connect from here: no channel of any transport would reach it."""


def _reachable(address: str, timeout_s: float) -> str:
    """'' when a TCP connection to ``address`` (host:port, IPv6 in brackets) opens within ``timeout_s``, else why
    not."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return f"bad address {address!r}"
    if wait_for_tcp(host.strip("[]"), int(port), timeout_s):
        return ""
    return f"no TCP connection to {address} within {timeout_s:g}s"


class PrefillServicer(worker_pb2_grpc.PrefillServiceServicer):
    def __init__(
        self,
        loop: EngineLoop,
        identity: ModelIdentity,
        *,
        generation_config,
        default_max_tokens: int,
        transfer_timeout_s: float = 30.0,
        write_stall_s: float = 10.0,
        chunk_bytes: int = 4 << 20,
        prefill_timeout_s: float = 600.0,
        corrupt_chunk_seq: int | None = None,
        stall_chunk_seq: int | None = None,
        kv_transport: str = "grpc",
        metrics: WorkerMetrics | None = None,
        tracing: Tracing | None = None,
        max_pending_requests: int = 256,
        draining: Callable[[], bool] = lambda: False,
        kv_tls: TlsFiles | None = None,
    ) -> None:
        """``kv_transport``: "grpc"; "shm" to use shared memory with decode workers on this host; "nixl" to use NIXL
        writes with decode workers that offer a NIXL endpoint (any host). Each falls back to gRPC.
        ``draining``: True once the worker is stopping; new prefills are then refused (running ones finish).
        ``kv_tls``: the KV channels to decode workers use mutual TLS with these files (None: plaintext).
        ``write_stall_s``: a NIXL channel's lost-link watch (:data:`~common.kv_transfer.nixl.STALL_MIN_BYTES_PER_S`)."""
        self.loop = loop
        self.identity = identity
        self.generation_config = generation_config
        self.default_max_tokens = default_max_tokens
        self.transfer_timeout_s = transfer_timeout_s
        self.write_stall_s = write_stall_s
        self.chunk_bytes = chunk_bytes
        self.prefill_timeout_s = prefill_timeout_s
        self.corrupt_chunk_seq = corrupt_chunk_seq
        self.stall_chunk_seq = stall_chunk_seq
        self.kv_transport = kv_transport
        self.metrics = metrics
        self.tracing = tracing or Tracing("pdserve-prefill", environ={})
        self.max_pending_requests = max_pending_requests
        self.draining = draining
        self.kv_tls = kv_tls
        self.host = socket.gethostname()
        self._senders: dict[str, GrpcKVSender | _ConnectorRequest] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._connectors = SenderPool()  # (transport, decode worker's endpoint) -> channel
        self._block_endpoint: BlockEndpoint | None = None  # NIXL block writes: this worker's agent, made on first use
        self._lock = threading.Lock()
        # With tensor parallelism the engine cannot stream KV per layer (each rank holds only its heads): the
        # whole KV is gathered after the prefill instead (_send_exported).
        self.stream_layers = loop.engine.tensor_parallel is None
        if self.stream_layers:
            loop.engine.kv_layer_sink = self._sink  # runs on the engine thread: must not block
            loop.engine.kv_block_sink = self._block_sink  # ... asked first

    def _sink(self, request_id: str, layer: int, k, v) -> None:
        sender = self._senders.get(request_id)
        if sender is not None:
            sender.send_layer(layer, k, v)

    def _block_sink(self, request_id: str, layer: int, block_ids: list[int]) -> bool:
        sender = self._senders.get(request_id)
        if isinstance(sender, _BlockRequest):
            sender.send_blocks(layer, block_ids)
            return True
        return False

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = channel(address, self.kv_tls)
            return self._channels[address]

    @property
    def num_inflight(self) -> int:
        return len(self._senders)

    def Prefill(self, request, context):
        with call_scope(self.tracing, "prefill.Prefill", request.request_id, context):
            return self._handle_prefill(request, context)

    def _handle_prefill(self, request, context):
        rid = request.request_id
        if request.HasField("decode_identity"):
            problems = self.identity.mismatches(convert.identity_from_proto(request.decode_identity))
            if problems:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"prefill and decode workers disagree: {'; '.join(problems)}",
                )
        if not rid or not request.kv_target_address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Prefill needs a request_id and a kv_target_address")
        try:
            sampling = convert.sampling_from_proto(request.sampling, self.generation_config, self.default_max_tokens)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.draining():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill worker draining: takes no new requests")
        pending = len(self._senders)
        if pending >= self.max_pending_requests:  # a bounded queue: the router tries another worker
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"prefill worker full: {pending} requests pending (--max-pending-requests)")
        try:
            sender = self._sender_for(rid, request)
        except _Unreachable as exc:
            if self.metrics is not None:
                self.metrics.count_kv_failure(grpc.StatusCode.UNAVAILABLE.name)
            context.set_trailing_metadata(((KV_UNDELIVERED_KEY, request.kv_target_address),))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self._senders[rid] = sender
        try:
            return self._prefill(rid, list(request.prompt_token_ids), sampling, sender, request, context)
        finally:
            self._senders.pop(rid, None)

    def _prefill(self, rid, prompt_ids, sampling, sender, request, context):
        t0 = time.perf_counter()
        try:
            stream = self.loop.add_request(prompt_ids, sampling, request_id=rid, prefill_only=True)
        except ValueError as exc:
            sender.abort()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        context.add_callback(lambda: self._cancel(rid))
        remaining = context.time_remaining()
        try:
            out = stream.get(timeout_s=min(self.prefill_timeout_s, remaining or self.prefill_timeout_s))
        except (StreamClosed, queue.Empty) as exc:
            sender.abort()
            self.loop.submit(lambda e: e.abort(rid))
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill of request {rid} did not complete: {exc!r}")
        prefill_s = time.perf_counter() - t0
        response = worker_pb2.PrefillResponse(
            token_ids=out.new_token_ids,
            text=out.new_text,
            logprobs=convert.logprobs_to_proto(out.new_logprobs),
            prefill_seconds=prefill_s,
        )
        if out.times is not None:
            response.queued_at = unix_time_of(out.times.arrival_s)
            response.prefill_started_at = unix_time_of(out.times.first_scheduled_s)
            response.first_token_at = unix_time_of(out.times.first_token_s)
        if out.finished:  # generation ended at the first token: decode is not needed
            sender.abort()
            response.finish_reason = convert.finish_reason_to_proto(out.finish_reason)
            return response
        if self.stream_layers:
            result = sender.finish(self.transfer_timeout_s)
            try:
                handoff = self.loop.call(lambda e: e.export_kv(rid, with_kv=False))  # frees the blocks here
            except ValueError as exc:  # aborted meanwhile
                context.abort(grpc.StatusCode.CANCELLED, str(exc))
        else:
            handoff, result = self._send_exported(rid, sender, context)
        transport = sender.transport if isinstance(sender, _ConnectorRequest) else "grpc"
        if self.metrics is not None:
            if result.ok:
                self.metrics.observe_kv_sent(transport, result.seconds, result.num_bytes)
            else:
                self.metrics.count_kv_failure((result.code or grpc.StatusCode.UNAVAILABLE).name)
        if not result.ok:
            log.warning("KV transfer of %s to %s failed: %s", rid, request.kv_target_address, result.error)
            context.set_trailing_metadata(((KV_UNDELIVERED_KEY, request.kv_target_address),))
            context.abort(
                result.code or grpc.StatusCode.UNAVAILABLE,
                f"KV transfer of request {rid} to {request.kv_target_address} failed: {result.error}",
            )
        if handoff.generator_state is not None:
            response.generator_state = handoff.generator_state.numpy().tobytes()
        response.num_kv_tokens = handoff.num_kv_tokens
        response.kv_bytes = result.num_bytes
        response.kv_transfer_seconds = result.seconds
        response.kv_transfer_started_at = result.finished_at - result.seconds
        response.kv_transfer_finished_at = result.finished_at
        return response

    def _send_exported(self, rid: str, sender, context):
        """Tensor parallelism: the prefilled request's whole KV, every rank's heads gathered by ``export_kv`` (a
        collective, so on the engine thread, between steps; it frees the blocks there), then sent layer by layer
        through the same sender and wire chunks as the layer sink's (all KV heads, ``handoff_spec``), and the
        acknowledgement awaited. Returns the hand-off and the transfer's result."""
        try:
            handoff = self.loop.call(lambda e: e.export_kv(rid, with_kv=True))
        except (ValueError, StreamClosed) as exc:  # aborted meanwhile, or the engine loop stopped
            sender.abort()
            context.abort(grpc.StatusCode.CANCELLED, str(exc))
        try:
            for layer, (k, v) in enumerate(handoff.layers):
                sender.send_layer(layer, k, v)
        except (ValueError, RuntimeError) as exc:  # a chunk the transport cannot take, or a closed channel
            sender.abort()
            context.abort(grpc.StatusCode.INTERNAL, f"KV of request {rid} could not be sent: {exc}")
        return handoff, sender.finish(self.transfer_timeout_s)

    def _sender_for(self, rid: str, request) -> GrpcKVSender | _ConnectorRequest:
        """Shared memory when asked for and the decode worker offers it on this host, NIXL when asked for and the
        decode worker offers it; else gRPC."""
        if self.kv_transport == "shm" and request.kv_shm_address and request.kv_target_host == self.host:
            shm = self._connector("shm", request.kv_shm_address)
            if shm is not None:
                return _ConnectorRequest(shm, rid, "shm")
        if self.kv_transport == "nixl" and request.kv_nixl_metadata:
            channel = self._connector("nixl", request.kv_nixl_metadata, request.kv_target_address)
            if isinstance(channel, NixlBlockSender) and request.kv_block_ids:
                blocks, num_layers = list(request.kv_block_ids), self.loop.engine.kv_spec.num_layers
                try:
                    claimed = _BlockRequest(channel, rid, blocks, num_layers)
                    if channel.broken:  # its connection died while idle (the decode host was away a while): once
                        log.info("NIXL KV channel to %s found broken (%s); opening a new one",
                                 request.kv_target_address, channel.broken)  # fmt: skip
                        channel = self._connector("nixl", request.kv_nixl_metadata, request.kv_target_address)
                        if isinstance(channel, NixlBlockSender):
                            claimed = _BlockRequest(channel, rid, blocks, num_layers)
                    return claimed
                except (ValueError, RuntimeError) as exc:  # a claim the channel cannot make (closed meanwhile)
                    log.warning("no NIXL block transfer for %s (%s); using gRPC", rid, exc)
            elif channel is not None and not isinstance(channel, NixlBlockSender):
                return _ConnectorRequest(channel, rid, "nixl")
        return GrpcKVSender(
            self._channel(request.kv_target_address),
            rid,
            self.loop.engine.kv_spec.num_layers,
            max_chunk_bytes=self.chunk_bytes,
            timeout_s=self.transfer_timeout_s + self.prefill_timeout_s,
            corrupt_chunk_seq=self.corrupt_chunk_seq,
            stall_chunk_seq=self.stall_chunk_seq,
            metadata=self.tracing.outgoing_metadata(),
        )

    def _connector(self, transport: str, endpoint: str | bytes, target: str = "") -> KVSender | NixlBlockSender | None:
        """The channel to a decode worker's shared-memory socket or NIXL agent (opened on first use, kept while in
        use: :class:`~common.kv_transfer.connector.SenderPool`), or None (logged) when it cannot be opened: the
        request then goes by gRPC. Before a NIXL channel opens, the decode worker's gRPC address ``target`` must
        take a TCP connection (NIXL's own connect to a host that does not answer holds the agent, so every other
        channel, for seconds): :class:`_Unreachable` if not, which no transport would get through either."""

        def open_sender() -> KVSender | NixlBlockSender:
            if transport == "shm":
                return ShmKVSender(endpoint, max_chunk_bytes=self.chunk_bytes)
            if target and (why := _reachable(target, REACH_TIMEOUT_S)):
                raise _Unreachable(f"decode worker at {target} unreachable from this prefill worker: {why}")
            if self.stream_layers and blocks_enabled():  # straight from this cache into the reserved blocks
                try:
                    return NixlBlockSender(endpoint, self._blocks_endpoint(), stall_s=self.write_stall_s)
                except BlocksRefused as exc:
                    log.info("NIXL KV by arena, not by block: %s", exc)
            return NixlKVSender(endpoint, max_chunk_bytes=self.chunk_bytes, stall_s=self.write_stall_s)

        try:
            return self._connectors.get((transport, endpoint), open_sender)
        except _Unreachable:
            raise
        except (ConnectionError, RuntimeError) as exc:
            log.warning("no %s KV channel to the decode worker (%s); using gRPC", transport, exc)
            return None

    def _blocks_endpoint(self) -> BlockEndpoint:
        with self._lock:  # one agent, the KV cache registered once, for every decode worker
            if self._block_endpoint is None:
                self._block_endpoint = BlockEndpoint(self.loop.engine.kv_cache)
            return self._block_endpoint

    def close(self) -> None:
        self._connectors.close()
        if self._block_endpoint is not None:
            self._block_endpoint.close()

    def _cancel(self, rid: str) -> None:
        sender = self._senders.pop(rid, None)
        if sender is not None:
            sender.abort()
        self.loop.submit(lambda e: e.abort(rid))

    def CancelPrefill(self, request, context):
        rid = request.request_id
        had_sender = rid in self._senders
        self._cancel(rid)
        return worker_pb2.CancelPrefillResponse(cancelled=had_sender)


class _ConnectorRequest:
    """One request's transfer over a :class:`KVSender` (shared memory, NIXL), with GrpcKVSender's verbs."""

    def __init__(self, sender: KVSender, request_id: str, transport: str) -> None:
        self.sender = sender
        self.request_id = request_id
        self.transport = transport  # its label in the metrics

    def send_layer(self, layer: int, k, v) -> None:
        self.sender.send_layer(self.request_id, layer, k, v)

    def finish(self, timeout_s: float) -> PushResult:
        result = self.sender.finish(self.request_id, timeout_s)
        if result.ok:
            return PushResult(True, result.num_bytes, 0, result.seconds)
        code = grpc.StatusCode.DATA_LOSS if "checksum" in result.error else grpc.StatusCode.UNAVAILABLE
        return PushResult(False, result.num_bytes, 0, result.seconds, result.error, code)

    def abort(self) -> None:
        self.sender.abort(self.request_id)
        self.sender.finish(self.request_id, 0.0)  # forgets it (ended: returns at once)


class _BlockRequest(_ConnectorRequest):
    """One request's transfer by direct NIXL block writes: claimed when made, its layers taken by block id from the
    engine's cache (:meth:`PrefillServicer._block_sink`), never as tensors."""

    def __init__(self, sender: NixlBlockSender, request_id: str, dst_block_ids: list[int], num_layers: int) -> None:
        super().__init__(sender, request_id, "nixl")
        sender.claim(request_id, dst_block_ids, num_layers)

    def send_blocks(self, layer: int, block_ids: list[int]) -> None:
        self.sender.send_blocks(self.request_id, layer, block_ids)

    def send_layer(self, layer: int, k, v) -> None:
        raise TypeError(f"the KV of request {self.request_id} goes by block id (kv_block_sink), not as tensors")
