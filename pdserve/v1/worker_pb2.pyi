# DO NOT EDIT: generated from protos/pdserve/v1 by `python scripts/gen_protos.py`.
from pdserve.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_target_address", "decode_identity", "kv_shm_address", "kv_target_host", "kv_nixl_metadata", "kv_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    KV_SHM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    kv_target_address: str
    decode_identity: _types_pb2.ModelIdentity
    kv_shm_address: str
    kv_target_host: str
    kv_nixl_metadata: bytes
    kv_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., kv_target_address: _Optional[str] = ..., decode_identity: _Optional[_Union[_types_pb2.ModelIdentity, _Mapping]] = ..., kv_shm_address: _Optional[str] = ..., kv_target_host: _Optional[str] = ..., kv_nixl_metadata: _Optional[bytes] = ..., kv_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "generator_state", "num_kv_tokens", "kv_bytes", "kv_transfer_seconds", "prefill_seconds", "queued_at", "prefill_started_at", "first_token_at", "kv_transfer_started_at", "kv_transfer_finished_at")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_AT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_AT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    finish_reason: _types_pb2.FinishReason
    generator_state: bytes
    num_kv_tokens: int
    kv_bytes: int
    kv_transfer_seconds: float
    prefill_seconds: float
    queued_at: float
    prefill_started_at: float
    first_token_at: float
    kv_transfer_started_at: float
    kv_transfer_finished_at: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., generator_state: _Optional[bytes] = ..., num_kv_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., queued_at: _Optional[float] = ..., prefill_started_at: _Optional[float] = ..., first_token_at: _Optional[float] = ..., kv_transfer_started_at: _Optional[float] = ..., kv_transfer_finished_at: _Optional[float] = ...) -> None: ...

class CancelPrefillRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelPrefillResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ReserveKvRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "lease_seconds", "identity")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    lease_seconds: float
    identity: _types_pb2.ModelIdentity
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., identity: _Optional[_Union[_types_pb2.ModelIdentity, _Mapping]] = ...) -> None: ...

class ReserveKvResponse(_message.Message):
    __slots__ = ("num_blocks", "identity", "kv_shm_address", "host", "kv_nixl_metadata", "kv_block_ids")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    KV_SHM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    KV_NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    identity: _types_pb2.ModelIdentity
    kv_shm_address: str
    host: str
    kv_nixl_metadata: bytes
    kv_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., identity: _Optional[_Union[_types_pb2.ModelIdentity, _Mapping]] = ..., kv_shm_address: _Optional[str] = ..., host: _Optional[str] = ..., kv_nixl_metadata: _Optional[bytes] = ..., kv_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PushKvRequest(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: bytes
    def __init__(self, chunk: _Optional[bytes] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("num_chunks", "num_bytes", "complete")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    num_bytes: int
    complete: bool
    def __init__(self, num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "generator_state", "prefill_here")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    generator_state: bytes
    prefill_here: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., generator_state: _Optional[bytes] = ..., prefill_here: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    finish_reason: _types_pb2.FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ...) -> None: ...

class DecodeManyRequest(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: DecodeOpen
    cancel: str
    def __init__(self, open: _Optional[_Union[DecodeOpen, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class DecodeOpen(_message.Message):
    __slots__ = ("request", "timeout_s", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request: DecodeRequest
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DecodeUpdate(_message.Message):
    __slots__ = ("request_id", "piece", "status_code", "status_details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    piece: DecodeResponse
    status_code: int
    status_details: str
    def __init__(self, request_id: _Optional[str] = ..., piece: _Optional[_Union[DecodeResponse, _Mapping]] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class DecodeManyResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DecodeUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[DecodeUpdate, _Mapping]]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ProbeLinkRequest(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ProbeLinkResponse(_message.Message):
    __slots__ = ("num_messages", "num_bytes")
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_messages: int
    num_bytes: int
    def __init__(self, num_messages: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...
