"""Tests for pdserve.engine.sampling.detokenizer: incremental decode equals decode, stop strings never leak."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.engine.sampling.detokenizer import IncrementalDetokenizer, special_token_ids
from pdserve.engine.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. 😀 世界 ñandú café",
    "Stop strings end generation; the answer is 42.\n\nDone.",
] * 4

TEXTS = [
    "Hello 😀 world 世界!",
    "👨‍👩‍👧 family, 🇫🇷 flag, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ñandú — done.",
    "日本語のテキストと中文文本。한국어도.",
    "def f(x):\n    return x ** 2  # 🐍\n\n",
    "   leading spaces and trailing   ",
]


# --- helpers -------------------------------------------------------------------------------


def run(
    tokenizer: Any, ids: Sequence[int], params: SamplingParams, prompt: Sequence[int] = ()
) -> tuple[list[str], str | None, str, IncrementalDetokenizer]:
    """Push ids one by one; returns (deltas incl. finish, stop string, final text, detokenizer)."""
    det = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas: list[str] = []
    stop = None
    for tid in ids:
        step = det.push(tid)
        deltas.append(step.delta_text)
        if step.stop_string is not None:
            stop = step.stop_string
            break
    if stop is None:
        deltas.append(det.finish())
    return deltas, stop, det.text, det


def assert_decodes_exactly(
    tokenizer: Any, ids: Sequence[int], skip: bool, prompt: Sequence[int] = ()
) -> None:
    params = SamplingParams(skip_special_tokens=skip)
    deltas, stop, text, _ = run(tokenizer, ids, params, prompt)
    expected = tokenizer.decode(list(ids), skip_special_tokens=skip)
    assert stop is None
    assert "".join(deltas) == expected, (list(ids), prompt)
    assert text == expected
    # Nothing but the very last flush may carry a replacement char for a still-incomplete character.
    for d in deltas[:-1]:
        assert not d.endswith("\ufffd") or expected.count("\ufffd") > 0


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte <-> printable character table used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


BYTE_CHARS = _bytes_to_unicode()


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_added_tokens_decoder(self) -> Any:
        return self.inner.get_added_tokens_decoder()


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_tokenizer() -> Any:
    """The default model's tokenizer (SmolLM2, byte-level BPE); slow to load, shared."""
    from pdserve.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    """A tiny byte-level BPE (GPT-2 style) with two special tokens, trained in milliseconds."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|end|>", "<|start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def sentencepiece_like() -> Tokenizer:
    """A tiny Metaspace (SentencePiece-style) word-level tokenizer: decode drops the first space."""
    words = ["▁Hello", "▁world", "▁the", "answer", "▁is", "▁42", "!", "<unk>", "<s>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>"])
    return tok


# --- tiny tokenizers (fast) ------------------------------------------------------------------


def test_byte_bpe_random_sequences_decode_exactly(byte_bpe: Tokenizer) -> None:
    rng = random.Random(0)
    vocab = byte_bpe.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        for skip in (True, False):
            assert_decodes_exactly(byte_bpe, ids, skip, prompt)


def test_byte_bpe_split_characters_are_held_back(byte_bpe: Tokenizer) -> None:
    # Force one token per byte: every multi-byte character spans several tokens.
    text = "a😀b世"
    ids = [byte_bpe.token_to_id(BYTE_CHARS[b]) for b in text.encode("utf-8")]
    deltas, _, final, _ = run(byte_bpe, ids, SamplingParams())
    assert final == text
    assert "\ufffd" not in "".join(deltas)
    assert deltas == ["a", "", "", "", "😀", "b", "", "", "世", ""]


def test_incomplete_character_at_finish_matches_decode(byte_bpe: Tokenizer) -> None:
    ids = [byte_bpe.token_to_id(BYTE_CHARS[b]) for b in "x😀".encode("utf-8")[:3]]
    deltas, _, final, _ = run(byte_bpe, ids, SamplingParams())
    assert deltas[0] == "x"
    assert final == byte_bpe.decode(ids) == "x\ufffd"


def test_special_tokens_skipped_or_kept(byte_bpe: Tokenizer) -> None:
    end, start = byte_bpe.token_to_id("<|end|>"), byte_bpe.token_to_id("<|start|>")
    assert special_token_ids(byte_bpe) == frozenset({end, start})
    ids = [start] + byte_bpe.encode("Hello world").ids + [end]
    assert_decodes_exactly(byte_bpe, ids, skip=True)
    assert_decodes_exactly(byte_bpe, ids, skip=False)
    assert run(byte_bpe, ids, SamplingParams(skip_special_tokens=False))[2].startswith("<|start|>")


def test_decode_window_stays_small(byte_bpe: Tokenizer) -> None:
    counting = CountingTokenizer(byte_bpe)
    ids = byte_bpe.encode(" ".join(CORPUS) * 10).ids
    assert len(ids) > 1000
    deltas, _, final, _ = run(counting, ids, SamplingParams())
    assert final == byte_bpe.decode(ids)
    assert max(counting.lengths) <= 8, max(counting.lengths)


def test_sentencepiece_leading_space_from_prompt(sentencepiece_like: Tokenizer) -> None:
    tok = sentencepiece_like
    vid = tok.token_to_id
    out = [vid("▁world"), vid("▁is"), vid("▁42"), vid("!")]
    # Without a prompt the output is decode(output): the first token loses its leading space.
    assert_decodes_exactly(tok, out, skip=True)
    assert tok.decode(out) == "world is 42!"
    # With a prompt the first token decodes as a continuation: " world is 42!".
    prompt = [vid("<s>"), vid("▁Hello")]
    deltas, _, final, _ = run(tok, out, SamplingParams(), prompt)
    full = tok.decode(prompt + out)
    assert final == full[len(tok.decode(prompt)) :] == " world is 42!"
    assert deltas[0] == " world"


# --- stop strings --------------------------------------------------------------------------


def _ascii_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [tokenizer.token_to_id(BYTE_CHARS[b]) for b in text.encode("utf-8")]


def _check_no_leak(deltas: list[str], final: str) -> None:
    """Every prefix of the stream is a prefix of the final (cut) text: no stop-string char leaked."""
    acc = ""
    for d in deltas:
        acc += d
        assert final.startswith(acc), (acc, final)
    assert acc == final


def test_stop_string_spanning_tokens_is_cut(byte_bpe: Tokenizer) -> None:
    ids = _ascii_ids(byte_bpe, "the answer is 42. more")
    deltas, stop, final, det = run(byte_bpe, ids, SamplingParams(stop=("is 42",)))
    assert stop == "is 42" and det.stop_string == "is 42"
    assert final == "the answer "
    _check_no_leak(deltas, final)
    with pytest.raises(RuntimeError, match="after the detokenizer ended"):
        det.push(ids[0])
    assert det.finish() == ""


def test_partial_stop_is_held_then_released(byte_bpe: Tokenizer) -> None:
    ids = _ascii_ids(byte_bpe, "xabd")
    deltas, stop, final, _ = run(byte_bpe, ids, SamplingParams(stop=("abc",)))
    assert stop is None
    assert deltas == ["x", "", "", "abd", ""]
    assert final == "xabd"
    # Held at the end and released by finish().
    deltas, stop, final, _ = run(byte_bpe, _ascii_ids(byte_bpe, "xab"), SamplingParams(stop=("abc",)))
    assert stop is None and deltas == ["x", "", "", "ab"] and final == "xab"


def test_earliest_of_several_stops_wins(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("Hello world, this is a tiny corpus").ids
    params = SamplingParams(stop=("tiny", "world", "is a"))
    deltas, stop, final, _ = run(byte_bpe, ids, params)
    assert stop == "world" and final == "Hello "
    _check_no_leak(deltas, final)


def test_stop_at_first_token_and_inside_one_token(real_tokenizer: Any) -> None:
    ids = real_tokenizer.encode("Hello world")
    deltas, stop, final, _ = run(real_tokenizer, ids, SamplingParams(stop=("Hel",)))
    assert stop == "Hel" and final == "" and deltas == [""]
    # The stop string is the middle of a single token (" world" -> "orl").
    deltas, stop, final, _ = run(real_tokenizer, ids, SamplingParams(stop=("orl",)))
    assert stop == "orl" and final == "Hello w"
    _check_no_leak(deltas, final)


# --- the real SmolLM2 tokenizer --------------------------------------------------------------


def test_real_crafted_texts_decode_exactly(real_tokenizer: Any) -> None:
    tok = real_tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert_decodes_exactly(tok, ids, skip)
        # Byte tokens that split a character never stream a replacement char.
        deltas, _, final, _ = run(tok, ids, SamplingParams())
        assert "\ufffd" not in "".join(deltas) and final == text


def test_real_special_tokens_both_ways(real_tokenizer: Any) -> None:
    tok = real_tokenizer
    special = sorted(special_token_ids(tok))
    assert {0, 1, 2} <= set(special)
    chat = "<|im_start|>assistant\nSure 😀 世界<|im_end|>\n<|endoftext|>"
    ids = tok.encode(chat, add_special_tokens=False)
    assert any(i in special for i in ids)
    for skip in (True, False):
        assert_decodes_exactly(tok, ids, skip)
    assert run(tok, ids, SamplingParams(skip_special_tokens=False))[2] == chat


def test_real_random_sequences_decode_exactly(real_tokenizer: Any) -> None:
    tok = real_tokenizer
    rng = random.Random(1234)
    vocab = len(tok)
    # Mostly single-byte tokens mixed with specials and arbitrary tokens, so multi-byte characters
    # are split and interleaved in every way.
    pool_bytes = [i for i, t in enumerate(tok.convert_ids_to_tokens(list(range(400)))) if len(t) == 1]
    pool_special = sorted(special_token_ids(tok))
    assert len(pool_bytes) > 200
    for _ in range(150):
        ids = []
        for _ in range(rng.randrange(1, 40)):
            r = rng.random()
            if r < 0.4:
                ids.append(rng.choice(pool_bytes))
            elif r < 0.5:
                ids.append(rng.choice(pool_special))
            else:
                ids.append(rng.randrange(vocab))
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        for skip in (True, False):
            assert_decodes_exactly(tok, ids, skip, prompt)


def test_real_prompt_seed_keeps_first_token_and_split_prompt(real_tokenizer: Any) -> None:
    tok = real_tokenizer
    prompt = tok.encode("Say hello:", add_special_tokens=False)
    out = tok.encode(" hello there", add_special_tokens=False)
    deltas, _, final, _ = run(tok, out, SamplingParams(), prompt)
    assert final == " hello there" and deltas[0] == " hello"
    # A prompt ending inside a character: the output decodes as decode(output) on its own.
    ids = tok.encode("a😀b", add_special_tokens=False)
    for cut in range(1, len(ids)):
        assert_decodes_exactly(tok, ids[cut:], True, prompt=ids[:cut])


def test_real_stop_strings_random_positions(real_tokenizer: Any) -> None:
    tok = real_tokenizer
    text = "The answer is 42.\n\nNext: 😀 世界 emoji and CJK, then the end."
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(7)
    for _ in range(100):
        a = rng.randrange(len(text))
        b = rng.randrange(a + 1, min(len(text), a + 6) + 1)
        stop = text[a:b]
        deltas, got, final, _ = run(tok, ids, SamplingParams(stop=(stop, "never-matches")))
        assert got == stop
        assert final == text[: text.find(stop)]
        _check_no_leak(deltas, final)
        for d in deltas:
            assert "\ufffd" not in d
