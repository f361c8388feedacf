"""kv_messenger: moves a request's KV from a prefill node's pages into a decode node's pages.

The role-split interface between engines and fabric (STYLE 7): `KvSender` on prefill nodes,
`KvReceiver` on decode nodes, the transfer arithmetic in `plan`. Engines and fabric never import
each other; nodes wire them together through this package.
"""

from kv_messenger.context import Context, ContextCodec
from kv_messenger.plan import KvLayout, ShardingScheme, completed_pages, expected_writes
from kv_messenger.receiver import KvReceiver, PrefillTicket
from kv_messenger.sender import KvSender, TransferResult, TransferTarget

__all__ = [
    "Context",
    "ContextCodec",
    "KvLayout",
    "KvReceiver",
    "KvSender",
    "PrefillTicket",
    "ShardingScheme",
    "TransferResult",
    "TransferTarget",
    "completed_pages",
    "expected_writes",
]
