from pdserve_api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_ROLE_UNSPECIFIED: _ClassVar[NodeRole]
    NODE_ROLE_PREFILL: _ClassVar[NodeRole]
    NODE_ROLE_DECODE: _ClassVar[NodeRole]
    NODE_ROLE_COLOCATED: _ClassVar[NodeRole]
NODE_ROLE_UNSPECIFIED: NodeRole
NODE_ROLE_PREFILL: NodeRole
NODE_ROLE_DECODE: NodeRole
NODE_ROLE_COLOCATED: NodeRole

class GetNodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "role", "model", "sharding", "load", "num_layers", "max_context_length", "fabric_peer", "transfers", "build")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FABRIC_PEER_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: NodeRole
    model: str
    sharding: _common_pb2.ShardingScheme
    load: _common_pb2.NodeLoad
    num_layers: int
    max_context_length: int
    fabric_peer: bytes
    transfers: TransferInfo
    build: BuildIdentity
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[NodeRole, str]] = ..., model: _Optional[str] = ..., sharding: _Optional[_Union[_common_pb2.ShardingScheme, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.NodeLoad, _Mapping]] = ..., num_layers: _Optional[int] = ..., max_context_length: _Optional[int] = ..., fabric_peer: _Optional[bytes] = ..., transfers: _Optional[_Union[TransferInfo, _Mapping]] = ..., build: _Optional[_Union[BuildIdentity, _Mapping]] = ...) -> None: ...

class BuildIdentity(_message.Message):
    __slots__ = ("version", "commit", "model", "model_config_hash", "kv_layout_hash", "kv_layout")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    version: str
    commit: str
    model: str
    model_config_hash: str
    kv_layout_hash: str
    kv_layout: str
    def __init__(self, version: _Optional[str] = ..., commit: _Optional[str] = ..., model: _Optional[str] = ..., model_config_hash: _Optional[str] = ..., kv_layout_hash: _Optional[str] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("quarantined_kv_blocks", "quarantined_transfers", "tags_in_use", "context_slots_in_use", "stale_writes", "held_requests", "active_transfers")
    QUARANTINED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TAGS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    STALE_WRITES_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    quarantined_kv_blocks: int
    quarantined_transfers: int
    tags_in_use: int
    context_slots_in_use: int
    stale_writes: int
    held_requests: int
    active_transfers: int
    def __init__(self, quarantined_kv_blocks: _Optional[int] = ..., quarantined_transfers: _Optional[int] = ..., tags_in_use: _Optional[int] = ..., context_slots_in_use: _Optional[int] = ..., stale_writes: _Optional[int] = ..., held_requests: _Optional[int] = ..., active_transfers: _Optional[int] = ...) -> None: ...
