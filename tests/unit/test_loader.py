"""Tests of pdserve.model.loader: model resolution, the GGUF conversion cache, and readers.

The real conversion of the default GGUF (~40 s) runs at most once per machine: the tests
use the user's cache (``default_source``), converting into it on first use. Cache mechanics
(convert once, leftovers, crashes, races) are tested in temporary caches with a fast fake
converter.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import transformers
from safetensors.torch import save_file
from support.tiny_models import TINY_ARCHS, default_model_source, make_tiny_checkpoint
from support.wait import wait_until

from pdserve.model import loader
from pdserve.model.loader import (
    DEFAULT_MODEL_NAME,
    ModelSource,
    iter_weights,
    load_config,
    load_generation_eos,
    load_tokenizer,
    resolve_model,
)

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # as transformers' GGUF tokenizer gives them
# transformers' greedy continuation of PROMPT_IDS (20 tokens) when loading the GGUF directly.
GGUF_GREEDY_20 = [
    7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34,
    32, 33, 40, 29, 32, 33, 29, 34, 34, 216,
]  # fmt: skip


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def default_source() -> ModelSource:
    """The default model from the user's cache (converted there on first use)."""
    return default_model_source()


@pytest.fixture
def fake_gguf(tmp_path: pathlib.Path) -> pathlib.Path:
    """A file with the GGUF magic; only the fake converter ever reads past it."""
    path = tmp_path / "src" / "fake-model.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(64))
    return path


class ConvertCalls(list):
    """The output folders the fake converter was called with. `hold` runs inside each conversion,
    while the converting resolver holds the cache lock (a test makes others race for it there)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold: Callable[[], object] = lambda: None


@pytest.fixture
def fake_convert(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> Iterator[ConvertCalls]:
    """Replace the slow GGUF conversion with one writing a 1-tensor checkpoint; records calls."""
    calls = ConvertCalls()

    def convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
        calls.append(out_dir)
        calls.hold()
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
        save_file({"w": torch.ones(2)}, str(out_dir / "model.safetensors"))

    monkeypatch.setattr(loader, "convert_gguf", convert)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    yield calls


# --- cache directory --------------------------------------------------------------------------


def test_default_cache_dir_precedence(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loader.default_cache_dir() == tmp_path / "home" / ".cache" / "pdserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.default_cache_dir() == tmp_path / "xdg" / "pdserve"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert loader.default_cache_dir() == tmp_path / "explicit"


# --- the real default-model conversion --------------------------------------------------------


def test_conversion_writes_plain_float32_checkpoint(default_source: ModelSource) -> None:
    source = default_source
    assert source.name == DEFAULT_MODEL_NAME
    assert source.path.parent == loader.default_cache_dir() / "models"
    files = {p.name for p in source.path.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert expected <= files
    key = source.path.name
    assert not list(source.path.parent.glob(f"{key}.tmp-*")), "temporary conversion dir left"

    config = json.loads((source.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    weights = dict(iter_weights(source))
    assert "lm_head.weight" not in weights  # tied: stored once, as the embedding
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert load_generation_eos(source) == (2,)


def test_cached_resolve_is_fast_and_rewrites_nothing(default_source: ModelSource) -> None:
    source = default_source
    mtimes = {p.name: p.stat().st_mtime_ns for p in source.path.iterdir()}
    started = time.monotonic()
    again = resolve_model(None)
    elapsed = time.monotonic() - started
    assert again == source
    assert elapsed < 3.0, f"cached resolve took {elapsed:.2f} s"
    assert {p.name: p.stat().st_mtime_ns for p in source.path.iterdir()} == mtimes


def test_converted_model_matches_gguf_greedy(default_source: ModelSource) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(default_source.path))
    output = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=20, do_sample=False)
    assert output[0, len(PROMPT_IDS) :].tolist() == GGUF_GREEDY_20


@pytest.mark.slow
def test_converted_logits_equal_gguf_logits(default_source: ModelSource) -> None:
    gguf_path = loader.default_gguf_path()
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    from_cache = transformers.AutoModelForCausalLM.from_pretrained(str(default_source.path))
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        torch.testing.assert_close(from_cache(ids).logits, from_gguf(ids).logits, rtol=0, atol=0)


def test_tokenizer_matches_gguf_and_keeps_chat_template(default_source: ModelSource) -> None:
    tokenizer = load_tokenizer(default_source)
    assert tokenizer.is_fast
    assert tokenizer(PROMPT).input_ids == PROMPT_IDS
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2


def test_default_model_name_resolves_to_default(default_source: ModelSource) -> None:
    assert resolve_model(DEFAULT_MODEL_NAME) == default_source
    assert load_config(default_source).model_type == "llama"


# --- conversion cache mechanics (fake converter) ----------------------------------------------


def test_gguf_path_is_converted_once_and_logged(
    fake_gguf: pathlib.Path, fake_convert: list[pathlib.Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger=loader.__name__):
        source = resolve_model(fake_gguf)
    assert source.name == "fake-model"
    assert str(source.path) in caplog.text
    assert resolve_model(str(fake_gguf)) == source
    assert len(fake_convert) == 1


def test_leftover_temp_dir_is_ignored_then_cleaned(
    fake_gguf: pathlib.Path, fake_convert: list[pathlib.Path]
) -> None:
    models_dir = loader.default_cache_dir() / "models"
    key = loader.gguf_cache_key(fake_gguf, "fake-model")
    leftover = models_dir / f"{key}.tmp-99999"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{half written")
    source = resolve_model(fake_gguf)
    assert source.path == models_dir / key
    assert not leftover.exists()
    assert json.loads((source.path / "config.json").read_text())["eos_token_id"] == 2


def test_crash_mid_conversion_leaves_no_cache_entry(
    fake_gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    def crash(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(loader, "convert_gguf", crash)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model(fake_gguf)
    entries = [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.suffix != ".lock"]
    assert entries == []


def test_concurrent_resolves_convert_once(
    fake_gguf: pathlib.Path, fake_convert: ConvertCalls, caplog: pytest.LogCaptureFixture
) -> None:
    results: list[ModelSource] = []
    errors: list[BaseException] = []
    caplog.set_level("INFO", logger=loader.__name__)

    def others_wait_for_the_lock() -> bool:
        return sum("waiting for another process holding" in r.getMessage() for r in caplog.records) >= 3

    # The fence: the conversion goes on until the three other resolvers are blocked on its lock, so
    # they really raced it (a sleep would only hope they had started).
    fake_convert.hold = lambda: wait_until(others_wait_for_the_lock, 30,
                                           "3 other resolvers to log that they wait for the conversion lock")

    def worker() -> None:
        try:
            results.append(resolve_model(fake_gguf))
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(fake_convert) == 1
    assert len(set(results)) == 1


def test_rename_race_keeps_existing_target(
    fake_gguf: pathlib.Path, fake_convert: list[pathlib.Path]
) -> None:
    """A target that appears during conversion (a process ignoring the lock) wins."""
    key = loader.gguf_cache_key(fake_gguf, "fake-model")
    target = loader.default_cache_dir() / "models" / key
    target.mkdir(parents=True)
    (target / "marker").write_text("theirs")
    loader._convert_gguf_atomically(fake_gguf, target)
    assert (target / "marker").read_text() == "theirs"
    assert not list(target.parent.glob("*.tmp-*"))


def test_cache_key_changes_when_gguf_changes(fake_gguf: pathlib.Path) -> None:
    before = loader.gguf_cache_key(fake_gguf, "m")
    os.utime(fake_gguf, ns=(0, 1_000_000_000))
    assert loader.gguf_cache_key(fake_gguf, "m") != before


# --- local directories and errors -------------------------------------------------------------


def test_local_checkpoint_dir_is_used_as_is(tmp_path: pathlib.Path) -> None:
    path = make_tiny_checkpoint("qwen2", tmp_path / "tiny-qwen2")
    source = resolve_model(path)
    assert source == ModelSource(path=path.resolve(), name="tiny-qwen2")
    assert load_config(source).model_type == "qwen2"
    assert load_tokenizer(source)(PROMPT).input_ids == PROMPT_IDS
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    expected = model.state_dict()
    weights = dict(iter_weights(source))
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    assert set(weights) == set(expected) - {"lm_head.weight"}  # tied
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def test_sharded_checkpoint_iterates_every_shard(tmp_path: pathlib.Path) -> None:
    path = make_tiny_checkpoint("llama3", tmp_path / "single")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="2MB")
    (sharded / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    assert (sharded / loader.SAFETENSORS_INDEX_FILE).is_file()
    assert len(loader.safetensors_files(sharded)) > 1
    single = dict(iter_weights(resolve_model(path)))
    split = dict(iter_weights(resolve_model(sharded)))
    assert set(split) == set(single)
    assert "lm_head.weight" in split  # untied
    for name, tensor in single.items():
        torch.testing.assert_close(split[name], tensor, rtol=0, atol=0)


def test_nonexistent_path_is_named(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model path '{missing}' does not exist"):
        resolve_model(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("some-org/some-hub-model")


def test_dir_without_config_is_rejected(tmp_path: pathlib.Path) -> None:
    save_file({"w": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"'{tmp_path}' has no config.json"):
        resolve_model(tmp_path)


def test_dir_without_safetensors_is_rejected(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"no \*\.safetensors in '{tmp_path}'"):
        resolve_model(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="needs safetensors"):
        resolve_model(tmp_path)


def test_invalid_gguf_and_other_files_are_rejected(tmp_path: pathlib.Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match=f"'{bogus}' is not a GGUF file"):
        resolve_model(bogus)
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(1)}, str(weights))
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(weights)


def test_missing_tokenizer_is_named(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(resolve_model(tmp_path))


def test_generation_eos_merges_int_and_list(tmp_path: pathlib.Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    source = ModelSource(path=tmp_path, name="x")
    assert load_generation_eos(source) == (2, 7)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "7"}))
    with pytest.raises(ValueError, match="eos_token_id in .* is '7'"):
        load_generation_eos(source)


# --- tiny models ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_checkpoint_loads_and_decodes_varied_tokens(arch: str, tmp_path: pathlib.Path) -> None:
    path = make_tiny_checkpoint(arch, tmp_path / arch)
    source = resolve_model(path)
    config = load_config(source)
    assert config.vocab_size == 49152
    assert config.num_key_value_heads < config.num_attention_heads
    assert load_generation_eos(source) == (2,)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    output = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=20, do_sample=False)
    new_tokens = output[0, len(PROMPT_IDS) :].tolist()
    assert len(set(new_tokens)) >= 10, f"{arch} greedy output is degenerate: {new_tokens}"
    names = {name for name, _ in iter_weights(source)}
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    if arch == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in names
    if arch == "llama3":
        assert config.rope_parameters["rope_type"] == "llama3"
    if arch == "mistral":
        assert config.sliding_window is None


def test_tiny_checkpoint_is_deterministic(tmp_path: pathlib.Path) -> None:
    def weights(name: str, seed: int) -> dict[str, torch.Tensor]:
        path = make_tiny_checkpoint("llama", tmp_path / name, seed=seed)
        return dict(iter_weights(resolve_model(path)))

    first, second, other = weights("a", 3), weights("b", 3), weights("c", 4)
    name = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(first[name], second[name], rtol=0, atol=0)
    assert not torch.equal(first[name], other[name])
