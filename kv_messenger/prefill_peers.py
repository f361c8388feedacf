"""The prefill side's decode peers: the fabric connection to each decode node's engine and its
connection generation (S5, D20; docs/transfer-prefill-side.md, "Connection epochs").

Owns `DecodePeers`: shakes hands with a decode engine once (`connect`, remembered for the last
REMEMBERED_PEERS engines: forgetting one only means a fresh handshake next time) and retires one
whose transfer failed at the fabric (`retire`: its connection generation moves on, then it is
disconnected, so nothing more is sent from that transfer's source pages). `ConnectionEpochs`
keeps the generations, bounded (REMEMBERED_EPOCHS).

Threads: the prefill node's serving loop only (kv_messenger.prefill_transfers calls it); the
handshake itself runs in a worker thread so that the loop keeps answering.

Blocking waits and their bounds:
- `connect` (awaited on the loop, the handshake in a worker thread): TransferEngine.connect's
  timeout (5 s, fabric.peers), then UnavailableError.
- `retire` (on the loop): TransferEngine.disconnect, the endpoint's lock and fi_av_remove; no wait
  on the peer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from fabric import FabricError, PeerDescriptor, TransferEngine
from pdserve_api.servers import UnavailableError

logger = logging.getLogger(__name__)

REMEMBERED_PEERS = 4096    # decode-node fabric peers we have connected to
REMEMBERED_EPOCHS = 4096   # decode-node fabric peers whose connection generation we keep


class ConnectionEpochs:
    """The connection generation of each decode-node fabric peer, bounded (REMEMBERED_EPOCHS).

    A transfer records its peer's generation when it starts (its tombstone keeps it); a failed
    transfer disconnects the peer and `bump`s it, so a fence on a later connection proves nothing
    of a transfer of an older generation. Generations come from one counter for every peer, and a
    peer forgotten to keep the map bounded raises the `floor` that every peer not in the map
    reads: a forgotten peer's generation never goes back to one a tombstone recorded before its
    failure (that would confirm an unprovable fence), while a tombstone of another peer may read a
    newer generation than it recorded and answer CONNECTION_FAILED (unconfirmed, never unsound).
    """

    def __init__(self, capacity: int = REMEMBERED_EPOCHS) -> None:
        if capacity < 1:
            raise ValueError(f"ConnectionEpochs needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._by_peer: OrderedDict[str, int] = OrderedDict()
        self._last = 0     # the newest generation handed out, any peer
        self.floor = 0     # at least every forgotten peer's generation

    def __len__(self) -> int:
        return len(self._by_peer)

    def get(self, engine_id: str) -> int:
        return self._by_peer.get(engine_id, self.floor)

    def bump(self, engine_id: str) -> int:
        """A new generation for this peer (its connection was closed); returns it."""
        self._last += 1
        self._by_peer[engine_id] = self._last
        self._by_peer.move_to_end(engine_id)
        while len(self._by_peer) > self.capacity:
            _, forgotten = self._by_peer.popitem(last=False)
            self.floor = max(self.floor, forgotten)
        return self._last


class DecodePeers:
    """The decode engines this prefill process writes to: connected once, retired on failure."""

    def __init__(self, transport: TransferEngine, capacity: int = REMEMBERED_PEERS) -> None:
        self.transport = transport
        self.capacity = capacity
        self._peers: OrderedDict[str, PeerDescriptor] = OrderedDict()   # engine_id -> connected peer
        # engine_id -> connection generation: a new one each time a transfer to it failed at the
        # fabric (the peer is disconnected then): a fence on a later connection proves nothing of the old.
        self.epochs = ConnectionEpochs()

    async def connect(self, peer: PeerDescriptor) -> None:
        """Shake hands with a decode node's fabric engine once (TransferEngine.connect, bounded by its
        5 s timeout), in a worker thread: the loop keeps answering meanwhile (GetNodeInfo, aborts)."""
        if peer.engine_id in self._peers:
            self._peers.move_to_end(peer.engine_id)
            return
        try:
            await asyncio.to_thread(self.transport.connect, peer)
        except FabricError as e:
            raise UnavailableError(f"cannot reach the decode node's fabric peer {peer.engine_id[:8]} "
                                   f"(pid {peer.pid}): {e}") from e
        self._peers[peer.engine_id] = peer
        logger.info("connected to decode fabric peer %s (pid %d)", peer.engine_id[:8], peer.pid)
        while len(self._peers) > self.capacity:
            self._peers.popitem(last=False)   # forgetting only means a fresh connect next time

    def retire(self, peer: PeerDescriptor) -> None:
        """A transfer to this decode peer failed at the fabric: disconnect it (its connection and
        whatever the provider still queued on it go), so that nothing more is sent from the
        transfer's source pages; the next Prefill from it connects afresh. The transfer's own peer is
        disconnected even when this map forgot it meanwhile (REMEMBERED_PEERS): forgetting a peer
        does not close its connection."""
        engine_id = peer.engine_id
        epoch = self.epochs.bump(engine_id)
        self._peers.pop(engine_id, None)
        try:
            self.transport.disconnect(peer)
        except FabricError as e:
            logger.warning("decode peer %s: disconnect after a failed transfer: %s", engine_id[:8], e)
            return
        logger.info("decode peer %s disconnected after a failed transfer (connection generation %d)",
                    engine_id[:8], epoch)
