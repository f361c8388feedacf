"""The decode node's core: one engine, and (disaggregated) one fabric endpoint, one KV receiver,
the prefill pool, and the transfer of each request's prompt KV. Knows nothing of the gRPC server:
decode_node.server converts and serves.

Threads and tasks:
- the engine thread (EngineThread) runs schedule -> run -> update; the receiver is the engine's
  DecodeConnector, and its `ticket_ready` event (a request has its pages) hands the ticket to the
  asyncio loop;
- the asyncio loop serves gRPC and runs one transfer task per request (the Prefill call, with a
  deadline, retries and safe abandonment);
- the fabric progress thread reports the completed immediate-data count (`kv_landed`), handed to
  the engine thread, which makes the request schedulable (D4: never before).

Transfer identity (D20): every attempt at a request has its own number (the receiver counts
them per request id), tag and context slot; a prefill node keys the work by (this node's fabric
engine id, request id, attempt), so a retry is never refused or confused with the old attempt.

Failure (S1, S3, S5): an attempt fails when its Prefill call fails, passes its deadline, or
stalls: no write of it landed and the prefill node answered no GetNodeInfo for
`DecodeNodeConfig.stall_s` (default 3 s). Its pages may still be written, so they are never
reused: the engine moves them to a quarantine (LLMEngine.quarantine_blocks; the receiver keeps
their tag and context slot) and the request is admitted again at once into fresh pages for a new
attempt on a prefill node it has not tried (or prefilled here with `local_prefill_fallback`).
The quarantine is held, on the loop, until the prefill side has provably stopped: the process
the attempt was sent to (its fabric engine id) confirms AbortPrefill and the delivery fence it
posts between the same pair of endpoints lands here (possibly on a newer rxm connection: rxm
1.17 accepts one only once the previous one is closed here, so an earlier write lands before the
fence or never, tests/fabric/test_fence_reconnect.py; on tcp;ofi_rxm a write "completed locally" is
not delivered; the connection delivers in order, FI_ORDER_WAW), or its endpoint is gone (it said
goodbye or, same host, its process ended; what it sent before is drained first). AbortPrefill is
re-sent with backoff until then; a restarted process at the same address never confirms. Only
nodes whose fabric engine is known (from GetNodeInfo) are sent work. A client that goes away
mid-transfer quarantines the attempt the same way.

Terminal but unfenced (after a partition, a fabric-port partition, heavy loss): that process
answers that the key ended (CONNECTION_FAILED, or FINISHED without a fence: its writes are not
ordered, or the fence did not land within FENCE_WAIT_S, or ours are not ordered,
TransferEngine.writes_ordered). "Ended" means nothing more will ever be posted for the key and
every posted write completed there, in error or not; but "completed" on tcp;ofi_rxm is "handed to
the socket", and a socket the prefill side closed may still be flushing (an orphan in its
kernel). With --rotate-key-after (below) such a hold, once it is rotate_key_after_s old, asks for
a key rotation, which releases it: the answer said nothing more will be posted for the key, and
what was posted before is under the old memory key, which the rotation closes (checked as each
write arrives: later bytes refused), then it ends every fabric connection and drains -- so no
byte of it can land after the release, whatever the order of the answer and the rotation. This
is the crash-free release of an unfenced end, and the way a fabric-only partition with gRPC up
(the node keeps answering GetNodeInfo, so it is never "silent") gets its pages back. The older
option: where the provider carries writes on connections (TransferEngine.closes_connections,
ofi_rxm) the hold then closes OUR side: `close_connection` (fi_av_remove with
FI_AV_REMOVE_CLEANUP: rxm closes every connection of that address), then drains what the
progress thread already read, then releases. Why that is sound: every byte of the key was posted
before the answer, so on a connection opened before it; the close begins after the answer (a
count of closes begun per prefill engine, read as the answer arrives, must have grown under that
engine's lock: a close begun before the answer proves nothing, the key may then still have been
posting, on a connection opened after that close), and once our socket is closed our kernel answers any later segment of
it with a reset (data on a closed socket), never delivering it; the bytes already read into our
memory were written before the release. A new connection (opened lazily by the next write or
message either way) carries only what is posted after the answer, never this key's.
What the close does to the other transfers from that prefill engine in flight at that moment:
their later bytes are refused too, so each of them is either failed at the prefill side (its
Prefill fails -> quarantined here -> its own AbortPrefill answers CONNECTION_FAILED -> one more
close, or the same one if its answer came before that one began) or completed locally there
with bytes lost here (its write count never completes -> KV_LANDED_WAIT_S -> quarantined -> its
fence cannot land -> ended unfenced -> a close). Either way it fails over to a fresh attempt and
its pages are released only by a proof of its own, never by this close; holds whose fences were
in flight are answered the same way; quarantines of other prefill engines are not touched.
On shm (no connection to close, no key checked) an unfenced end keeps the pages held, re-asked
with backoff. The close is OFF BY DEFAULT (DecodeNodeConfig.release_unfenced_by_close,
--release-unfenced-by-close; it stays as the older option, and when both are on the close comes
first, as the hold's answer arrives): with
libfabric 1.17, fi_av_remove of a peer whose connection has a write half received (a partition
struck mid-message, the normal case here) segfaults inside rxm (SIGSEGV in its ECANCELED handling
under pdf_av_remove: 4 of 5 probes, and a decode node in test_network_faults' fabric partition);
a close before a burst starts is fine (tests/fabric/test_connection_close.py). Without it, an
unfenced end is released by a key rotation (--rotate-key-after: sockets shut down from outside
libfabric, rxm's own close path, never av_remove) or, with neither flag, stays held, like a dead
host below.

A prefill host that dies silently (or stays partitioned) never answers: its quarantines are held
for ever (S5 over S2), visible as pdserve:kv_quarantine_oldest_seconds{peer} (the oldest hold's
age, as of its latest round) and a warning every QUARANTINE_LOG_S -- unless key rotation is on.
Closing our connection alone is not enough (a live but partitioned process may still post the
key's writes after the heal, on a new connection), and a lease the prefill side checks before
each post has a check-then-post window no lock closes (a process paused between the check and
the post, e.g. a frozen VM, posts after the lease ran out; its monotonic clock did not run).
Key rotation (`DecodeNodeConfig.rotate_key_after_s`, --rotate-key-after; OFF by default: it
fails over every transfer in flight from every prefill node, so an operator opts into that cost)
is sound because the target enforces it: when a hold is that old and either its prefill node
answered no GetNodeInfo for `stall_s` (a silent death) or its abort ended there unfenced (above),
the node (`_rotate_keys`, one at a time; one rotation for every hold that asks at once, and it
releases every hold of an older generation, asked or not) registers the KV pool (every rank), the
context landing area and the fence buffer again under new keys (KvReceiver.rotate_keys, on the
engine thread, so each ticket names one generation; tickets prepared from then on carry the new
descriptors), fails over every transfer of an older generation still in flight (its Prefill call
is cancelled at its next progress poll; one not yet sent is never sent: a new attempt in fresh
pages, the node not counted as tried), closes the old registrations (fi_close: tcp checks a
write's key as its header arrives, so a write whose header comes later is refused there and never
lands -- measured: tests/fabric/test_key_rotation_sockets.py), then ends every fabric connection
open now, because a write whose key was checked before the close goes on being copied in as its
bytes arrive (measured there too): each TCP socket of our fabric endpoints is shut down
(decode_node.fabric_sockets: shutdown(2) from outside libfabric; later data is answered with a
reset; the provider reads end-of-stream and closes it as for a dead peer; fi_av_remove would
crash rxm 1.17 in exactly this half-received state), the rotation waits until the provider closed
them all (ROTATE_CLOSE_WAIT_S, else it is retried next round), and drains. Then no write under an
old key can land any more, and every hold of an older generation is released at once (its next
poll), counted in pdserve:kv_key_rotations_total; a stopped process that resumes finds its
connection reset and its later writes refused. Only on tcp;ofi_rxm: on shm (no key is checked)
the flag is ignored with a warning, as a rotation would prove nothing there (same-host death is
already detected); verbs/efa (the NIC invalidates a closed key, no sockets to end) are not
measured here, so ignored as well.

S7 (`DecodeNodeConfig.kv_checksum`, --kv-checksum): the Prefill asks for checksums; the landed
count no longer makes the request schedulable by itself: once the count completed AND the
Prefill response (the sender's CRC32C of every run) arrived, the receiver hashes the runs that
landed in our pages (KvReceiver.verify, off the loop) and only a match calls kv_ready. A mismatch
is logged (both values, the first bad layer/page/K-V run), counted
(pdserve:kv_checksum_failures_total) and fails the attempt: the count completed, so nothing more
can land and the pages are freed at once, unused and never committed to the prefix cache; the
request is re-prefilled in fresh pages (on the same node once, CHECKSUM_RETRIES_SAME_NODE, then
on others) or fails naming the mismatch.

The context record (D19, kv_messenger.context): once an attempt's write count completed (and,
with --kv-checksum, its runs verified), the engine thread checks its context record
(KvReceiver.context: magic, version, checksum, this node's hidden size / top-k / dtype / hidden
kind, the attempt's identity and position) for EVERY transfer, whether or not speculation reads
the hidden state, before kv_ready. A record that does not match is logged (the field, both
values), counted (pdserve:kv_context_rejected_total) and fails the attempt as a checksum mismatch
does: the count completed, so nothing more can land and its pages are freed at once, unused and
never committed to the prefix cache; the loop is woken at once (no KV_LANDED_WAIT_S) and the
request is re-prefilled in fresh pages (bounded as there: the same node once,
CHECKSUM_RETRIES_SAME_NODE, then others) or fails naming the field. It never decodes from it.

Who may write (S9, issue 15 item 6): an attempt's write count and an abort's fence are bound to
the fabric engine of the prefill process the attempt was dispatched to (KvReceiver.address's
prefill_engine, expect_fence's writer: the engine id from GetNodeInfo). Where the provider names
the writer of each write (fabric.imm: efa), a write from any other engine, or from an address
not in our AV, never counts toward either (nor toward a quarantine): it is counted stale
(pdserve:kv_stale_writes_total, logged naming both engines), so a third engine that learned the
pool's key and a live tag cannot make a request schedulable or release a quarantine. shm and
tcp;ofi_rxm (libfabric 1.17) do not name the writers of remote writes, so there the check is off
and every write with the tag counts, as before; what stops a stranger there is the memory key
(tcp checks it; key rotation above), or, on shm, nothing (same host: it can write our
memory anyway).

TEST ONLY: a node built with a fault plan (DecodeNodeConfig.faults, pdserve.engine.faults; the
entry point reads its `bad_shard_key` from $PDSERVE_TEST_ONLY_BAD_SHARD_KEY="PREFIX:RANK:N[,...]")
makes the Prefill calls of attempts 0 .. N-1 of request ids starting with PREFIX name decode rank
RANK's pool under a wrong memory key (logged as a warning), so that on tcp;ofi_rxm the target
refuses that shard's writes while the other ranks' land (tests/integration/test_disagg_tp_faults.py).
Without a plan (always, outside that test): no effect.

Per request, one `RequestState` (while its Generate handler runs) holds when it was admitted, its
transfer, where it was prefilled and how that went.

Blocking waits, with their bounds (all on the loop; no executor thread is parked): a Prefill
call (`DecodeNodeConfig.prefill_timeout_s`, cut short by a stall after `stall_s`, polled every
STALL_POLL_S); the write count after a successful Prefill (KV_LANDED_WAIT_S); one AbortPrefill
(ABORT_RPC_TIMEOUT_S) and its fence (FENCE_WAIT_S); a close of our connection to a prefill
engine (its lock: the closes before it, each one fi_av_remove plus a drain); a quarantine's hold: unbounded by design
(S5: pages no write may land in are never reused), in rounds HOLD_BACKOFF_S doubling to
HOLD_BACKOFF_MAX_S, the endpoint's death looked at every HOLD_POLL_S, then its arrivals drained
(DRAIN_GRACE_S + at most DRAIN_WAIT_S); a key rotation: its registrations on the engine
thread (one engine step's wait), the fi_close of each old one (a worker thread), the provider's
close of the shut-down sockets (ROTATE_CLOSE_WAIT_S, polled) and a drain as above, the holds
looked at every ROTATE_POLL_S; an attempt whose only untried prefill nodes are marked
down waits for their retry (prefill_pool.RETRY_DOWN_AFTER_S); a finished request's wait for its
Prefill response (PREFILL_RESPONSE_WAIT_S); with --kv-checksum, the count after the response
(KV_LANDED_WAIT_S) and one verification (a hash of the request's pages, in a worker thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import grpc

from decode_node.fabric_sockets import endpoint_of, fabric_sockets, open_inodes, shut_down
from decode_node.prefill_pool import PREFILL_ROUTING, PrefillNode, PrefillPool, PrefixAffinity
from fabric import FabricConfig, TransferEngine
from kv_messenger import KvReceiver, ReceiverEvents, TransferTicket
from kv_messenger.context import ContextRecordError
from kv_messenger.placement import placement_info
from kv_messenger.receiver import CONTEXT_SLOTS
from kv_messenger.ticket import peer_to_bytes, remote_to_bytes
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.faults import BAD_SHARD_KEY_ENV, NO_FAULTS, FaultPlan
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.serving.build_identity import engine_identity
from pdserve.serving.channels import PLAINTEXT, ChannelSecurity
from pdserve.serving.logs import bind_request_id
from pdserve.serving.metrics import node_metrics, request_metrics
from pdserve_api.v1 import common_pb2, node_pb2, prefill_pb2

logger = logging.getLogger(__name__)

# A request whose KV has landed may finish before its Prefill response is processed (a one-token
# answer): its final message waits this long at most for the response's timings and cached count.
PREFILL_RESPONSE_WAIT_S = 10.0
KV_LANDED_WAIT_S = 10.0      # after a successful Prefill: the write count completes within this
ABORT_RPC_TIMEOUT_S = 12.0   # deadline of one AbortPrefill call (the prefill side waits up to 10 s for its writes)
FENCE_WAIT_S = 5.0           # a confirmed abort's fence lands within this, or the abort is re-sent
STALL_POLL_S = 0.25          # a Prefill call's progress is looked at this often
HOLD_BACKOFF_S = 0.25        # a quarantine's first pause before AbortPrefill is re-sent ...
HOLD_BACKOFF_MAX_S = 5.0     # ... doubling up to this
HOLD_POLL_S = 0.1            # while held: whether the prefill endpoint is gone, this often
DRAIN_GRACE_S = 0.05         # a gone peer's bytes in our socket buffers become readable
DRAIN_WAIT_S = 1.0           # then at most this for two progress rounds to handle them
POOL_REFRESH_S = 1.0         # GetNodeInfo of every prefill node, this often
QUARANTINE_LOG_S = 30.0      # a hold still unanswered is logged (a warning) this often
ROTATE_POLL_S = 0.5          # --rotate-key-after: the holds are looked at this often
ROTATE_CLOSE_WAIT_S = 5.0    # a rotation's shut-down fabric sockets are closed within this, or it retries
CHECKSUM_RETRIES_SAME_NODE = 1   # S7: checksum failures of a request that may retry on the same prefill node
TEST_BAD_SHARD_KEY_ENV = BAD_SHARD_KEY_ENV   # deprecated alias: pdserve.engine.faults.BAD_SHARD_KEY_ENV

# One AbortPrefill's outcome (DecodeNode._abort_confirmed).
ABORT_CONFIRMED, ABORT_ENDED_UNFENCED, ABORT_NOT_YET = "confirmed", "ended-unfenced", "not-yet"
# The prefill node says nothing more will ever be posted for the key and every posted write of it
# completed there (in error or not); with confirmed=False, no fence proves they landed.
TERMINAL_STATES = frozenset({prefill_pb2.TRANSFER_STATE_FINISHED, prefill_pb2.TRANSFER_STATE_CONNECTION_FAILED})


@dataclass(frozen=True)
class DecodeNodeConfig:
    """One decode (or colocated) node."""

    engine: EngineConfig
    node_id: str
    colocated: bool = False
    prefill_addresses: tuple[str, ...] = ()   # HOST:PORT of the prefill nodes (not colocated)
    provider: str | None = "shm"              # libfabric provider; None: $FI_PROVIDER or the default
    fabric_node: str | None = None            # local address the fabric endpoint binds (not for shm)
    prefill_timeout_s: float = 60.0           # deadline of one Prefill call
    stall_s: float = 3.0                      # no write landed and no health answer this long: stalled
    local_prefill_fallback: bool = False      # no prefill node can serve: prefill here instead of failing
    prefill_routing: str = "least-loaded"
    channel_security: ChannelSecurity = PLAINTEXT   # of the channels to prefill nodes (mTLS, token)
    max_waiting_requests: int = 2048          # requests held before their first token; more: RESOURCE_EXHAUSTED (S8)
    release_unfenced_by_close: bool = False   # ended-unfenced holds released by closing our connection (see above)
    kv_checksum: bool = False                 # S7: verify CRC32C of every landed run before scheduling
    rotate_key_after_s: float | None = None   # a hold this old, prefill silent or end unfenced: rotate the key
    faults: FaultPlan = NO_FAULTS             # TEST ONLY: the injected fault plan (pdserve.engine.faults)

    def __post_init__(self) -> None:
        if self.prefill_routing not in PREFILL_ROUTING:
            raise ValueError(f"prefill routing must be one of {PREFILL_ROUTING}, got {self.prefill_routing!r}")
        if not self.node_id:
            raise ValueError("node_id is empty")
        if not self.prefill_timeout_s > 0:
            raise ValueError(f"prefill_timeout_s must be > 0, got {self.prefill_timeout_s!r}")
        if not self.stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got {self.stall_s!r}")
        if self.rotate_key_after_s is not None and not self.rotate_key_after_s > 0:
            raise ValueError(f"rotate_key_after_s must be > 0 (or None: off), got {self.rotate_key_after_s!r}")
        if self.colocated and self.prefill_addresses:
            raise ValueError(f"a colocated node uses no prefill nodes, got {list(self.prefill_addresses)}")


@dataclass(frozen=True)
class PrefillOutcome:
    """A successful remote prefill, as the final message reports it."""

    call_start: float      # time.monotonic() of the Prefill call
    prefill_s: float       # prefill-side time from receipt to the last layer done
    tail_s: float          # the rest until the write count completed here
    cached_tokens: int     # prompt tokens the prefill node took from its prefix cache (not computed)


@dataclass
class Transfer:
    """One request's prompt KV on its way here (loop-owned)."""

    token_ids: tuple[int, ...]                # prompt minus its last token
    attempt: int = 0
    task: asyncio.Task | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    node: PrefillNode | None = None
    prefill_engine_id: str = ""               # the fabric engine of the process it was sent to
    ready_time: float = 0.0
    tag: int = 0                              # the attempt's imm tag (its landing names it)
    landed: asyncio.Event = field(default_factory=asyncio.Event)   # S7: the count completed, not verified yet
    corrupt: bool = False                     # S7: its checksums did not match (or could not be checked),
                                              # or (D19) its context record was rejected
    rejected: str = ""                        # D19: why its context record was rejected ('' if it was not);
                                              # `ready` is then set too, to wake the loop at once
    started: bool = False                     # its task began running (a task cancelled before that never does)
    key_gen: int = 0                          # the memory-key generation its ticket names (key rotation)
    rotated: bool = False                     # failed over because a key rotation closed its key


@dataclass
class Quarantine:
    """An abandoned attempt whose writes may still land: its pages and tag, held until the
    prefill side provably stopped (loop-owned; `tag` and `blocks` set on the engine thread)."""

    request_id: str
    attempt: int
    quarantine_id: str                        # LLMEngine.quarantine_blocks's id
    node: PrefillNode
    decode_engine_id: str
    prefill_engine_id: str
    peer: object | None                       # the prefill node's fabric PeerDescriptor
    since: float
    tag: int | None = None
    blocks: int = 0                           # pages quarantined; -1: none (the request had ended)
    rounds: int = 0
    closes_at_answer: int = 0                 # closes of our connection to its engine begun by its last answer
    key_gen: int = 0                          # the memory-key generation its attempt's ticket named
    ended_unfenced: bool = False              # its prefill process answered the key ended, unfenced (sticky)
    logged: float = 0.0                       # time.monotonic() of its last "still quarantined" warning


@dataclass
class RequestState:
    """What the node tracks for one request while its Generate handler runs."""

    request_id: str
    admitted: float = 0.0                     # pages allocated (written once, by the engine thread)
    transfer: Transfer | None = None
    prefilled_on: str = ""                    # address of the prefill node last asked
    outcome: PrefillOutcome | None = None     # its successful remote prefill
    handler_done: bool = False                # kept only until its transfer task ends
    tried: set[str] = field(default_factory=set)     # prefill nodes its attempts failed on (or run on now)
    errors: list[str] = field(default_factory=list)  # why each failed
    checksum_failures: int = 0                # S7 / D19: attempts whose landed bytes or context record were wrong


class DecodeNode(ReceiverEvents):
    """Engine + receiver + prefill pool. Build it (slow: loads the model), then `await start()` on
    the serving loop."""

    def __init__(self, config: DecodeNodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.colocated = config.colocated
        self.metrics = node_metrics()
        request_metrics()  # registered now, so that /metrics names every family before the first request
        self.requests: dict[str, RequestState] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport: TransferEngine | None = None
        self.receiver: KvReceiver | None = None
        self.pool: PrefillPool | None = None
        self._refreshers: list[asyncio.Task] = []
        self._holds: dict[str, asyncio.Task] = {}   # quarantine id -> its hold
        self._held: dict[str, Quarantine] = {}       # quarantine id -> what it holds (ages: the gauge)
        self._aged: set[str] = set()                 # prefill addresses the age gauge has a value for
        self._conn_closes: dict[str, int] = {}       # prefill engine id -> closes of our connection to it begun
        self._close_locks: dict[str, asyncio.Lock] = {}
        # Key rotation: tickets prepared now name generation _key_gen (written on the engine thread);
        # every generation below _keys_dead_below has its registrations closed and every fabric
        # connection open at that close ended, so no write under its keys can land any more.
        self._key_gen = 0
        self._keys_dead_below = 0
        self._retired_regions: list = []             # registrations replaced by a rotation, not closed yet
        self.closing = False
        if config.faults.bad_shard_key:
            logger.warning("TEST ONLY: %r: those requests' attempts are sent a wrong memory key for one decode "
                           "rank's pool", config.faults.bad_shard_key)
        if config.colocated:
            self.engine = EngineThread(LLMEngine(config.engine), faults=config.faults)
        else:
            self.transport = TransferEngine(FabricConfig(provider=config.provider, node=config.fabric_node))
            try:
                # A context slot per request that may wait for its KV (at most max_waiting_requests:
                # they have no first token yet), plus CONTEXT_SLOTS for quarantined attempts.
                self.receiver = KvReceiver(self.transport, events=self, kv_checksum=config.kv_checksum,
                                           context_slots=config.max_waiting_requests + CONTEXT_SLOTS,
                                           faults=config.faults)
                # UnsupportedModelError (a ValueError): sliding-window / hybrid models
                self.engine = EngineThread(LLMEngine(config.engine, kv_connector=self.receiver), faults=config.faults)
            except BaseException:
                self.transport.close()
                raise
        self.llm = self.engine.engine
        info = self.llm.info()
        self.model_name: str = info.model_name
        self.max_model_len: int = info.max_model_len
        self._page_size = info.page_size
        plan = self.llm.tp_plan   # None at TP 1
        self.tp_size: int = plan.tp_size if plan is not None else 1
        self.kv_heads_per_rank: int = len(plan.ranks[0].kv_heads) if plan is not None else info.num_kv_heads
        # NodeInfo.build; prefill nodes of another model or KV layout are skipped (PrefillPool)
        codec = self.receiver.codec if self.receiver is not None else None
        self.identity = (engine_identity(self.llm, codec.top_k, codec.version, codec.hidden_kind, codec.history_rows)
                         if codec is not None
                         else engine_identity(self.llm, 0))
        for where in placement_info(self.receiver.placements if self.receiver is not None else ()):   # D16
            self.metrics.kv_shard_placement.labels(**where.labels()).set(1)

    @property
    def tokenizer(self):  # a transformers tokenizer
        return self.llm.tokenizer

    async def start(self) -> None:
        """On the serving loop: open the prefill pool's channels (grpc.aio needs the loop)."""
        self.loop = asyncio.get_running_loop()
        if not self.config.colocated:
            cfg = self.config
            affinity = PrefixAffinity(block_tokens=self._page_size) if cfg.prefill_routing == "prefix" else None
            self.pool = PrefillPool(list(cfg.prefill_addresses), affinity, cfg.channel_security, self.identity)
            await self.pool.refresh()
            # one loop per node: a stalled node's timeouts never delay another's answers, which
            # stall detection reads (PrefillNode.last_answer)
            self._refreshers = [asyncio.create_task(self._refresh_loop(n)) for n in self.pool.nodes]
            if self.pool.members.dynamic:   # dns: prefill targets, resolved again (pdserve.serving.discovery)
                self._refreshers.append(asyncio.create_task(self._discover_loop()))
            if cfg.rotate_key_after_s is not None:
                assert self.transport is not None
                if self.transport.closes_connections and self.transport.provider.startswith("tcp"):
                    self._refreshers.append(asyncio.create_task(self._rotate_loop()))
                else:   # shm checks no key; verbs/efa: not measured here (module docstring)
                    logger.warning("--rotate-key-after is ignored on provider %s: only on tcp;ofi_rxm is it measured "
                                   "that a closed key and our ended connections stop every old write (shm checks "
                                   "no key at all); a dead host's quarantines stay held", self.transport.provider)

    def readiness(self) -> str:
        """'' when this node can take requests, else why not (pdserve.serving.node_server's readiness:
        GenerateService NOT_SERVING): no prefill node is reachable and local prefill is not allowed."""
        if self.colocated or self.config.local_prefill_fallback:
            return ""
        if self.pool is None:
            return "the prefill pool is not started"
        if self.pool.usable():
            return ""
        return f"no prefill node is reachable ({self.pool.describe_down() or 'none answered yet'})"

    async def _refresh_loop(self, node: PrefillNode) -> None:
        assert self.pool is not None
        while node in self.pool.nodes:   # a node that left discovery is polled no more
            await asyncio.sleep(POOL_REFRESH_S)
            await self.pool.refresh_node(node)

    async def _discover_loop(self) -> None:
        """Resolve the dns: prefill targets every POOL_REFRESH_S; a node that joins is polled at once,
        then by a refresh loop of its own."""
        assert self.pool is not None
        while True:
            await asyncio.sleep(POOL_REFRESH_S)
            for node in await self.pool.discover():
                await self.pool.refresh_node(node)
                self._refreshers.append(asyncio.create_task(self._refresh_loop(node)))

    async def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE); the in-flight ones go on until the server stops."""
        self.closing = True

    async def close(self) -> None:
        self.closing = True
        for state in list(self.requests.values()):
            if state.transfer is not None and state.transfer.task is not None:
                state.transfer.task.cancel()
        for task in list(self._holds.values()):
            task.cancel()
        self.engine.shutdown()
        for task in self._refreshers:
            task.cancel()
        if self.pool is not None:
            await self.pool.close()
        if self.transport is not None:
            self.transport.close()

    # --- requests (loop) ---------------------------------------------------------------------------

    def begin(self, rid: str) -> RequestState:
        """A Generate handler starts serving `rid`; ValueError if the id is in use here."""
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        state = self.requests[rid] = RequestState(rid)
        return state

    def end(self, state: RequestState) -> None:
        """The handler of `state` is done: stop a transfer whose KV never landed; the state goes
        now, or when its transfer task ends."""
        state.handler_done = True
        t = state.transfer
        if t is not None and t.task is not None and not t.task.done():
            if not t.ready.is_set():
                t.task.cancel()
            return
        self._forget(state)

    def _forget(self, state: RequestState) -> None:
        if self.requests.get(state.request_id) is state:
            del self.requests[state.request_id]

    async def prefill_outcome(self, state: RequestState) -> PrefillOutcome | None:
        """Loop: the successful remote prefill of a request that is finishing, if it had one.

        Its KV landed (so it could decode) but the Prefill response may not be processed yet: wait
        for the transfer task, at most PREFILL_RESPONSE_WAIT_S. A transfer whose KV never landed
        (aborted, failed, prefilled locally) is not waited for."""
        t = state.transfer
        if t is not None and t.task is not None and t.ready.is_set() and not t.task.done():
            done, _ = await asyncio.wait({t.task}, timeout=PREFILL_RESPONSE_WAIT_S)
            if not done:
                logger.warning("request %s: no Prefill response %.0f s after its KV landed; timings and "
                               "cached prompt tokens reported as 0", state.request_id, PREFILL_RESPONSE_WAIT_S)
        outcome, state.outcome = state.outcome, None
        return outcome

    # --- receiver events (engine thread / fabric progress thread) -----------------------------------

    def ticket_ready(self, ticket: TransferTicket, token_ids: tuple[int, ...]) -> None:
        """Engine thread: pages allocated (D3); hand the transfer (one attempt) to the loop."""
        rid = ticket.request_id
        state = self.requests.get(rid)
        if state is not None and not state.admitted:
            state.admitted = time.monotonic()
        assert self.loop is not None
        # the generation of the keys `prepare` just put in the ticket (both on this thread)
        self.loop.call_soon_threadsafe(self._start_transfer, rid, token_ids, ticket, self._key_gen)

    def ticket_refused(self, request_id: str, error: str) -> None:
        self.engine.submit(lambda: self._fail_waiting(request_id, error))

    def kv_landed(self, request_id: str) -> None:
        """(The receiver calls kv_landed_tag; this names the request's current attempt.)"""
        assert self.receiver is not None
        tag = self.receiver.tag_of(request_id)
        if tag is not None:
            self.kv_landed_tag(request_id, tag)

    def kv_landed_tag(self, request_id: str, tag: int) -> None:
        """Fabric progress thread: every write of the attempt with `tag` has landed."""
        if self.config.kv_checksum:   # S7: schedulable only after the verification (_prefill_on)
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._mark_landed, request_id, tag)
            return
        self.engine.submit(lambda: self._kv_ready(request_id, tag))

    def kv_stale_write(self, tag: int, count: int) -> None:
        """Fabric progress thread: writes landed for a tag nothing holds (S5; must stay 0)."""
        self.metrics.kv_stale_writes.inc(count)

    # --- engine thread ----------------------------------------------------------------------------

    def _kv_ready(self, rid: str, tag: int) -> None:
        assert self.receiver is not None and self.loop is not None
        if self.receiver.tag_of(rid) != tag:
            return   # an attempt quarantined meanwhile: its pages are released by its hold
        r = self.llm.get_request(rid)
        waiting = r is not None and r.status is RequestStatus.WAITING_FOR_KV
        try:   # D19: every transfer's record is checked, read before the slot goes
            ctx = self.receiver.context(rid)
        except ContextRecordError as e:
            self.metrics.kv_context_rejected.inc()
            logger.error("request %s (tag %d): context record rejected (%s): %s%s", rid, tag, e.field, e,
                         "; its pages are freed unused" if waiting else "")
            if waiting:   # the loop fails the attempt (_checksum_failed_attempt): re-prefill or fail
                self.loop.call_soon_threadsafe(self._context_rejected, rid, tag, f"context record rejected: {e}")
                return
            ctx = None    # aborted meanwhile: nothing decodes from it, its pages are released below
        spec = self.llm.speculator
        # a draft head starts from the prefill node's hidden state (D17)
        hidden = ctx.hidden if ctx is not None and spec is not None and spec.uses_hidden else None
        history = ctx.history if hidden is not None else None   # and its history rows write the head's (E20)
        self.receiver.finish(rid)
        if waiting:
            self.llm.kv_ready(rid, context_hidden=hidden, context_history=history)
        elif self.llm.is_held(rid):
            self.llm.release_blocks(rid)  # aborted while its KV was landing: now nothing can land
        self.loop.call_soon_threadsafe(self._mark_ready, rid)

    def _checksum_failed(self, rid: str, tag: int, retry: bool, error: str) -> None:
        """Engine thread: the attempt with `tag` landed completely but its bytes do not match (S7),
        or its context record was rejected (D19).
        Nothing more can land, so its pages are freed now, unused: kv_ready is never called for
        them, so they never join the prefix cache. Re-admitted into fresh pages (retry) or failed."""
        assert self.receiver is not None
        if self.receiver.tag_of(rid) != tag:
            return   # quarantined meanwhile (the client went away): its hold releases the pages
        r = self.llm.get_request(rid)
        if retry and r is not None and r.status is RequestStatus.WAITING_FOR_KV:
            self.receiver.finish(rid)   # tag tombstoned, slot freed
            self.llm.kv_retry(rid)      # frees the pages (uncommitted: no prefix-cache entry), a new attempt
            return
        self._fail_waiting(rid, error)

    def _fail_waiting(self, rid: str, error: str) -> None:
        """Engine thread: end a waiting request with an error and free its pages (no write of it
        can land: it was never sent, or its sender provably stopped)."""
        assert self.receiver is not None
        self.receiver.abandon(rid)
        out = self.llm.kv_abandoned(rid, prefill_locally=False, error=error)
        if out is not None:
            self.engine.deliver(out)
        if self.llm.is_held(rid):
            self.llm.release_blocks(rid)

    def _abandoned(self, rid: str, error: str, locally: bool) -> None:
        """Engine thread: no prefill node is left for this attempt, which was sent nowhere (its
        pages are safe): prefill here, or fail."""
        assert self.receiver is not None
        r = self.llm.get_request(rid)
        if r is not None and r.status is RequestStatus.WAITING_FOR_KV and locally:
            self.receiver.abandon(rid)
            self.llm.kv_abandoned(rid, prefill_locally=True, error=error)
            return
        self._fail_waiting(rid, error)

    def _quarantine_attempt(self, q: Quarantine, retry: bool, error: str) -> None:
        """Engine thread: an attempt whose writes may still land. Its tag and pages go to
        quarantine (S5); the request is admitted again into fresh pages for a new attempt
        (retry) or ends with `error`; the hold runs on the loop."""
        assert self.receiver is not None and self.loop is not None
        rid = q.request_id
        q.tag = self.receiver.quarantine(rid)
        r = self.llm.get_request(rid)
        waiting = r is not None and r.status is RequestStatus.WAITING_FOR_KV
        if waiting and not retry:
            out = self.llm.kv_abandoned(rid, prefill_locally=False, error=error)   # keeps the pages held
            if out is not None:
                self.engine.deliver(out)
        try:
            q.blocks = self.llm.quarantine_blocks(rid, q.quarantine_id)
        except KeyError:   # the request ended and its pages were released (its KV had landed)
            q.blocks = -1
        if waiting and retry:
            self.llm.kv_retry(rid)   # fresh pages, a new KvWait -> ticket_ready -> a new attempt
        if q.tag is None and q.blocks < 0:
            return
        self.loop.call_soon_threadsafe(self._start_hold, q)

    def _release_quarantine(self, q: Quarantine) -> None:
        """Engine thread: the prefill side has provably stopped writing into q's pages."""
        assert self.receiver is not None
        if q.blocks >= 0:
            self.llm.release_quarantine(q.quarantine_id)
        if q.tag is not None:
            self.receiver.release_quarantined(q.tag)

    # --- the loop: transfers ---------------------------------------------------------------------

    def _start_transfer(self, rid: str, tokens: tuple[int, ...], ticket: TransferTicket, key_gen: int) -> None:
        t = Transfer(tokens, attempt=ticket.attempt, tag=ticket.imm_tag, key_gen=key_gen)
        state = self.requests.get(rid)
        if state is None:   # its handler is gone already: the transfer still runs, to end safely
            state = self.requests[rid] = RequestState(rid, handler_done=True)
        state.transfer = t
        t.task = asyncio.create_task(self._run_transfer(state, ticket))
        t.task.add_done_callback(lambda _task: self._transfer_task_done(state, t))

    def _transfer_task_done(self, state: RequestState, t: Transfer) -> None:
        """Loop: a transfer task cancelled before its first step ran none of _run_transfer, clean-up
        included: the attempt was sent nowhere (nothing can land), so its tag, slot and pages go now."""
        if t.started:
            return
        rid = state.request_id
        self.engine.submit(lambda: self._fail_waiting(rid, f"request {rid} cancelled"))
        if state.handler_done and state.transfer is t:
            self._forget(state)

    def _mark_landed(self, rid: str, tag: int) -> None:
        state = self.requests.get(rid)
        t = state.transfer if state is not None else None
        if t is not None and t.tag == tag:
            t.landed.set()

    def _checksum_failed_attempt(self, state: RequestState, ticket: TransferTicket, node: PrefillNode,
                                 err: str) -> None:
        """Loop: an attempt failed its verification (S7); its count completed, so no hold."""
        rid, tag = state.request_id, ticket.imm_tag
        state.errors.append(f"{node.address}: {err}")
        state.checksum_failures += 1
        if state.checksum_failures <= CHECKSUM_RETRIES_SAME_NODE:
            state.tried.discard(node.address)   # corruption may be the path's, not the node's: once more
        retry = not state.handler_done
        msg = f"prefill on {node.address} failed ({err})"
        logger.warning("request %s attempt %d: %s; its pages are freed unused%s", rid, ticket.attempt, msg,
                       ", retrying in fresh pages" if retry else "")
        self.engine.submit(lambda: self._checksum_failed(rid, tag, retry, msg))

    async def _verify(self, state: RequestState, ticket: TransferTicket, resp, node: PrefillNode) -> str:
        """S7: '' when what landed matches the sender's checksums, else why not (logged, counted)."""
        assert self.receiver is not None
        rid = state.request_id
        try:
            res = await asyncio.to_thread(self.receiver.verify, rid, ticket.imm_tag, resp.kv_checksums,
                                          resp.num_kv_checksums)
        except (KeyError, ValueError) as e:
            self.metrics.kv_checksum_failures.inc()
            logger.error("request %s attempt %d: KV checksums from %s unusable: %s", rid, ticket.attempt,
                         node.address, e)
            return f"KV checksums unusable: {e}"
        self.metrics.kv_checksums_verified.inc()
        if res.ok:
            logger.debug("request %s attempt %d: %d KV checksums match", rid, ticket.attempt, res.runs)
            return ""
        self.metrics.kv_checksum_failures.inc()
        assert res.mismatch is not None
        logger.error("request %s attempt %d: KV checksum mismatch on the transfer from %s: %s", rid,
                     ticket.attempt, node.address, res.mismatch.describe())
        return f"KV checksum mismatch: {res.mismatch.describe()}"

    def _context_rejected(self, rid: str, tag: int, why: str) -> None:
        """Loop: the attempt with `tag` landed but its context record was rejected (D19): mark it
        corrupt and wake its _prefill_on at once (its pages are freed by _checksum_failed_attempt)."""
        state = self.requests.get(rid)
        t = state.transfer if state is not None else None
        if t is not None and t.tag == tag:
            t.corrupt, t.rejected = True, why
            t.ready_time = time.monotonic()
            t.ready.set()

    def _mark_ready(self, rid: str) -> None:
        state = self.requests.get(rid)
        t = state.transfer if state is not None else None
        if t is not None:
            t.ready_time = time.monotonic()
            t.ready.set()

    async def _run_transfer(self, state: RequestState, ticket: TransferTicket) -> None:
        """One attempt: choose a prefill node the request has not tried, prefill there; on failure
        quarantine the attempt and let the request be admitted again (a new attempt)."""
        bind_request_id(state.request_id)  # this task serves one request's transfer
        assert self.pool is not None and state.transfer is not None
        t, rid = state.transfer, state.request_id
        t.started = True
        try:
            node = self.pool.choose(exclude=state.tried, token_ids=list(t.token_ids))
            wait = self.pool.retry_in(exclude=state.tried) if node is None else None
            if wait is not None:   # only a node marked down is left: wait for its retry (RETRY_DOWN_AFTER_S)
                await asyncio.sleep(wait + 0.01)
                node = self.pool.choose(exclude=state.tried, token_ids=list(t.token_ids))
            if node is None:
                why = "; ".join(state.errors) or self.pool.describe_down() or "no prefill node configured"
                msg = f"no prefill node could prefill request {rid}: {why}"
                logger.warning(msg)
                self.engine.submit(lambda: self._abandoned(rid, msg, self.config.local_prefill_fallback))
                return
            assert node.peer is not None   # choose() offers only nodes whose fabric engine we know
            try:   # the write count follows from that node's TP split into ours (D14)
                ticket = self.receiver.address(ticket, node.tp_size, prefill_engine=node.peer.engine_id)
            except ValueError as e:
                msg = f"request {rid} cannot be prefilled on {node.address} (tp_size {node.tp_size}): {e}"
                logger.warning(msg)
                self.engine.submit(lambda: self._abandoned(rid, msg, self.config.local_prefill_fallback))
                return
            state.tried.add(node.address)
            t.node, t.prefill_engine_id = node, node.peer.engine_id
            state.prefilled_on = node.address
            ok, err = await self._prefill_on(node, state, ticket)
            if ok:   # a later attempt (a preempted request prefilled again) may use this node again
                state.tried.discard(node.address)
                return
            if t.corrupt:   # S7: landed but wrong; nothing more can land, so no quarantine
                self._checksum_failed_attempt(state, ticket, node, err)
                return
            if t.rotated:   # not the node's fault: it may take the next attempt
                state.tried.discard(node.address)
            state.errors.append(f"{node.address}: {err}")
            msg = f"prefill on {node.address} failed ({err})"
            logger.warning("request %s attempt %d: %s; its pages are quarantined%s", rid, ticket.attempt, msg,
                           "" if state.handler_done else ", retrying in fresh pages")
            self._quarantine(state, t, ticket, node, retry=not state.handler_done, error=msg)
        except asyncio.CancelledError:
            # The client went away: the attempt's pages stay quarantined until nothing can land.
            if t.node is not None and not t.ready.is_set():
                self._quarantine(state, t, ticket, t.node, retry=False, error=f"request {rid} cancelled")
            elif t.rejected:   # landed with a rejected record: nothing more can land, its pages go now
                why, tag = t.rejected, ticket.imm_tag
                self.engine.submit(lambda: self._checksum_failed(rid, tag, False, why))
            elif t.node is None:   # cancelled before it was sent anywhere: nothing can land
                self.engine.submit(lambda: self._fail_waiting(rid, f"request {rid} cancelled"))
            raise
        finally:
            if state.handler_done and state.transfer is t:
                self._forget(state)

    def _quarantine(self, state: RequestState, t: Transfer, ticket: TransferTicket, node: PrefillNode,
                    retry: bool, error: str) -> None:
        assert self.transport is not None
        q = Quarantine(request_id=state.request_id, attempt=ticket.attempt,
                       quarantine_id=f"{state.request_id}#{ticket.attempt}", node=node,
                       decode_engine_id=self.transport.engine_id, prefill_engine_id=t.prefill_engine_id,
                       peer=node.peer, since=time.monotonic(), key_gen=t.key_gen)
        self.engine.submit(lambda: self._quarantine_attempt(q, retry, error))

    async def _prefill_on(self, node: PrefillNode, state: RequestState, ticket: TransferTicket) -> tuple[bool, str]:
        """One Prefill call, watched for progress: True once the KV landed; False with the reason
        when it failed, its deadline passed, or it stalled (no write landed and the node answered no
        GetNodeInfo for `stall_s`)."""
        assert self.transport is not None and self.receiver is not None and state.transfer is not None
        t = state.transfer
        timeout = self.config.prefill_timeout_s
        req = ticket.to_pb(list(t.token_ids), self.transport.peer_descriptor, "", timeout)
        req.decode_node_id = self.config.node_id   # under mTLS, checked against our certificate (S9)
        self._test_bad_shard_key(req, ticket)
        if t.key_gen < self._key_gen:   # prepared before a rotation: its keys are closed, never sent
            t.rotated = True
            return False, "its memory key was rotated before it was sent"
        node.sent_tokens += len(t.token_ids)
        call_start = time.monotonic()
        call = asyncio.ensure_future(node.prefill.Prefill(req, timeout=timeout))
        try:
            landed, progress = 0, call_start
            while True:
                done, _ = await asyncio.wait({call}, timeout=STALL_POLL_S)
                if done:
                    break
                now = time.monotonic()
                n = self.receiver.landed(state.request_id)
                if n != landed or t.ready.is_set() or t.landed.is_set():
                    landed, progress = n, now
                if t.key_gen < self._key_gen and not t.ready.is_set():
                    call.cancel()   # its writes are refused from now on: fail over at once
                    t.rotated = True
                    return False, "this node's memory key was rotated (a prefill host stopped answering)"
                if now - max(progress, node.last_answer) > self.config.stall_s:
                    call.cancel()
                    self.pool.mark_down(node, f"stalled: no write landed and no GetNodeInfo answer for "
                                              f"{self.config.stall_s:g} s")
                    return False, f"stalled for {self.config.stall_s:g} s (no write landed, no health answer)"
            resp = call.result()
            if ticket.kv_checksum:   # S7: schedulable only once what landed matches what was sent
                await asyncio.wait_for(t.landed.wait(), timeout=KV_LANDED_WAIT_S)
                bad = await self._verify(state, ticket, resp, node)
                if bad:
                    t.corrupt = True
                    return False, bad
                rid, tag = state.request_id, ticket.imm_tag
                self.engine.submit(lambda: self._kv_ready(rid, tag))
            await asyncio.wait_for(t.ready.wait(), timeout=KV_LANDED_WAIT_S)  # writes delivered: the count follows
            if t.rejected:   # D19: landed, but its context record is not this attempt's
                return False, t.rejected
            # Prefill-side time from receipt to the last layer done; the rest until the count
            # completed here is the transfer tail (loopback RPC latency included).
            prefill_s = resp.timings.queue_time_s + resp.timings.compute_time_s
            state.outcome = PrefillOutcome(call_start, prefill_s, t.ready_time - call_start - prefill_s,
                                           resp.prefill_cached_tokens)
            self.metrics.kv_transfer_bytes.labels(model_name=self.model_name, side="decode").inc(resp.bytes_written)
            self.metrics.kv_transfer_seconds.labels(model_name=self.model_name, side="decode").observe(
                t.ready_time - call_start)
            return True, ""
        except grpc.aio.AioRpcError as e:
            if t.ready.is_set():
                return (False, t.rejected) if t.rejected else (True, "")
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                assert self.pool is not None
                self.pool.mark_down(node, e.details() or "unavailable")
            return False, f"{e.code().name}: {e.details()}"
        except asyncio.TimeoutError:
            return False, f"Prefill returned but the write count did not complete within {KV_LANDED_WAIT_S:.0f} s"
        finally:
            if not call.done():
                call.cancel()
            node.sent_tokens -= len(t.token_ids)

    def _test_bad_shard_key(self, req: prefill_pb2.PrefillRequest, ticket: TransferTicket) -> None:
        """TEST ONLY (FaultPlan.bad_shard_key): name one decode rank's pool under a key nothing
        registered, so that (tcp;ofi_rxm: the target checks keys) that rank's writes are refused
        while the other ranks' land: one shard of the transfer fails mid-way. No effect without a plan."""
        for rank in self.config.faults.bad_key_ranks(ticket.request_id, ticket.attempt):
            if rank >= len(req.kv_memory):
                raise ValueError(f"{TEST_BAD_SHARD_KEY_ENV}: rank {rank}, but this node has "
                                 f"{len(req.kv_memory)} KV ranks")
            good = ticket.rank_kv(rank)
            req.kv_memory[rank].descriptor = remote_to_bytes(dataclasses.replace(good, key=good.key ^ 0x5A5A5A))
            logger.warning("TEST ONLY (%s): request %s attempt %d: decode rank %d's pool sent under a wrong key",
                           TEST_BAD_SHARD_KEY_ENV, ticket.request_id, ticket.attempt, rank)

    # --- the loop: quarantine holds ----------------------------------------------------------------

    def _start_hold(self, q: Quarantine) -> None:
        task = asyncio.create_task(self._hold(q), name=f"hold-{q.quarantine_id}")
        self._holds[q.quarantine_id] = task
        self._held[q.quarantine_id] = q
        task.add_done_callback(lambda _t, q=q: self._end_hold(q))

    def _end_hold(self, q: Quarantine) -> None:
        self._holds.pop(q.quarantine_id, None)
        self._held.pop(q.quarantine_id, None)
        self._show_quarantine_age(q.node.address)

    def _show_quarantine_age(self, address: str) -> None:
        """pdserve:kv_quarantine_oldest_seconds{peer=address}: the oldest hold's age (as of a
        hold's latest round), the label removed when that prefill node has none."""
        now = time.monotonic()
        ages = [now - q.since for q in self._held.values() if q.node.address == address]
        gauge = self.metrics.kv_quarantine_oldest
        if ages:
            gauge.labels(peer=address).set(max(ages))
            self._aged.add(address)
        elif address in self._aged:
            gauge.remove(address)
            self._aged.discard(address)

    async def _hold(self, q: Quarantine) -> None:
        """Keep q's pages in quarantine until the prefill side has provably stopped: its process
        confirmed the abort and the fence landed, or its endpoint is gone. AbortPrefill is re-sent
        with backoff (HOLD_BACKOFF_S doubling to HOLD_BACKOFF_MAX_S); no thread is parked."""
        bind_request_id(q.request_id)
        delay = HOLD_BACKOFF_S
        q.node.holds += 1   # keeps the node's channel open should discovery retire it meanwhile
        try:
            while True:
                if self._key_dead(q):
                    how = "its memory key was rotated (closed, every connection open then ended)"
                    break
                try:
                    answer = await self._abort_confirmed(q)
                except Exception as e:   # never let the hold die: its pages would stay quarantined unseen
                    logger.error("request %s attempt %d: AbortPrefill round on %s failed (%s: %s); retrying in "
                                 "%.2f s", q.request_id, q.attempt, q.node.address, type(e).__name__, e, delay)
                    answer = ABORT_NOT_YET
                if answer == ABORT_CONFIRMED:
                    how = "abort confirmed"
                    break
                if answer == ABORT_ENDED_UNFENCED:
                    q.ended_unfenced = True   # terminal there: with --rotate-key-after a rotation may release it
                if answer == ABORT_ENDED_UNFENCED and self._can_close(q):
                    await self._close_prefill_connection(q, q.closes_at_answer)
                    how = "its key ended on the prefill node, unfenced; our connection to it closed"
                    break
                if q.peer is not None and self.transport is not None and self.transport.peer_gone(q.peer):
                    await self._drain_arrivals()
                    how = "prefill endpoint gone"
                    break
                q.rounds += 1
                self._show_quarantine_age(q.node.address)
                if q.rounds == 1 or time.monotonic() - q.logged >= QUARANTINE_LOG_S:
                    q.logged = time.monotonic()
                    logger.warning("request %s attempt %d: %d pages quarantined for %.1f s; prefill node %s has not "
                                   "confirmed its abort (round %d)", q.request_id, q.attempt, max(q.blocks, 0),
                                   time.monotonic() - q.since, q.node.address, q.rounds)
                if await self._peer_gone_within(q, delay):
                    if self._key_dead(q):
                        continue   # said at the top of the loop
                    await self._drain_arrivals()
                    how = "prefill endpoint gone"
                    break
                delay = min(2 * delay, HOLD_BACKOFF_MAX_S)
        except asyncio.CancelledError:
            logger.info("request %s attempt %d: hold cancelled (node closing); %d pages stay quarantined",
                        q.request_id, q.attempt, max(q.blocks, 0))
            raise
        finally:
            q.node.holds -= 1
        logger.info("request %s attempt %d: %s after %.2f s; %d quarantined pages released", q.request_id,
                    q.attempt, how, time.monotonic() - q.since, max(q.blocks, 0))
        self.engine.submit(lambda: self._release_quarantine(q))

    async def _peer_gone_within(self, q: Quarantine, seconds: float) -> bool:
        """Sleep `seconds`, looking every HOLD_POLL_S whether the prefill endpoint is gone (or q's
        memory key was rotated)."""
        assert self.transport is not None
        end = time.monotonic() + seconds
        while True:
            if q.peer is not None and self.transport.peer_gone(q.peer) or self._key_dead(q):
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(HOLD_POLL_S, left))

    async def _drain_arrivals(self) -> None:
        """After a peer is judged gone: let the progress thread handle what it had already sent
        (a short grace for bytes in our socket buffers, then two full progress rounds, at most
        DRAIN_WAIT_S), polled on the loop."""
        assert self.transport is not None
        await asyncio.sleep(DRAIN_GRACE_S)
        mark = self.transport.progress_mark()
        end = time.monotonic() + DRAIN_WAIT_S
        while not self.transport.progressed(mark) and time.monotonic() < end:
            await asyncio.sleep(0.002)

    # --- the loop: key rotation (--rotate-key-after) -------------------------------------------------

    def _key_dead(self, q: Quarantine) -> bool:
        """No write under the keys q's attempt was sent can land any more (a rotation finished)."""
        return q.key_gen < self._keys_dead_below

    def _rotation_due(self) -> list[Quarantine]:
        """The holds that ask for a rotation: older than rotate_key_after_s, their keys still live
        (or a rotation left unfinished), and either their prefill node unanswering for stall_s (a
        silent death) or their abort ended there unfenced (a fabric-only partition, heavy loss: the
        node answers, but no fence can prove delivery). One rotation releases them all: every hold
        of an older generation is released by it, not only the ones that asked."""
        after = self.config.rotate_key_after_s
        assert after is not None
        now = time.monotonic()
        return [q for q in self._held.values()
                if not self._key_dead(q) and now - q.since >= after
                and (q.ended_unfenced or now - q.node.last_answer > self.config.stall_s)]

    async def _rotate_loop(self) -> None:
        """One rotation at a time (awaited here, never started twice): a hold that asks while
        one is under way is released by it or, if it was prepared under the new key, asks the
        next round."""
        while True:
            await asyncio.sleep(ROTATE_POLL_S)
            due = self._rotation_due()
            if not due:
                continue
            try:
                await self._rotate_keys(due)
            except Exception as e:   # never let the loop die: the holds would stay unanswered unseen
                logger.error("KV key rotation for %d holds (request %s attempt %d first) failed (%s: %s); retrying in "
                             "%.1f s", len(due), due[0].request_id, due[0].attempt, type(e).__name__, e,
                             ROTATE_POLL_S)

    def _swap_keys(self) -> tuple:
        """Engine thread (where tickets are prepared): new registrations, the next generation."""
        assert self.receiver is not None
        old = self.receiver.rotate_keys()
        self._key_gen += 1
        return old

    async def _rotate_keys(self, due: list[Quarantine]) -> None:
        """Make every write under the keys up to now unable to land (module docstring): register
        the pool again (new tickets name it), fail over the transfers in flight under the old keys,
        close the old registrations (the target refuses a write under a closed key as it arrives),
        then end every fabric connection open now (a write whose key was checked before the close
        may still be copying) and drain; then every hold of those generations is released."""
        assert self.transport is not None and self.pool is not None
        if self._key_gen == self._keys_dead_below:   # else a rotation is unfinished: finish it
            self._retired_regions.extend(await self.engine.call(self._swap_keys))
            now = time.monotonic()
            why = "; ".join(f"request {q.request_id} attempt {q.attempt} quarantined {now - q.since:.1f} s, prefill "
                            f"node {q.node.address} " + ("ended it unfenced" if q.ended_unfenced else "answers nothing")
                            for q in due[:4]) + (f"; and {len(due) - 4} more" if len(due) > 4 else "")
            logger.warning("rotating the KV memory key (generation %d) for %d holds (%s); every transfer in flight "
                           "under the old key fails over", self._key_gen, len(due), why)
        target = self._key_gen
        while self._retired_regions:
            await asyncio.to_thread(self.transport.deregister, self._retired_regions[0])   # fi_close
            self._retired_regions.pop(0)
        own = {e for e in (endpoint_of(r.peer.address) for r in self.transport.rails) if e is not None}
        peers = {e for e in (endpoint_of(n.peer.address) for n in self.pool.nodes if n.peer is not None)
                 if e is not None}
        socks = await asyncio.to_thread(fabric_sockets, own, peers)
        inodes = await asyncio.to_thread(shut_down, socks)
        end = time.monotonic() + ROTATE_CLOSE_WAIT_S
        while left := open_inodes(inodes):
            if time.monotonic() > end:
                logger.warning("KV key rotation: %d of %d fabric sockets still open %.0f s after their shutdown; "
                               "retrying", len(left), len(inodes), ROTATE_CLOSE_WAIT_S)
                return
            await asyncio.sleep(0.01)
        await self._drain_arrivals()
        self._keys_dead_below = target
        self.metrics.kv_key_rotations.inc()
        logger.warning("KV memory key rotated (generation %d): old registrations closed, %d fabric connections "
                       "ended; the quarantines held under the old keys are released", target, len(inodes))

    def _can_close(self, q: Quarantine) -> bool:
        """Closing our connection to q's prefill node refuses what it still sends (ofi_rxm)."""
        return (self.config.release_unfenced_by_close and q.peer is not None and self.transport is not None
                and self.transport.closes_connections)

    async def _close_prefill_connection(self, q: Quarantine, closes_before: int) -> None:
        """Make sure a close of our connections to q's prefill endpoint began after its terminal
        answer (`closes_before`: the closes begun when that answer arrived), then drain what the
        progress thread had already read. Holds whose answers came before one close
        share it (one lock per prefill engine, a count of closes begun)."""
        assert self.transport is not None and q.peer is not None
        eid = q.prefill_engine_id
        lock = self._close_locks.setdefault(eid, asyncio.Lock())
        async with lock:
            begun = self._conn_closes.get(eid, 0)
            if begun > closes_before:
                return   # one began after our answer and has ended (we hold its lock)
            self._conn_closes[eid] = begun + 1
            logger.warning("closing our fabric connection to prefill engine %s (%s): request %s attempt %d ended "
                           "there unfenced; its other transfers in flight fail over (close %d)", eid[:8],
                           q.node.address, q.request_id, q.attempt, begun + 1)
            await asyncio.to_thread(self.transport.close_connection, q.peer)
            await self._drain_arrivals()

    async def _abort_confirmed(self, q: Quarantine) -> str:
        """One AbortPrefill, bound to the prefill engine the attempt was sent to, with a delivery
        fence: ABORT_CONFIRMED once that process confirmed and (when it posted one) the fence
        landed here; ABORT_ENDED_UNFENCED when it says the key is terminal but no fence proved
        delivery (CONNECTION_FAILED, FINISHED unconfirmed, a fence that did not land in
        FENCE_WAIT_S, or a fence where this endpoint's writes are not ordered); else ABORT_NOT_YET."""
        assert self.receiver is not None and self.loop is not None
        loop = self.loop
        fenced = asyncio.Event()
        tag, region = self.receiver.expect_fence(lambda: loop.call_soon_threadsafe(fenced.set),
                                                 writer=q.prefill_engine_id or None)
        try:
            req = prefill_pb2.AbortPrefillRequest(
                request_id=q.request_id, decode_engine_id=q.decode_engine_id, attempt=q.attempt,
                prefill_engine_id=q.prefill_engine_id, fence_tag=tag, fence_region=remote_to_bytes(region))
            call = asyncio.ensure_future(q.node.prefill.AbortPrefill(req, timeout=ABORT_RPC_TIMEOUT_S))
            while not call.done():   # a dead endpoint ends the wait at once
                await asyncio.wait({call}, timeout=HOLD_POLL_S)
                if not call.done() and (q.peer is not None and self.transport is not None
                                        and self.transport.peer_gone(q.peer) or self._key_dead(q)):
                    call.cancel()
                    return ABORT_NOT_YET
            try:
                resp = call.result()
                # no await since the answer came: a close counted later began after it
                q.closes_at_answer = self._conn_closes.get(q.prefill_engine_id, 0)
            except grpc.aio.AioRpcError as e:
                logger.info("AbortPrefill of %s attempt %d on %s failed: %s", q.request_id, q.attempt,
                            q.node.address, e.code().name)
                return ABORT_NOT_YET
            state = prefill_pb2.TransferState.Name(resp.state)
            if resp.prefill_engine_id != q.prefill_engine_id:
                logger.info("AbortPrefill of %s attempt %d on %s: answered by engine %s, not %s (state %s)",
                            q.request_id, q.attempt, q.node.address, resp.prefill_engine_id[:8],
                            q.prefill_engine_id[:8], state)
                return ABORT_NOT_YET
            if not resp.confirmed:
                logger.info("AbortPrefill of %s attempt %d on %s: not confirmed (state %s)", q.request_id,
                            q.attempt, q.node.address, state)
                return ABORT_ENDED_UNFENCED if resp.state in TERMINAL_STATES else ABORT_NOT_YET
            if not resp.fence_posted:
                return ABORT_CONFIRMED
            if self.transport is None or not self.transport.writes_ordered:
                return ABORT_ENDED_UNFENCED   # a fence proves nothing here: writes are not ordered
            try:
                await asyncio.wait_for(fenced.wait(), FENCE_WAIT_S)
                return ABORT_CONFIRMED
            except TimeoutError:
                logger.warning("AbortPrefill of %s attempt %d: confirmed, but its fence did not land within %.0f s",
                               q.request_id, q.attempt, FENCE_WAIT_S)
                return ABORT_ENDED_UNFENCED
        except asyncio.CancelledError:
            raise
        finally:
            self.receiver.retire_fence(tag)

    def transfer_info(self) -> node_pb2.TransferInfo:
        """What this node still tracks of its transfers (any thread: counts read as they are)."""
        if self.receiver is None:
            return node_pb2.TransferInfo(held_requests=self.llm.num_held_requests)
        return node_pb2.TransferInfo(
            quarantined_kv_blocks=self.llm.num_quarantined_blocks, quarantined_transfers=self.llm.num_quarantines,
            tags_in_use=self.receiver.num_tags_in_use, context_slots_in_use=self.receiver.num_slots_in_use,
            stale_writes=self.receiver.stale_writes, held_requests=self.llm.num_held_requests)

    # --- load ---------------------------------------------------------------------------------

    def node_info(self) -> node_pb2.NodeInfo:
        """This node's identity and load for the router (any thread: reads EngineThread.last_load)."""
        info, load = self.llm.info(), self.engine.last_load
        role = node_pb2.NODE_ROLE_COLOCATED if self.colocated else node_pb2.NODE_ROLE_DECODE
        return node_pb2.NodeInfo(
            node_id=self.node_id, role=role, model=info.model_name,
            sharding=common_pb2.ShardingScheme(tp_size=self.tp_size, kv_heads_per_rank=self.kv_heads_per_rank,
                                               total_kv_heads=info.num_kv_heads),
            load=common_pb2.NodeLoad(
                outstanding_requests=load.num_unfinished,
                outstanding_tokens=load.prompt_tokens_left + load.output_tokens_left,
                waiting_requests=load.num_waiting, running_requests=load.num_running,
                free_kv_blocks=load.free_blocks, total_kv_blocks=load.total_blocks,
                page_size=info.page_size),
            num_layers=info.num_layers, max_context_length=info.max_model_len,
            fabric_peer=peer_to_bytes(self.transport.peer_descriptor) if self.transport is not None else b"",
            transfers=self.transfer_info(), build=self.identity.to_pb(),
        )
