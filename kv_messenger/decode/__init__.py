"""The decode side of the transfer: one state machine (issue 30 item 1). A decode node builds a
`DecodeTransfers` (it builds the KvReceiver its engine gets as the connector), supplies the
prefill pool through the small interfaces of `client`, and turns gRPC into calls; everything the
transfer protocol decides lives here:

- `attempt`: one attempt (`Attempt`), a request's attempts (`RequestState`, `RequestTable`) and the
  watched Prefill call (`PrefillWatch`: deadline, stall, rotation, S7 verify, D19 rejection);
- `quarantine`: a `Quarantine` with explicit `HoldState`s and the hold loop (`QuarantineHolds`:
  AbortPrefill with backoff and fence, close, peer gone, drain);
- `rotation`: the memory-key generations and the rotation (`KeyRotation`);
- `transfers`: the receiver's events, the engine-thread callbacks and the transfer tasks.

The correctness argument and the state diagrams: docs/transfer-safety.md. Each module's docstring
lists its threads and its blocking waits with their bounds.
"""

from kv_messenger.decode.attempt import (
    KV_LANDED_WAIT_S,
    PREFILL_RESPONSE_WAIT_S,
    STALL_POLL_S,
    Attempt,
    AttemptResult,
    PrefillOutcome,
    PrefillWatch,
    RequestState,
    RequestTable,
)
from kv_messenger.decode.client import PrefillClient, PrefillTarget, RpcError, TransferTelemetry
from kv_messenger.decode.quarantine import (
    ABORT_RPC_TIMEOUT_S,
    DRAIN_GRACE_S,
    DRAIN_WAIT_S,
    FENCE_WAIT_S,
    HOLD_BACKOFF_MAX_S,
    HOLD_BACKOFF_S,
    HOLD_POLL_S,
    QUARANTINE_LOG_S,
    HoldState,
    HoldTransitionError,
    Quarantine,
    QuarantineHolds,
    Release,
)
from kv_messenger.decode.rotation import ROTATE_CLOSE_WAIT_S, ROTATE_POLL_S, KeyRotation
from kv_messenger.decode.transfers import CHECKSUM_RETRIES_SAME_NODE, DecodeTransfers, TransferSettings

__all__ = [
    "ABORT_RPC_TIMEOUT_S",
    "CHECKSUM_RETRIES_SAME_NODE",
    "DRAIN_GRACE_S",
    "DRAIN_WAIT_S",
    "FENCE_WAIT_S",
    "HOLD_BACKOFF_MAX_S",
    "HOLD_BACKOFF_S",
    "HOLD_POLL_S",
    "KV_LANDED_WAIT_S",
    "PREFILL_RESPONSE_WAIT_S",
    "QUARANTINE_LOG_S",
    "ROTATE_CLOSE_WAIT_S",
    "ROTATE_POLL_S",
    "STALL_POLL_S",
    "Attempt",
    "AttemptResult",
    "DecodeTransfers",
    "HoldState",
    "HoldTransitionError",
    "KeyRotation",
    "PrefillClient",
    "PrefillOutcome",
    "PrefillTarget",
    "PrefillWatch",
    "Quarantine",
    "QuarantineHolds",
    "Release",
    "RequestState",
    "RequestTable",
    "RpcError",
    "TransferSettings",
    "TransferTelemetry",
]
