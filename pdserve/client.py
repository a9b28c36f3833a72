"""A small Python client of the router's ``pdserve.v1.GenerateService`` (streaming, deadlines, cancellation).

    from pdserve.client import Client
    with Client("127.0.0.1:50051") as client:
        for piece in client.stream("Hello", max_tokens=16):
            print(piece.text, end="", flush=True)
        result = client.generate("Hello", max_tokens=16, temperature=0.0)

With ``Client(address, api_key=KEY)`` every call carries ``authorization: Bearer KEY`` metadata (an API key
or a JWT: what a router started with ``--api-key-file``, ``PDSERVE_API_KEYS`` or ``--jwt-*`` asks for; a call
without it fails with ``UNAUTHENTICATED``). ``Client(address, ca_file=PEM)`` dials with TLS, trusting only a
router whose certificate that CA signed (a router started with ``--public-tls-cert-file``).

Errors arrive as :class:`grpc.RpcError` with the router's status code and message. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.experimental

from pdserve.v1 import generate_pb2, generate_pb2_grpc, types_pb2

_FINISH = {
    types_pb2.FINISH_REASON_UNSPECIFIED: None,
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass
class Piece:
    """One streamed message: new tokens and text; the last one has ``finish_reason``."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    request_id: str = ""
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    migrations: int = 0


@dataclass
class Result:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    migrations: int = 0

    def add(self, piece: Piece) -> None:
        """Fold one streamed piece into the result."""
        self.token_ids += piece.token_ids
        self.text += piece.text
        for name in ("finish_reason", "request_id", "prefill_worker_id", "decode_worker_id", "prompt_tokens",
                     "completion_tokens", "migrations"):
            setattr(self, name, getattr(piece, name) or getattr(self, name))


def sampling_message(
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    logprobs: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> types_pb2.SamplingParams:
    """The ``SamplingParams`` message; ``None`` leaves a field unset (the model's default applies)."""
    msg = types_pb2.SamplingParams(max_tokens=max_tokens or 0, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                   ignore_eos=ignore_eos)
    for name, value in [("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                        ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("seed", seed), ("logprobs", logprobs)]:
        if value is not None:
            setattr(msg, name, value)
    return msg


# A stream's messages are read by the thread that iterates it, straight from its call, instead of by the
# channel's polling thread that then wakes the reader: one thread wake-up a message instead of two.
CHANNEL_OPTIONS = ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)


class Client:
    def __init__(
        self, address: str, *, timeout_s: float | None = None, api_key: str | None = None, ca_file: str = ""
    ) -> None:
        """``api_key``: sent as ``authorization: Bearer API_KEY`` on every call (None or "": no credential).
        ``ca_file``: PEM CA bundle: TLS, trusting only servers it signed ("": plaintext). OSError if unreadable."""
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        if ca_file:
            with open(ca_file, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def request(
        self, prompt: str | Sequence[int], *, request_id: str = "", session_id: str = "", **sampling
    ) -> generate_pb2.GenerateRequest:
        """``session_id``: a conversation's turns reuse its KV on the decode worker of the last turn."""
        req = generate_pb2.GenerateRequest(sampling=sampling_message(**sampling), request_id=request_id,
                                           session_id=session_id)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return req

    def stream_call(self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **kwargs):
        """The raw streaming call: iterate it for GenerateResponse messages on one thread; ``.cancel()`` (from
        any thread) cancels; ``.code()``/``.details()`` once it ended. It is read by the iterating thread itself
        (no channel thread), so its future-style ``result()``/``exception()`` never wait."""
        return self._stub.Generate(self.request(prompt, **kwargs), timeout=timeout_s or self.timeout_s,
                                   metadata=self._metadata)

    def stream(self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **kwargs) -> Iterator[Piece]:
        call = self.stream_call(prompt, timeout_s=timeout_s, **kwargs)
        try:
            for msg in call:
                yield Piece(
                    token_ids=list(msg.token_ids), text=msg.text, finish_reason=_FINISH[msg.finish_reason],
                    request_id=msg.request_id,
                    prefill_worker_id=msg.prefill_worker_id, decode_worker_id=msg.decode_worker_id,
                    prompt_tokens=msg.usage.prompt_tokens, completion_tokens=msg.usage.completion_tokens,
                    migrations=msg.migrations,
                )  # fmt: skip
        finally:
            call.cancel()  # no-op once the stream ended; cancels the request if the caller stopped early

    def generate(self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **kwargs) -> Result:
        """The whole generation (blocking)."""
        result = Result()
        for piece in self.stream(prompt, timeout_s=timeout_s, **kwargs):
            result.add(piece)
        return result
