"""Incremental detokenization with stop strings (E19).

`IncrementalDetokenizer` turns a stream of generated token ids into text deltas that are safe to
stream, in O(window) work per token.

Decoding: every step decodes two short windows of ids, `ids[prefix:read]` (already emitted) and
`ids[prefix:]` (the same plus the new tokens), and emits the difference. Decoding with a few
tokens of left context keeps tokenizer decoders that treat the first token specially (SentencePiece
strips its leading space) right, and decoding the new tokens together keeps byte-level BPE tokens
that split one UTF-8 character together: while the window's text ends in U+FFFD the character may
still be incomplete, so nothing is emitted and the window grows until it completes (or `finish()`
flushes it as is). The window is seeded with the last few prompt tokens so the first output token
decodes as a continuation of the prompt.

Resulting text: for byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM2...) the concatenated
output equals `tokenizer.decode(output_ids, skip_special_tokens=...)`. For decoders that strip the
first token's leading space (SentencePiece Metaspace), the output is the continuation of the
prompt, i.e. it keeps the first token's leading space that `decode(output_ids)` alone would drop;
with an empty prompt the two are equal.

Special tokens: with `skip_special_tokens` the ids that `decode` drops (added tokens marked
special) are dropped before they enter the window, as `tokenizers` does, so they cannot shift the
window's first position.

Stop strings: the decoded text is searched for every `params.stop` string; text is cut before the
earliest match. Trailing characters that could be the start of a stop string are held back until a
later token rules the stop string out; `finish()` releases them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as left context for the first output token.
_PROMPT_WINDOW = 5
# Compact the id buffer once this many ids lie before the decode window.
_COMPACT_AFTER = 256

_special_ids_cache: "weakref.WeakKeyDictionary[Any, frozenset[int]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class DetokenizerStep:
    """What one pushed token produced."""

    delta_text: str  # new text safe to stream now
    stop_string: str | None  # the stop string that matched (generation must end), else None


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `tokenizer.decode(..., skip_special_tokens=True)` drops (cached per tokenizer).

    Accepts a `transformers` tokenizer (`added_tokens_decoder`) or a raw `tokenizers.Tokenizer`
    (`get_added_tokens_decoder()`).
    """
    try:
        cached = _special_ids_cache.get(tokenizer)
    except TypeError:  # not weak-referenceable: compute every time
        cached = None
    if cached is not None:
        return cached

    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added is None and hasattr(tokenizer, "get_added_tokens_decoder"):
        added = tokenizer.get_added_tokens_decoder()
    candidates = {int(i) for i, tok in (added or {}).items() if getattr(tok, "special", False)}
    candidates.update(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ()))
    # Keep only ids decode really drops, so filtering them can never change the decoded text.
    result = frozenset(i for i in candidates if tokenizer.decode([i], skip_special_tokens=True) == "")
    try:
        _special_ids_cache[tokenizer] = result
    except TypeError:
        logger.debug("tokenizer %s is not weak-referenceable; special ids not cached", type(tokenizer))
    return result


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens, stopping at `params.stop` strings.

    `text` is the output text decoded so far, with the stop string and everything after it
    excluded; it includes characters still held back as a possible stop-string start (not yet in
    any delta) and excludes bytes of a character not yet complete. Once stopped or finished,
    `text` equals the concatenation of every delta.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._special: frozenset[int] = special_token_ids(tokenizer) if self._skip_special else frozenset()
        self._stops: tuple[str, ...] = params.stop

        # Left context: the last few prompt tokens that decode keeps.
        seed: list[int] = []
        for tid in reversed(prompt_token_ids):
            if len(seed) == _PROMPT_WINDOW:
                break
            if int(tid) not in self._special:
                seed.append(int(tid))
        seed.reverse()
        if seed and self._decode(seed).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character; its continuation bytes would fuse with it.
            seed = []

        self._ids: list[int] = seed  # ids from the decode window's start onwards
        self._prefix_offset = 0  # start of the decode window in self._ids
        self._read_offset = len(seed)  # ids before this are already part of the decoded text
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached

        self._emitted: list[str] = []  # deltas handed out
        self._held = ""  # decoded text held back: a suffix that may start a stop string
        self._stop_string: str | None = None
        self._finished = False

    # --- public API -------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """Output text so far (O(length): call it at the end, stream the deltas)."""
        return "".join(self._emitted) + self._held

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended generation, or None."""
        return self._stop_string

    @property
    def done(self) -> bool:
        """True once a stop string matched or `finish()` ran; `push` is then an error."""
        return self._stop_string is not None or self._finished

    def push(self, token_id: int) -> DetokenizerStep:
        """Add one generated token; returns the text that became safe to stream."""
        if self.done:
            raise RuntimeError(
                f"push({token_id}) after the detokenizer ended "
                f"(stop_string={self._stop_string!r}, finished={self._finished})"
            )
        token_id = int(token_id)
        if token_id in self._special:
            return DetokenizerStep(delta_text="", stop_string=None)
        self._ids.append(token_id)

        prefix_text = self._window_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet, or the last character may still be incomplete.
            return DetokenizerStep(delta_text="", stop_string=None)
        piece = new_text[len(prefix_text) :]
        self._advance_window()
        return self._add_text(piece, final=False)

    def finish(self) -> str:
        """Flush the incomplete character (as decode renders it) and held-back text; returns the delta."""
        if self.done:
            return ""
        piece = ""
        if self._read_offset < len(self._ids):
            prefix_text = self._window_prefix_text()
            new_text = self._decode(self._ids[self._prefix_offset :])
            piece = new_text[len(prefix_text) :]
            self._advance_window()
        step = self._add_text(piece, final=True)
        self._finished = True
        return step.delta_text

    # --- internals --------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special)

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _advance_window(self) -> None:
        """Everything decoded so far is now emitted text; the window starts at the old read offset."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _COMPACT_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _add_text(self, piece: str, final: bool) -> DetokenizerStep:
        """Append newly decoded text, apply stop strings, emit what is safe."""
        buf = self._held + piece
        match_at, match = _earliest_stop(buf, self._stops)
        if match is not None:
            delta = buf[:match_at]
            self._held = ""
            self._stop_string = match
        elif final:
            delta = buf
            self._held = ""
        else:
            keep = _stop_prefix_suffix_len(buf, self._stops)
            delta = buf[: len(buf) - keep]
            self._held = buf[len(buf) - keep :]
        if delta:
            self._emitted.append(delta)
        return DetokenizerStep(delta_text=delta, stop_string=match)


def _earliest_stop(text: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """(index, stop) of the earliest stop-string match in text; ties go to the first listed."""
    best_at, best = -1, None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best_at):
            best_at, best = at, stop
    return best_at, best


def _stop_prefix_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
