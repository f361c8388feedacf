"""Conversions between the wire format (pdserve.api.v1) and domain types.

The engine never imports the wire format (DESIGN section 2); servers and clients convert here:
sampling options, streamed outputs, and the Prefill call's transfer ticket. Fabric descriptors
travel as explicit JSON (no pickle: a node never unpickles bytes from the network).
"""

from __future__ import annotations

import json

from pdserve_api.v1 import common_pb2, generate_pb2, prefill_pb2

from pdserve.engine.sampling_params import SamplingParams

_FINISH = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
    "error": generate_pb2.FINISH_REASON_ERROR,
}
_FINISH_NAME = {v: k for k, v in _FINISH.items()}


# --- sampling -------------------------------------------------------------------------------------

def sampling_from_pb(s: generate_pb2.SamplingOptions) -> SamplingParams:
    """SamplingOptions -> SamplingParams; invalid values raise ValueError naming them."""
    kw: dict[str, object] = {
        "top_k": s.top_k,
        "min_p": s.min_p,
        "stop": tuple(s.stop),
        "stop_token_ids": tuple(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
    if s.HasField("temperature"):
        kw["temperature"] = s.temperature
    if s.HasField("top_p"):
        kw["top_p"] = s.top_p
    if s.HasField("seed"):
        kw["seed"] = s.seed
    if s.HasField("max_tokens"):
        kw["max_tokens"] = s.max_tokens
    if s.HasField("logprobs"):
        kw["logprobs"] = s.logprobs
    if s.HasField("skip_special_tokens"):
        kw["skip_special_tokens"] = s.skip_special_tokens
    return SamplingParams(**kw)


def sampling_to_pb(p: SamplingParams) -> generate_pb2.SamplingOptions:
    s = generate_pb2.SamplingOptions(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
    )
    if p.seed is not None:
        s.seed = p.seed
    if p.max_tokens is not None:
        s.max_tokens = p.max_tokens
    if p.logprobs is not None:
        s.logprobs = p.logprobs
    return s


def finish_reason_to_pb(reason: str | None) -> int:
    return _FINISH.get(reason or "", generate_pb2.FINISH_REASON_UNSPECIFIED)


def finish_reason_from_pb(value: int) -> str | None:
    return _FINISH_NAME.get(value)


def output_to_pb(out, tokenizer=None) -> generate_pb2.GenerateResponse:
    """A pdserve RequestOutput -> one streamed GenerateResponse."""
    msg = generate_pb2.GenerateResponse(
        request_id=out.request_id, token_ids=list(out.new_token_ids), text=out.delta_text,
    )
    for lp in out.new_logprobs:
        msg.logprobs.append(generate_pb2.PositionLogprobs(
            sampled=_tlp(lp.sampled, tokenizer), top=[_tlp(t, tokenizer) for t in lp.top]))
    if out.finished:
        c = out.completion
        msg.finish_reason = finish_reason_to_pb(c.finish_reason if c else "error")
        if out.error:
            msg.finish_reason = generate_pb2.FINISH_REASON_ERROR
            msg.error = out.error
        if c is not None and isinstance(c.stop_reason, str):
            msg.stop_string = c.stop_reason
        elif c is not None and isinstance(c.stop_reason, int):
            msg.stop_token_id = c.stop_reason
        msg.usage.CopyFrom(generate_pb2.Usage(prompt_tokens=out.num_prompt_tokens,
                                              completion_tokens=out.num_output_tokens,
                                              cached_prompt_tokens=out.num_cached_tokens))
    return msg


def _tlp(t, tokenizer) -> generate_pb2.TokenLogprob:
    text = tokenizer.decode([t.token_id]) if tokenizer is not None else ""
    return generate_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, text=text)


# --- fabric descriptors -------------------------------------------------------------------------

def peer_to_bytes(peer) -> bytes:
    return json.dumps({
        "provider": peer.provider, "address": peer.address.hex(), "engine_id": peer.engine_id,
        "host_id": peer.host_id, "pid": peer.pid, "start_time": peer.start_time,
    }).encode()


def peer_from_bytes(raw: bytes):
    from fabric import PeerDescriptor

    try:
        d = json.loads(raw)
        return PeerDescriptor(provider=str(d["provider"]), address=bytes.fromhex(d["address"]),
                              engine_id=str(d["engine_id"]), host_id=str(d["host_id"]),
                              pid=int(d["pid"]), start_time=int(d["start_time"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"malformed fabric peer descriptor: {e}") from e


def remote_to_bytes(desc) -> bytes:
    return json.dumps({
        "peer": peer_to_bytes(desc.peer).decode(), "region_id": desc.region_id, "base": desc.base,
        "key": desc.key, "length": desc.length,
    }).encode()


def remote_from_bytes(raw: bytes):
    from fabric import RemoteDescriptor

    try:
        d = json.loads(raw)
        return RemoteDescriptor(peer=peer_from_bytes(d["peer"].encode()), region_id=int(d["region_id"]),
                                base=int(d["base"]), key=int(d["key"]), length=int(d["length"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed fabric memory descriptor: {e}") from e


# --- the Prefill call ---------------------------------------------------------------------------

def layout_to_pb(layout) -> prefill_pb2.KvLayout:
    from kv_messenger.plan import DTYPE_SIZES

    elem = DTYPE_SIZES[layout.dtype]
    token = layout.head_dim * elem
    head = layout.page_size * token
    page = layout.kv_heads * head
    kv = layout.num_pages * page
    return prefill_pb2.KvLayout(
        num_layers=layout.num_layers, num_pages=layout.num_pages, kv_heads=layout.kv_heads,
        page_size=layout.page_size, head_dim=layout.head_dim, dtype=layout.dtype, element_size=elem,
        base_offset=0, layer_stride=2 * kv, kv_stride=kv, page_stride=page, head_stride=head, token_stride=token,
    )


def layout_from_pb(m: prefill_pb2.KvLayout):
    from kv_messenger.plan import KvLayout

    layout = KvLayout(m.num_layers, m.num_pages, m.kv_heads, m.page_size, m.head_dim, m.dtype)
    if layout_to_pb(layout) != m:
        raise ValueError("KV layout strides are not the HND layout this node writes "
                         f"(got page_stride={m.page_stride}, expected {layout.page_nbytes})")
    return layout


def ticket_to_pb(ticket, token_ids: list[int], peer, model: str, deadline_s: float | None) -> prefill_pb2.PrefillRequest:
    """The decode side's PrefillTicket -> the Prefill call (token_ids: the prompt minus its last token)."""
    req = prefill_pb2.PrefillRequest(
        request_id=ticket.request_id,
        token_ids=token_ids,
        peer=prefill_pb2.FabricPeer(provider=peer.provider, descriptor=peer_to_bytes(peer)),
        kv_memory=[prefill_pb2.KvMemory(tp_rank=0, descriptor=remote_to_bytes(ticket.kv),
                                        layout=layout_to_pb(ticket.layout))],
        page_ids=list(ticket.dst_pages),
        context=prefill_pb2.ContextSlot(descriptor=remote_to_bytes(ticket.context), offset=ticket.context_offset,
                                        capacity=0, logits_top_k=0),
        sharding=common_pb2.ShardingScheme(tp_size=ticket.sharding.tp_size,
                                           kv_heads_per_rank=ticket.layout.kv_heads,
                                           total_kv_heads=ticket.layout.kv_heads),
        imm_tag=ticket.imm_tag,
        expected_writes=ticket.expected_writes,
        model=model,
    )
    if deadline_s is not None:
        req.deadline_s = deadline_s
    return req


def target_from_pb(req: prefill_pb2.PrefillRequest):
    """The Prefill call -> the prefill side's TransferTarget; malformed input raises ValueError."""
    from kv_messenger.sender import TransferTarget

    if len(req.kv_memory) != 1:
        raise ValueError(f"expected one KV memory descriptor (tp_size 1), got {len(req.kv_memory)}")
    if not req.token_ids:
        raise ValueError(f"request {req.request_id}: no tokens to prefill")
    mem = req.kv_memory[0]
    return TransferTarget(
        request_id=req.request_id,
        kv=remote_from_bytes(mem.descriptor),
        layout=layout_from_pb(mem.layout),
        dst_pages=tuple(req.page_ids),
        context=remote_from_bytes(req.context.descriptor),
        context_offset=req.context.offset,
        imm_tag=req.imm_tag,
        expected_writes=req.expected_writes,
        num_prefill_tokens=len(req.token_ids),
    )
