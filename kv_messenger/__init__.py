"""kv_messenger: moves a request's KV from a prefill node's pages into a decode node's pages.

The role-split connectors between an engine and the transport (STYLE 7; the seam is
pdserve.engine.kv_connector): `KvSender` (a PrefillConnector) on prefill nodes, `KvReceiver` (a
DecodeConnector) on decode nodes, the `TransferTicket` a decode node sends in its Prefill call,
and the transfer arithmetic in `plan`. Engines and fabric never import each other, nor this
package; nodes build the transport and the connector and hand the connector to their engine.
The decode side's transfer protocol (attempts, quarantines, key rotation) is one state machine in
`kv_messenger.decode` (docs/transfer-safety.md); nodes reach fabric only through `transport`.
"""

from kv_messenger.context import Context, ContextCodec
from kv_messenger.plan import KvLayout, ShardingScheme, UnsupportedModelError, completed_pages, expected_writes
from kv_messenger.receiver import KvReceiver, ReceiverEvents
from kv_messenger.sender import KvSender, TransferResult
from kv_messenger.ticket import TransferTicket

__all__ = [
    "Context",
    "ContextCodec",
    "KvLayout",
    "KvReceiver",
    "KvSender",
    "ReceiverEvents",
    "ShardingScheme",
    "TransferResult",
    "TransferTicket",
    "UnsupportedModelError",
    "completed_pages",
    "expected_writes",
]
