"""The C layer ops for few-token float32 passes (pdserve/model/layer_ops.py: CLayerOps).

The one layer loop runs them in the same order, with the same arguments, as the module ops, so
every token and every logprob must be bit-identical to the module path's, for each Llama-family
architecture they apply to (biases included), with both attention backends; they must step aside
(module path) for q/k norm models, bfloat16 weights, passes longer than small_batch_max_tokens
(EngineConfig) and small_batch_max_tokens=0, and rebind when a weight's storage is replaced.
"""

from __future__ import annotations

import pytest
from support.native import skip_unless_built, with_cpu
from support.tiny_models import make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.kernels.attention import cpu_kernels
from pdserve.kernels.ops import native
from pdserve.kernels.ops.linear import max_rows
from pdserve.model.layer_ops import CLayerOps

pytestmark = [
    skip_unless_built(native.available(), "the C ops (pdserve.kernels.ops._cpu_ops)", native.unavailable_reason()),
    pytest.mark.skipif(max_rows() == 0, reason="the C ops' small linear kernel is disabled"),
    pytest.mark.usefixtures("one_thread"),  # conftest: tiny models run on one thread
]

PROMPTS = ["The capital of France is", "def f(x):\n    return", "Once upon a time", "1, 2, 3,"]
BACKENDS = with_cpu(cpu_kernels.available(), cpu_kernels.unavailable_reason())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-small-batch")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in ("llama", "llama3", "qwen2", "mistral", "qwen3")}


class RunCounter:
    """Counts CLayerOps.begin_pass calls (passes that took the C layer ops)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        inner = CLayerOps.begin_pass

        def begin_pass(layers_self, *a, **kw):
            self.calls += 1
            return inner(layers_self, *a, **kw)

        monkeypatch.setattr(CLayerOps, "begin_pass", begin_pass)


def generate(llm: LLM, module_path: bool) -> list:
    llm.engine.model._c_ops = False if module_path else None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "mistral"])
def test_bit_identical_to_the_module_path(checkpoints, arch, backend, monkeypatch):
    llm = LLM(model=str(checkpoints[arch]), num_blocks=64, page_size=8, max_batch_tokens=32,
              attention_backend=backend)
    counter = RunCounter(monkeypatch)
    fast = generate(llm, module_path=False)
    assert counter.calls >= 11, "the decode steps did not take the C-op loop"
    assert isinstance(llm.engine.model._c_ops, CLayerOps)
    calls = counter.calls
    slow = generate(llm, module_path=True)
    assert counter.calls == calls
    for a, b in zip(fast, slow, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs and a.logprobs == b.logprobs  # every sampled and top-3 logprob, exactly
    llm.engine.check_integrity()


def test_steps_aside_for_qk_norm_bfloat16_and_long_passes(checkpoints, monkeypatch):
    counter = RunCounter(monkeypatch)
    qwen3 = LLM(model=str(checkpoints["qwen3"]), num_blocks=64, page_size=8, max_batch_tokens=32)
    qwen3.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3))
    assert qwen3.engine.model._c_ops is False and counter.calls == 0
    bf16 = LLM(model=str(checkpoints["llama"]), num_blocks=64, page_size=8, max_batch_tokens=32, dtype="bfloat16")
    bf16.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3))
    assert bf16.engine.model._c_ops is False and counter.calls == 0
    # a prefill pass of more than max_rows() tokens runs the module path; its decodes do not
    llm = LLM(model=str(checkpoints["llama"]), num_blocks=64, page_size=8, max_batch_tokens=256)
    long_prompt = [list(range(100, 100 + max_rows() + 9))]
    out = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert counter.calls == 3  # the 3 decode passes; the one prefill pass took the module path
    llm.engine.model._c_ops = False
    again = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == again.token_ids


def test_small_batch_max_tokens_sets_the_limit_and_zero_disables(checkpoints, monkeypatch):
    counter = RunCounter(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    # 4 prompts: every pass has at least 4 tokens, more than a limit of 3
    narrow = LLM(model=str(checkpoints["llama"]), num_blocks=64, page_size=8, max_batch_tokens=32,
                 small_batch_max_tokens=3)
    narrow_out = narrow.generate(PROMPTS, params)
    assert counter.calls == 0
    one = narrow.generate(PROMPTS[3:], params)  # one sequence: its decode passes have 1 token
    assert counter.calls == 5
    off = LLM(model=str(checkpoints["llama"]), num_blocks=64, page_size=8, max_batch_tokens=32,
              small_batch_max_tokens=0)
    off_out = off.generate(PROMPTS, params)
    assert off.generate(PROMPTS[3:], params)[0].logprobs == one[0].logprobs
    assert counter.calls == 5 and off.engine.model._c_ops is False
    default = LLM(model=str(checkpoints["llama"]), num_blocks=64, page_size=8, max_batch_tokens=32)
    default_out = default.generate(PROMPTS, params)
    assert counter.calls == 5 + 6  # its prefill pass (4 short prompts, <= 32 tokens) and 5 decode passes
    for a, b, c in zip(narrow_out, off_out, default_out, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids and a.logprobs == b.logprobs == c.logprobs


@pytest.mark.parametrize("bad", [-1, 33, 1.5, True, "32"])
def test_small_batch_max_tokens_is_validated(bad):
    with pytest.raises(ValueError, match=r"small_batch_max_tokens must be an integer in \[0, 32\]"):
        EngineConfig(small_batch_max_tokens=bad)
    assert EngineConfig().small_batch_max_tokens == 32


def test_rebinds_when_a_weight_storage_is_replaced(checkpoints):
    llm = LLM(model=str(checkpoints["qwen2"]), num_blocks=64, page_size=8, max_batch_tokens=32)
    before = generate(llm, module_path=False)
    bound = llm.engine.model._c_ops
    assert isinstance(bound, CLayerOps) and bound.still_bound()
    down = llm.engine.model.layers[1].mlp.down_proj
    down.weight.data = down.weight.data * 2.0                 # new storage, new values
    assert not bound.still_bound()
    fast = generate(llm, module_path=False)
    rebound = llm.engine.model._c_ops
    assert isinstance(rebound, CLayerOps) and rebound is not bound and rebound.still_bound()
    slow = generate(llm, module_path=True)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    assert [o.logprobs for o in fast] == [o.logprobs for o in slow]
    assert [o.token_ids for o in fast] != [o.token_ids for o in before]  # the new weights are used


def test_bind_names_a_weight_it_cannot_use(checkpoints):
    llm = LLM(model=str(checkpoints["llama"]), num_blocks=64, page_size=8, max_batch_tokens=32)
    layers = llm.engine.model.layers
    o_proj = layers[0].self_attn.o_proj
    o_proj.weight.data = o_proj.weight.data.t().contiguous().t()   # same shape, strided
    with pytest.raises(ValueError, match=r"layer 0 o_w is \(64, 64\)/torch.float32/cpu/strided"):
        CLayerOps.bind(layers, 1e-5, 32)
    with pytest.raises(ValueError, match=r"max_tokens must be in \[0, 32\].*got 33"):
        CLayerOps.bind(layers, 1e-5, 33)
