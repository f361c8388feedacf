"""Concurrent completions through a router, for the cluster fault tests (test_key_rotation,
test_transfer_faults, test_prefill_restart). Test thread only; `complete_all` is bounded by the
client's `timeout_s` per request and `timeout_s + 30` s in all."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient, ClientError


async def complete_all_async(url: str, prompts: Sequence[str], params: SamplingParams, tag: str,
                             timeout_s: float) -> dict[str, tuple[int, ...] | str]:
    async with AsyncClient(url, timeout=timeout_s) as client:
        async def one(i: int, prompt: str) -> tuple[int, ...] | str:
            try:
                return tuple((await client.complete(prompt, params, request_id=f"{tag}-{i}")).token_ids)
            except ClientError as e:
                return f"error: {e}"

        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return {f"{tag}-{i}": o for i, o in enumerate(outs)}


def complete_all(url: str, prompts: Sequence[str], params: SamplingParams, tag: str,
                 timeout_s: float) -> dict[str, tuple[int, ...] | str]:
    """Run `prompts` concurrently through the router at `url` as request ids TAG-i: request id ->
    generated token ids, or "error: ..." with the error it ended with. `complete_all_async` is the
    same, awaited on the caller's loop (bounded per request by `timeout_s` only)."""
    return asyncio.run(asyncio.wait_for(complete_all_async(url, prompts, params, tag, timeout_s), timeout_s + 30))
