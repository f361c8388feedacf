from pdserve_api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_UNKNOWN: _ClassVar[TransferState]
    TRANSFER_STATE_ACTIVE: _ClassVar[TransferState]
    TRANSFER_STATE_FINISHED: _ClassVar[TransferState]
    TRANSFER_STATE_REFUSED: _ClassVar[TransferState]
    TRANSFER_STATE_CONNECTION_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_WRONG_ENGINE: _ClassVar[TransferState]
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_UNKNOWN: TransferState
TRANSFER_STATE_ACTIVE: TransferState
TRANSFER_STATE_FINISHED: TransferState
TRANSFER_STATE_REFUSED: TransferState
TRANSFER_STATE_CONNECTION_FAILED: TransferState
TRANSFER_STATE_WRONG_ENGINE: TransferState

class FabricPeer(_message.Message):
    __slots__ = ("provider", "descriptor")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    provider: str
    descriptor: bytes
    def __init__(self, provider: _Optional[str] = ..., descriptor: _Optional[bytes] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_pages", "kv_heads", "page_size", "head_dim", "dtype", "element_size", "base_offset", "layer_stride", "kv_stride", "page_stride", "head_stride", "token_stride")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_FIELD_NUMBER: _ClassVar[int]
    KV_STRIDE_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_FIELD_NUMBER: _ClassVar[int]
    HEAD_STRIDE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRIDE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_pages: int
    kv_heads: int
    page_size: int
    head_dim: int
    dtype: str
    element_size: int
    base_offset: int
    layer_stride: int
    kv_stride: int
    page_stride: int
    head_stride: int
    token_stride: int
    def __init__(self, num_layers: _Optional[int] = ..., num_pages: _Optional[int] = ..., kv_heads: _Optional[int] = ..., page_size: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., element_size: _Optional[int] = ..., base_offset: _Optional[int] = ..., layer_stride: _Optional[int] = ..., kv_stride: _Optional[int] = ..., page_stride: _Optional[int] = ..., head_stride: _Optional[int] = ..., token_stride: _Optional[int] = ...) -> None: ...

class KvMemory(_message.Message):
    __slots__ = ("tp_rank", "descriptor", "layout")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    descriptor: bytes
    layout: KvLayout
    def __init__(self, tp_rank: _Optional[int] = ..., descriptor: _Optional[bytes] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class ContextSlot(_message.Message):
    __slots__ = ("descriptor", "offset", "capacity", "logits_top_k")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LOGITS_TOP_K_FIELD_NUMBER: _ClassVar[int]
    descriptor: bytes
    offset: int
    capacity: int
    logits_top_k: int
    def __init__(self, descriptor: _Optional[bytes] = ..., offset: _Optional[int] = ..., capacity: _Optional[int] = ..., logits_top_k: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "peer", "kv_memory", "page_ids", "context", "sharding", "imm_tag", "expected_writes", "cached_tokens", "model", "deadline_s", "decode_node_id", "attempt", "kv_checksum", "group_pages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    KV_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    IMM_TAG_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WRITES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    peer: FabricPeer
    kv_memory: _containers.RepeatedCompositeFieldContainer[KvMemory]
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    context: ContextSlot
    sharding: _common_pb2.ShardingScheme
    imm_tag: int
    expected_writes: int
    cached_tokens: int
    model: str
    deadline_s: float
    decode_node_id: str
    attempt: int
    kv_checksum: bool
    group_pages: _containers.RepeatedCompositeFieldContainer[GroupPages]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., peer: _Optional[_Union[FabricPeer, _Mapping]] = ..., kv_memory: _Optional[_Iterable[_Union[KvMemory, _Mapping]]] = ..., page_ids: _Optional[_Iterable[int]] = ..., context: _Optional[_Union[ContextSlot, _Mapping]] = ..., sharding: _Optional[_Union[_common_pb2.ShardingScheme, _Mapping]] = ..., imm_tag: _Optional[int] = ..., expected_writes: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., model: _Optional[str] = ..., deadline_s: _Optional[float] = ..., decode_node_id: _Optional[str] = ..., attempt: _Optional[int] = ..., kv_checksum: _Optional[bool] = ..., group_pages: _Optional[_Iterable[_Union[GroupPages, _Mapping]]] = ...) -> None: ...

class GroupPages(_message.Message):
    __slots__ = ("name", "layers", "sliding_window", "first_page", "page_ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    sliding_window: int
    first_page: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., sliding_window: _Optional[int] = ..., first_page: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_time_s", "compute_time_s", "last_layer_to_completion_s")
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_TO_COMPLETION_S_FIELD_NUMBER: _ClassVar[int]
    queue_time_s: float
    compute_time_s: float
    last_layer_to_completion_s: float
    def __init__(self, queue_time_s: _Optional[float] = ..., compute_time_s: _Optional[float] = ..., last_layer_to_completion_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "num_writes", "bytes_written", "prefill_cached_tokens", "timings", "kv_checksums", "num_kv_checksums")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITES_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_writes: int
    bytes_written: int
    prefill_cached_tokens: int
    timings: PrefillTimings
    kv_checksums: bytes
    num_kv_checksums: int
    def __init__(self, request_id: _Optional[str] = ..., num_writes: _Optional[int] = ..., bytes_written: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., kv_checksums: _Optional[bytes] = ..., num_kv_checksums: _Optional[int] = ...) -> None: ...

class AbortPrefillRequest(_message.Message):
    __slots__ = ("request_id", "decode_engine_id", "attempt", "prefill_engine_id", "fence_tag", "fence_region")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_TAG_FIELD_NUMBER: _ClassVar[int]
    FENCE_REGION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_engine_id: str
    attempt: int
    prefill_engine_id: str
    fence_tag: int
    fence_region: bytes
    def __init__(self, request_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., attempt: _Optional[int] = ..., prefill_engine_id: _Optional[str] = ..., fence_tag: _Optional[int] = ..., fence_region: _Optional[bytes] = ...) -> None: ...

class AbortPrefillResponse(_message.Message):
    __slots__ = ("confirmed", "prefill_engine_id", "state", "fence_posted")
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FENCE_POSTED_FIELD_NUMBER: _ClassVar[int]
    confirmed: bool
    prefill_engine_id: str
    state: TransferState
    fence_posted: bool
    def __init__(self, confirmed: _Optional[bool] = ..., prefill_engine_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., fence_posted: _Optional[bool] = ...) -> None: ...
