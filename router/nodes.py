"""The router's view of its decode nodes: health, load, and the choice of a node (R3).

Everything here runs on the router's one asyncio event loop; nothing is shared with other threads.

    pool = NodePool(config)           # the routing policy: RoutingConfig, see router/policy.py
    await pool.start()                # channels, one poll round, then the poller task
    node, route = pool.route(request) # the policy's choice among healthy nodes, or UnavailableError
    node.begin(request_id, work) ... node.end(request_id)
    await pool.close()

Tasks: `NodePool._poll_forever` (one task) polls every node each `health_interval_s`: a
grpc.health.v1 Check of the node's readiness (READINESS_SERVICE, GenerateService: a decode node
reports it NOT_SERVING while it cannot take work, e.g. no prefill node answered it yet, while its
whole server "" stays SERVING; a stopping or dead node reports both), then NodeService.GetNodeInfo
for its load. A node
whose Check fails or answers anything but SERVING (a Check that misses its deadline only after
`health_misses` in a row: a busy node answers late now and then), or whose GetNodeInfo answers an
error other than a missed deadline, leaves the rotation; it comes back at the first poll that succeeds. A call that
finds a node unreachable takes it out at once (`mark_failed`). A node that leaves the rotation is
forgotten by the routing policy (a restarted node has lost its prefix cache), and every stream on it
is told (`DecodeNode.watchers`), so that router.service moves those requests to another node (S10).

Model skew: a node whose NodeInfo.model is not the model most polled nodes serve (ties: the one of
the first configured node among them) leaves the rotation, with the reason naming both models (a
decode node that restarted with another model never gets the others' requests); it comes back once
it serves the others' model again. That serving model is computed once per change of a node's vote
(its model, or whether it counts: healthy or out only for its model) or of the node list, not per
request or per poll.

Load: a node's outstanding work is the larger of the router's own count (prompt + max tokens of the
requests it has in flight there, estimated without a tokenizer) and the node's last reported
`NodeLoad.outstanding_tokens` (which also counts work other routers sent). The policy sees it as
`Candidate.load`; ties go to fewer requests in flight, then round-robin (`Candidate.rank`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.serving.channels import ChannelSecurity, open_channel
from pdserve.serving.convert import Prompt
from pdserve.serving.discovery import Membership, Resolver
from pdserve.serving.metrics import router_metrics
from pdserve.serving.prefix_index import Candidate
from pdserve_api.servers import UnavailableError
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc, node_pb2, node_pb2_grpc
from router.config import RouterConfig
from router.policy import Route, RoutingConfig, RoutingPolicy, make_policy

# The health service whose status says a decode node takes requests (pdserve.serving.node_server).
READINESS_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name

logger = logging.getLogger(__name__)

# Reconnect quickly to a node that restarts on the same port (gRPC's default backoff reaches 120 s).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)

_OTHER_MODEL = "serves model "   # the start of a model-skew reason (DecodeNode.reason)
_CHARS_PER_TOKEN = 4  # prompt-length estimate for text prompts (the router has no tokenizer)
_TOKENS_PER_CHAT_TURN = 8  # role markers a chat template adds per message, roughly


def estimate_work(request: generate_pb2.GenerateRequest, default_max_tokens: int) -> int:
    """Tokens a request will cost a decode node: its prompt (estimated for text) plus max_tokens."""
    p = Prompt.from_pb(request) if request.WhichOneof("prompt") else Prompt(text="")
    if p.token_ids is not None:
        prompt = len(p.token_ids)
    elif p.messages is not None:
        prompt = sum(len(m.content) for m in p.messages) // _CHARS_PER_TOKEN + _TOKENS_PER_CHAT_TURN * len(p.messages)
    else:
        prompt = len(p.text or "") // _CHARS_PER_TOKEN + 1
    sampling = request.sampling
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else default_max_tokens
    return prompt + max_tokens


@dataclass
class DecodeNode:
    """One decode node as the router sees it. Stubs exist between `NodePool.start` and `close`."""

    address: str
    index: int
    healthy: bool = False
    reason: str = "not polled yet"  # why it is out of rotation (empty when healthy)
    missed: int = 0                 # health Checks in a row that timed out (RouterConfig.health_misses)
    info: node_pb2.NodeInfo | None = None  # the last GetNodeInfo answer
    inflight: dict[str, int] = field(default_factory=dict)  # request id -> estimated tokens
    # Called (once each) when the node leaves the rotation: the streams on it move elsewhere (S10).
    watchers: set[Callable[[], None]] = field(default_factory=set)
    channel: grpc.aio.Channel | None = None
    generate: generate_pb2_grpc.GenerateServiceStub | None = None
    node: node_pb2_grpc.NodeServiceStub | None = None
    health: health_pb2_grpc.HealthStub | None = None

    @property
    def node_id(self) -> str:
        return self.info.node_id if self.info is not None and self.info.node_id else self.address

    @property
    def outstanding_tokens(self) -> int:
        own = sum(self.inflight.values())
        reported = self.info.load.outstanding_tokens if self.info is not None else 0
        return max(own, reported)

    def begin(self, request_id: str, work: int) -> None:
        self.inflight[request_id] = work

    def end(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)

    def open(self, security: ChannelSecurity) -> None:
        self.channel = open_channel(self.address, security, options=CHANNEL_OPTIONS)  # TLS / token, keepalive
        self.generate = generate_pb2_grpc.GenerateServiceStub(self.channel)
        self.node = node_pb2_grpc.NodeServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


class NodePool:
    """The decode nodes, their health and load; `route` asks the routing policy where a request goes."""

    def __init__(self, config: RouterConfig,
                 on_health_change: Callable[[bool], object] | None = None,
                 routing: RoutingConfig | None = None, resolver: Resolver | None = None) -> None:
        self._config = config
        # Static addresses now; dns:NAME:PORT entries resolved at each poll round (pdserve.serving.discovery).
        self.members = Membership(config.decode_nodes, resolver)
        self.nodes = [DecodeNode(address, i) for i, address in enumerate(self.members.static)]
        self._retired: list[DecodeNode] = []   # left discovery; channel closed once nothing is in flight there
        # The policy: `routing` if given, else RouterConfig.routing.
        self.policy: RoutingPolicy = make_policy(routing or config.routing)
        self._on_health_change = on_health_change
        self._by_address = {n.address: n for n in self.nodes}
        self._turn = 0
        self._task: asyncio.Task[None] | None = None
        self._any_healthy: bool | None = None
        self._major: str | None = None   # _serving_model's answer; None: a vote changed since

    async def start(self) -> None:
        """Open channels, poll every node once (so the first request sees real health), start polling."""
        for node in self.nodes:
            node.open(self._config.security)
        await self.poll_all()
        self._task = asyncio.create_task(self._poll_forever(), name="router-node-poller")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for node in [*self.nodes, *self._retired]:
            if node.channel is not None:
                await node.channel.close()
                node.channel = None

    # --- choice ---------------------------------------------------------------------------------

    def healthy(self) -> list[DecodeNode]:
        return [n for n in self.nodes if n.healthy]

    def route(self, request: generate_pb2.GenerateRequest,
              exclude: Sequence[DecodeNode] = ()) -> tuple[DecodeNode, Route]:
        """The policy's choice for `request` among healthy nodes not in `exclude`, recorded as sent.

        Raises UnavailableError naming every node and why it is out when none is healthy.
        """
        route = self.policy.choose(request, self._candidates(exclude))
        node = self._by_address[route.address]
        self.policy.sent(route)
        router_metrics().routed.labels(node=node.node_id, reason=route.reason).inc()
        return node, route

    def _candidates(self, exclude: Sequence[DecodeNode]) -> list[Candidate]:
        """Healthy nodes not in `exclude` as the policy sees them; rank orders fewer requests in flight
        first, then round-robin from this call's turn."""
        major = self._serving_model()   # a node polled healthy this round is checked here before _check_models
        nodes = [n for n in self.healthy() if n not in exclude and not self._model_skew(n, major)]
        if not nodes:
            raise UnavailableError(self.unavailable_message())
        n = len(self.nodes)
        turn = self._turn
        self._turn += 1
        return [Candidate(d.address, d.outstanding_tokens, len(d.inflight) * n + (d.index - turn) % n) for d in nodes]

    def unavailable_message(self) -> str:
        states = "; ".join(f"{n.address}: {n.reason or 'healthy'}" for n in self.nodes)
        return f"no healthy decode node can take the request ({len(self.nodes)} configured: {states})"

    def mark_failed(self, node: DecodeNode, reason: str) -> None:
        """Take a node out of rotation now (a call found it unreachable); the next good poll restores it."""
        self._set_health(node, False, reason)

    # --- polling --------------------------------------------------------------------------------

    async def poll_all(self) -> None:
        await self._discover()
        await asyncio.gather(*(self._poll(node) for node in self.nodes))
        self._check_models()
        any_healthy = any(n.healthy for n in self.nodes)
        if any_healthy != self._any_healthy:
            self._any_healthy = any_healthy
            if self._on_health_change is not None:
                result = self._on_health_change(any_healthy)
                if asyncio.iscoroutine(result):
                    await result

    async def _discover(self) -> None:
        """dns: entries resolved again: nodes that appeared join (unpolled, so out of rotation until
        this round's poll), nodes that left go out of rotation at once."""
        change = await self.members.refresh()
        if change is not None and (change.removed or change.added):
            self._major = None
        for address in change.removed if change is not None else ():
            node = self._by_address.pop(address, None)
            if node is not None:
                self.nodes.remove(node)
                self.policy.forget(address)
                self._retired.append(node)
        for address in change.added if change is not None else ():
            if address not in self._by_address:
                node = DecodeNode(address, max((n.index for n in self.nodes), default=-1) + 1)
                node.open(self._config.security)
                self.nodes.append(node)
                self._by_address[address] = node
        for node in [n for n in self._retired if not n.inflight]:
            self._retired.remove(node)
            if node.channel is not None:
                await node.channel.close()
                node.channel = None

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_interval_s)
            await self.poll_all()

    async def _poll(self, node: DecodeNode) -> None:
        assert node.health is not None and node.node is not None, "NodePool.start() opens the channels"
        timeout = self._config.health_timeout_s
        try:
            reply = await node.health.Check(health_pb2.HealthCheckRequest(service=READINESS_SERVICE),
                                            timeout=timeout)
        except grpc.aio.AioRpcError as e:
            late = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            node.missed = node.missed + 1 if late else self._config.health_misses
            if node.missed >= self._config.health_misses or not node.healthy:
                self._set_health(node, False, f"health check failed: {e.code().name}: {e.details()}"
                                 + (f" ({node.missed} in a row)" if late else ""))
            else:
                logger.info("node=%s health check missed its %.1f s deadline (%d of %d before it is out)",
                            node.address, timeout, node.missed, self._config.health_misses)
            return
        node.missed = 0
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            self._set_health(node, False, f"health check answered {status}")
            return
        try:
            vote = _model_vote(node)
            node.info = await node.node.GetNodeInfo(node_pb2.GetNodeInfoRequest(),
                                                    timeout=self._config.load_timeout_s)
            if _model_vote(node) != vote:
                self._major = None
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # slow under load is fine; broken is not
                self._set_health(node, False, f"GetNodeInfo failed: {e.code().name}: {e.details()}")
                return
            logger.debug("node=%s GetNodeInfo slower than %.1f s; keeping its last load", node.address,
                         self._config.load_timeout_s)
        if node.reason.startswith(_OTHER_MODEL) and self._model_skew(node):
            return   # still another model than the others' (_check_models decides after the round)
        self._set_health(node, True, "")

    def _serving_model(self) -> str:
        """The model most answering nodes serve ('' when none reported one); ties: the first configured.
        Kept until a vote (_model_vote) or the node list changes."""
        if self._major is None:
            self._major = self._count_votes()
        return self._major

    def _count_votes(self) -> str:
        counts: dict[str, list[int]] = {}
        for n in self.nodes:
            vote = _model_vote(n)
            if vote:
                counts.setdefault(vote, []).append(n.index)
        if not counts:
            return ""
        return max(counts, key=lambda m: (len(counts[m]), -min(counts[m])))

    def _model_skew(self, node: DecodeNode, major: str | None = None) -> str:
        """Why `node` must not get requests for serving another model than the others ('' when it may)."""
        major = self._serving_model() if major is None else major
        if node.info is None or not node.info.model or not major or node.info.model == major:
            return ""
        return f"{_OTHER_MODEL}{node.info.model!r}; the other decode nodes serve {major!r}"

    def _check_models(self) -> None:
        """After a poll round (every node's latest model known): out with the nodes of another model
        than the majority, back with the ones left out only for that and now agreeing."""
        for node in self.nodes:
            if node.healthy or node.reason.startswith(_OTHER_MODEL):
                skew = self._model_skew(node)
                if skew != node.reason:
                    self._set_health(node, not skew, skew)

    def _set_health(self, node: DecodeNode, healthy: bool, reason: str) -> None:
        if healthy and not node.healthy:
            logger.info("node=%s node_id=%s back in rotation", node.address, node.node_id)
        elif not healthy and (node.healthy or node.reason == "not polled yet"):
            logger.warning("node=%s out of rotation: %s", node.address, reason)
        if not healthy and node.healthy:
            self.policy.forget(node.address)
        vote = _model_vote(node)
        node.healthy = healthy
        node.reason = reason
        if _model_vote(node) != vote:
            self._major = None
        if not healthy:
            for watcher in list(node.watchers):  # each removes itself when its stream ends
                watcher()


def _model_vote(n: DecodeNode) -> str:
    """The model `n` counts for in NodePool._serving_model ('' for none): its reported model while it
    is healthy or out of rotation only for serving another model."""
    if n.info is not None and n.info.model and (n.healthy or n.reason.startswith(_OTHER_MODEL)):
        return n.info.model
    return ""
