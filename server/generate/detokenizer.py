"""Text of a sequence as its tokens arrive, with stop strings found and held back.

Decoding the whole sequence again at every token costs O(n) per token (O(n^2) a sequence);
decoding each token alone is wrong (a character split across byte tokens, a SentencePiece
word's leading space). ``tokenizers``' ``DecodeStream`` keeps the few tokens a character can
span and returns only the new text: O(1) per token, in Rust. It is primed with the prompt's
last tokens (:data:`PRIMING`) so the first generated token decodes as a continuation (" cat",
not "cat"), as vLLM's fast incremental detokenizer does.

Stop strings (OpenAI's ``stop``): after each token the new text, with the last
``len(stop) - 1`` characters before it, is searched for each stop string; the first match
ends the sequence and the text is cut before it (or after it with
``include_stop_str_in_output``). While streaming, the longest end of the text that could
still grow into a stop string is held back (``"Hel"`` while ``"Hello"`` is a stop string),
and released when the next token shows it is not one, or when the sequence ends.

At the end, a character the last tokens left incomplete is sent as decoding the whole sequence
gives it (U+FFFD), so the pieces add up to the decoded answer.

Bounds: the text kept is the sequence's own (at most its max_tokens' worth); each token costs
the stop strings' lengths squared at most (the adapter bounds their count and length).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PRIMING", "IncrementalDetokenizer"]

#: prompt tokens the stream is primed with (a character spans at most 4 byte tokens, and a
#: word's leading space depends on the token before it)
PRIMING = 6


class IncrementalDetokenizer:
    """One sequence's text: :meth:`add` each generated token, :meth:`take` what may be sent."""

    __slots__ = (
        "_ids",
        "_include_stop",
        "_pending",
        "_sent",
        "_skip",
        "_stops",
        "_stream",
        "_tail",
        "_tokenizer",
        "stop_reason",
        "text",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer.backend
        tail = [int(i) for i in prompt_ids[-PRIMING:]]
        self._stream = DecodeStream(ids=tail or None, skip_special_tokens=skip_special_tokens)
        self._tail = tail
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # the generated tokens
        self._pending = 0  # of them, how many the stream has not turned into text yet
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop
        #: the text generated so far (cut at a stop string once one is found)
        self.text = ""
        self._sent = 0
        #: the stop string that ended the text, once found
        self.stop_reason: str | None = None

    def add(self, token_id: int) -> bool:
        """Append one token's text; True when it completed a stop string (the text is then
        cut there and nothing more should be added)."""
        if self.stop_reason is not None:
            return True
        self._ids.append(int(token_id))
        piece = self._stream.step(self._tokenizer, int(token_id))
        if not piece:
            self._pending += 1
            return False
        self._pending = 0
        start = len(self.text)
        self.text += piece
        if self._stops:
            return self._find_stop(start)
        return False

    def _find_stop(self, start: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[: at + len(stop) if self._include_stop else at]
        self.stop_reason = stop
        return True

    def take(self, final: bool = False) -> str:
        """The text not sent yet that may be sent now: all of it when ``final`` or once a
        stop string was found, else all but an end that could still become a stop string."""
        if final and self._pending and self.stop_reason is None:
            self._flush()
        end = len(self.text)
        if not final and self.stop_reason is None and self._stops:
            end -= self._held()
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _flush(self) -> None:
        """The text of tokens the stream still holds (a character cut short by the end of
        the sequence), as decoding the whole sequence gives it ("\ufffd"): decoded after the
        :data:`PRIMING` tokens before them, not with the whole sequence (``decode`` holds the
        GIL: 84 ms for 128k ids here, on the engine's thread)."""
        decode = self._tokenizer.decode
        ids = [*self._tail, *self._ids]
        cut = len(ids) - self._pending
        context = ids[max(0, cut - PRIMING) : cut]
        before = decode(context, skip_special_tokens=self._skip)
        rest = decode([*context, *ids[cut:]], skip_special_tokens=self._skip)[len(before) :]
        self._pending = 0
        self.text += rest

    def _held(self) -> int:
        """Characters at the end of the text that are a proper beginning of a stop string."""
        text = self.text
        held = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held
