from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ShardingScheme(_message.Message):
    __slots__ = ("tp_size", "kv_heads_per_rank", "total_kv_heads")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    kv_heads_per_rank: int
    total_kv_heads: int
    def __init__(self, tp_size: _Optional[int] = ..., kv_heads_per_rank: _Optional[int] = ..., total_kv_heads: _Optional[int] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("outstanding_requests", "outstanding_tokens", "waiting_requests", "running_requests", "free_kv_blocks", "total_kv_blocks", "page_size")
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    outstanding_requests: int
    outstanding_tokens: int
    waiting_requests: int
    running_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    page_size: int
    def __init__(self, outstanding_requests: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., page_size: _Optional[int] = ...) -> None: ...
