"""FabricConfig: the frozen, validated configuration of a TransferEngine."""

from __future__ import annotations

import os
from dataclasses import dataclass

IMM_MODES = ("last", "every")
LOCALITIES = ("cluster", "host")
DEFAULT_PROVIDERS = {"cluster": "tcp;ofi_rxm", "host": "shm"}


@dataclass(frozen=True)
class FabricConfig:
    """How a TransferEngine opens its endpoint and schedules work.

    provider: libfabric provider name ("tcp;ofi_rxm", "shm", "efa",
        "verbs;ofi_rxm"). None: the FI_PROVIDER environment variable, else
        the default for ``locality``.
    locality: "cluster" (peers on other hosts: tcp;ofi_rxm) or "host" (all
        peers on this host: shm). Only used to pick the default provider.
    node: local address to bind (e.g. "127.0.0.1", "10.251.0.1"); None lets
        the provider choose. Ignored by shm.
    imm_mode: "last": one write per batch carries the immediate data, posted
        only after every other write of the batch completed locally, so the
        receiver counts one per write_pages call. "every": every write carries
        it, weighted by the entries it holds, so the receiver counts one per
        entry (page) however the writes were coalesced (see fabric.imm).
    coalesce: merge entries contiguous at both ends (source and destination)
        into one write, in both modes.
    max_write_bytes: split ("last") or refuse ("every") entries above this
        size, and stop merging at it; 0 = the provider's max_msg_size.
    delivery_complete: FI_DELIVERY_COMPLETE, so that on_done means the data
        is in the target's memory. True: wherever the provider offers it;
        False: never; None (default): where it costs nothing measurable (shm,
        and RDMA providers, whose completions already wait for the target),
        not on tcp, where every write then waits for an acknowledgement from
        the target's progress (it cost 64 KiB writes much of their bandwidth:
        bench/results/fabric/fabric-notes.md).
        The engine's ``delivery_complete`` attribute says what was granted.
        shm control messages never use it (they must not wait on a peer that
        may have died). Nothing in pdserve depends on it: the receiver counts
        immediate data, which always arrives after the data it covers.
    tx_depth: most writes posted at once; 0 = the provider's tx queue size.
    control_slots / control_msg_size: receive buffers for control messages.
    spin_us: how long the progress thread spins after the last activity
        before it sleeps on the provider's wait fd or its doorbell (idle, it
        uses no CPU; see csrc/pdf_wait.h). Short by default: on a small
        machine a spinning thread takes the core the peer or the caller
        needs (on 2 cores longer spins cost 64 KiB shm writes both bandwidth
        and lone-write latency: bench/results/fabric/fabric-notes.md, commit 36e12b5).
    busy_spin_us: how long it spins without progress while its own writes
        are outstanding, before sleeping in steps up to sleep_max_us (the
        longest step of the timed sleeps, also used when the provider offers
        no way to be woken).
    sync_spin_us: how long ``write_pages_sync`` runs progress on the
        calling thread (posting, polling the CQ) before it hands over to the
        progress thread and sleeps. The caller burns its core only while it
        waits for its own write, never when idle. 0: sleep at once.
    busy_poll: the progress thread never sleeps: it keeps polling (yielding
        every 64 rounds). For latency-critical deployments with a core to
        spare per engine: an idle engine then costs a full core (measured in
        bench/results/fabric/fabric-notes.md), and on a 2-core machine a second
        spinning thread starves the peer it waits for.
    peer_timeout_s: a peer with outstanding writes and no completion for
        this long is declared failed (its batches get on_error); 0 disables.
    close_timeout_s: how long close() waits for outstanding writes.
    multi_rail: D16: allow ``TransferEngine.open_rail``, one more endpoint per libfabric domain
        (NIC) asked for, so that the KV messenger registers each TP shard's pool on the NIC its
        placement names (kv_messenger.pool). False: open_rail refuses and every shard stays on
        the one endpoint. A host with one NIC (or none) never gets a second rail either way.
    tcp_nodelay: FI_TCP_NODELAY. Nagle on the tcp provider's sockets delays the small messages rxm
        answers with (acknowledgements, completions): on loopback it made a lone 64 KiB write
        several times slower and halved bandwidth at 64 KiB (bench/results/fabric/fabric.md).
    av_remove_cleanup: FI_AV_REMOVE_CLEANUP. ``disconnect`` must end a peer's connection: ofi_rxm
        closes the connection of an address removed from the AV (dropping the operations still
        queued on it, so nothing more is read from their source buffers) only with this set.
        False only to study libfabric without it: disconnect then leaves rxm's connection open.
    Both are process-wide libfabric variables, read once when libfabric first initializes: applied
    at the first endpoint's open where the environment has no value (an explicit FI_* setting
    wins), and a later config asking otherwise is refused (fabric.environment).
    """

    provider: str | None = None
    locality: str = "cluster"
    node: str | None = None
    imm_mode: str = "last"
    coalesce: bool = True
    max_write_bytes: int = 0
    delivery_complete: bool | None = None
    tx_depth: int = 0
    control_slots: int = 64
    control_msg_size: int = 4096
    spin_us: int = 20
    busy_spin_us: int = 2000
    sleep_max_us: int = 1000
    sync_spin_us: int = 200
    busy_poll: bool = False
    peer_timeout_s: float = 5.0
    close_timeout_s: float = 5.0
    multi_rail: bool = True
    tcp_nodelay: bool = True
    av_remove_cleanup: bool = True

    def __post_init__(self) -> None:
        if self.locality not in LOCALITIES:
            raise ValueError(f"locality={self.locality!r}: expected one of {LOCALITIES}")
        if self.imm_mode not in IMM_MODES:
            raise ValueError(f"imm_mode={self.imm_mode!r}: expected one of {IMM_MODES}")
        if self.provider is not None and (not isinstance(self.provider, str) or not self.provider.strip()):
            raise ValueError(f"provider={self.provider!r}: expected a non-empty provider name or None")
        for name in ("max_write_bytes", "tx_depth", "spin_us", "busy_spin_us", "sync_spin_us"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: expected an int >= 0")
        if not isinstance(self.control_slots, int) or not 1 <= self.control_slots <= 4096:
            raise ValueError(f"control_slots={self.control_slots!r}: expected 1..4096")
        if not isinstance(self.control_msg_size, int) or not 256 <= self.control_msg_size <= 65536:
            raise ValueError(f"control_msg_size={self.control_msg_size!r}: expected 256..65536")
        if not isinstance(self.sleep_max_us, int) or not 1 <= self.sleep_max_us <= 1_000_000:
            raise ValueError(f"sleep_max_us={self.sleep_max_us!r}: expected 1..1000000")
        if not (isinstance(self.peer_timeout_s, (int, float)) and 0 <= self.peer_timeout_s <= 3600):
            raise ValueError(f"peer_timeout_s={self.peer_timeout_s!r}: expected 0..3600 seconds")
        if not isinstance(self.multi_rail, bool):
            raise ValueError(f"multi_rail={self.multi_rail!r}: expected a bool")
        for name in ("tcp_nodelay", "av_remove_cleanup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a bool")
        if not isinstance(self.busy_poll, bool):
            raise ValueError(f"busy_poll={self.busy_poll!r}: expected a bool")
        if self.sync_spin_us > 1_000_000:
            raise ValueError(f"sync_spin_us={self.sync_spin_us!r}: expected 0..1000000")
        if self.delivery_complete not in (None, True, False):
            raise ValueError(f"delivery_complete={self.delivery_complete!r}: expected None, True or False")
        if not (isinstance(self.close_timeout_s, (int, float)) and 0 <= self.close_timeout_s <= 3600):
            raise ValueError(f"close_timeout_s={self.close_timeout_s!r}: expected 0..3600 seconds")

    def wants_delivery_complete(self, provider: str) -> bool:
        """Whether to ask ``provider`` for FI_DELIVERY_COMPLETE (see the field)."""
        if self.delivery_complete is not None:
            return self.delivery_complete
        return not provider.startswith("tcp")

    def libfabric_environment(self) -> dict[str, tuple[str, str]]:
        """The FI_* variables this config asks of libfabric: name -> (value, the field asking it)."""
        return {"FI_TCP_NODELAY": ("1" if self.tcp_nodelay else "0", "tcp_nodelay"),
                "FI_AV_REMOVE_CLEANUP": ("1" if self.av_remove_cleanup else "0", "av_remove_cleanup")}

    def resolved_provider(self) -> str:
        """The provider to open: explicit, else $FI_PROVIDER, else by locality."""
        if self.provider:
            return self.provider
        env = os.environ.get("FI_PROVIDER", "").strip()
        if env:
            return env
        return DEFAULT_PROVIDERS[self.locality]
