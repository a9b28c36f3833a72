"""The one converter between pdserve.v1 protobuf messages and the engine's dataclasses.

Protobuf objects stop at the servicers: everything below them (engine, policies, state) sees only the
dataclasses converted here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.engine.identity import ModelIdentity
from common.engine.request import FinishReason
from common.engine.sampler import TokenLogprobs
from common.engine.sampling_params import SamplingParams
from pdserve.v1 import types_pb2

_FINISH_TO_PROTO = {
    None: types_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: types_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
_OPTIONAL_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "logprobs",
)  # fmt: skip


def sampling_from_proto(
    msg: types_pb2.SamplingParams, generation_config: Any, default_max_tokens: int
) -> SamplingParams:
    """Engine sampling parameters; unset fields take the model's generation_config, else greedy.

    Raises ValueError naming a bad value (``SamplingParams.validate`` without the vocabulary).
    """
    overrides: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    params = SamplingParams.from_generation_config(
        generation_config,
        max_new_tokens=msg.max_tokens or default_max_tokens,
        stop=tuple(msg.stop) or None,
        stop_token_ids=tuple(msg.stop_token_ids) or None,
        ignore_eos=True if msg.ignore_eos else None,
        **overrides,
    )
    params.validate()
    return params


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO[value]


def logprobs_to_proto(logprobs: Sequence[TokenLogprobs | None] | None) -> list[types_pb2.TokenLogprob]:
    if not logprobs:
        return []
    return [
        types_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[types_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)],
        )
        for lp in logprobs
        if lp is not None
    ]


def extend_decode_piece(into, piece) -> None:
    """Append ``piece``, a later ``DecodeResponse`` of the same request, to ``into``: its tokens, text and
    logprobs, and its finish_reason (one message for what a lagging reader missed)."""
    into.token_ids.extend(piece.token_ids)
    into.text += piece.text
    into.logprobs.extend(piece.logprobs)
    into.finish_reason = piece.finish_reason


def identity_to_proto(identity: ModelIdentity) -> types_pb2.ModelIdentity:
    return types_pb2.ModelIdentity(**identity.__dict__)


def identity_from_proto(msg: types_pb2.ModelIdentity) -> ModelIdentity:
    # A field the peer is too old to send reads as its zero value: quantization "" (ModelIdentity.mismatches
    # counts it as "none").
    return ModelIdentity(**{f: getattr(msg, f) for f in ModelIdentity.__dataclass_fields__})
