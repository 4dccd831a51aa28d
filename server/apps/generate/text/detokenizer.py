"""Text of a sequence as its tokens arrive, with stop strings found and held back.

Decoding the whole sequence again at every token costs O(n) per token (O(n^2) a sequence);
decoding each token alone is wrong (a character split across byte tokens, a SentencePiece
word's leading space). ``tokenizers``' ``DecodeStream`` keeps the few tokens a character can
span and returns only the new text: O(1) per token, in Rust. It is primed with the prompt's
last tokens (:data:`PRIMING`) so the first generated token decodes as a continuation (" cat",
not "cat"), as vLLM's fast incremental detokenizer does.

Stop strings (OpenAI's ``stop``): each is followed through the text by a Knuth-Morris-Pratt
automaton (:class:`StopScan`): its state is the longest beginning of the stop string that the
text ends with, so a token costs each stop string the new characters (amortized: a state
falls back at most as far as it went), whatever the length of the text or of the stop
strings. The first stop string completed ends the sequence (the earliest to begin, when one
token completes several) and the text is cut before it (or after it with
``include_stop_str_in_output``). While streaming, the longest end of the text that could still
grow into a stop string (the largest state: ``"Hel"`` while ``"Hello"`` is a stop string) is
held back, and released when the next token shows it is not one, or when the sequence ends.

Byte-level tokenizers (GPT-2's ``ByteLevel`` decoder: Llama 3, Qwen, GPT-2, Mistral's newer
ones) decode without context: a sequence's text is its tokens' bytes, concatenated and read as
UTF-8. For them the stream is this module's own (:func:`byte_pieces`: each id's bytes, made
once per tokenizer and checked against its ``decode``): a token appends its bytes to those
not yet sent and the text comes out once they do not end in an incomplete or invalid
character (``DecodeStream``'s rule, so the pieces are the same), with no call into
``tokenizers``. ``DecodeStream.step`` decodes its window twice a token: 8 to 20 us a token on
this machine (the engine's largest cost per token after the forward on the torch device),
against about 1 us here.

At the end, a character the last tokens left incomplete is sent as decoding the whole sequence
gives it (U+FFFD), so the pieces add up to the decoded answer.

Bounds: the text kept is the sequence's own (at most its max_tokens' worth), appended as
pieces (no copy of the text per token); what a token costs is its own characters times the
stop strings (at most ``types.MAX_STOP``, 16), plus the characters held back (at most the
longest stop string, ``types.MAX_STOP_CHARS``) when they are sent. Measured on this machine
with 16 stop strings of 1,024 characters and tokens of 4 characters: 5.1 us a token at the
start of an answer and 4.9 us after 100,000 characters; the scan it replaces (every length of
every stop string tried against the text's end, and the text copied at each token) took
148 us and 1,672 us.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["PRIMING", "IncrementalDetokenizer", "StopScan", "byte_pieces"]

#: prompt tokens the stream is primed with (a character spans at most 4 byte tokens, and a
#: word's leading space depends on the token before it)
PRIMING = 6


def _failure(pattern: str) -> list[int]:
    """Knuth-Morris-Pratt's table: for each length q of a matched beginning, the length of
    its longest proper border (what the match falls back to when the next character does
    not continue it)."""
    table = [0] * len(pattern)
    k = 0
    for q in range(1, len(pattern)):
        while k and pattern[q] != pattern[k]:
            k = table[k - 1]
        if pattern[q] == pattern[k]:
            k += 1
        table[q] = k
    return table


#: GPT-2's byte <-> printable character table, the characters' side (ByteLevel's alphabet)
def _byte_of_char() -> dict[str, int]:
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_PIECES: weakref.WeakKeyDictionary[Any, tuple[list[bytes], list[bytes]] | None] = (
    weakref.WeakKeyDictionary()
)


def byte_pieces(tokenizer: Any) -> tuple[list[bytes], list[bytes]] | None:
    """Each id's bytes when ``tokenizer``'s backend decodes byte-level (its decoder GPT-2's
    ``ByteLevel``): ``(with special tokens, with them empty)``, made once per tokenizer
    (the vocabulary's strings mapped through the byte table; an added token as its own
    ``decode``) and checked against ``decode`` on the added tokens and a spread of the
    vocabulary; None for any other decoder, or when a check fails (the
    ``DecodeStream`` is used then)."""
    try:
        return _PIECES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: made each time (tests' stand-ins)
        return _make_pieces(tokenizer.backend)
    _PIECES[tokenizer] = pieces = _make_pieces(tokenizer.backend)
    return pieces


def _make_pieces(backend: Any) -> tuple[list[bytes], list[bytes]] | None:
    from tokenizers import decoders

    if not isinstance(getattr(backend, "decoder", None), decoders.ByteLevel):
        return None
    table = _byte_of_char()
    size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    pieces: list[bytes] = []
    for i in range(size):
        if i in added:
            pieces.append(backend.decode([i], skip_special_tokens=False).encode())
            continue
        token = backend.id_to_token(i)
        if token is None:
            pieces.append(b"")
            continue
        try:
            pieces.append(bytes([table[c] for c in token]))
        except KeyError:
            pieces.append(token.encode())
    skipped = list(pieces)
    for i, token in added.items():
        if token.special and i < size:
            skipped[i] = b""
    checked = sorted({*added, *range(0, size, max(1, size // 2048))})
    for i in checked:
        for skip, table_ in ((False, pieces), (True, skipped)):
            want = backend.decode([i], skip_special_tokens=skip)
            if table_[i].decode("utf-8", "replace") != want:
                return None
    return pieces, skipped


class StopScan:
    """Stop strings followed through a text fed piece by piece."""

    __slots__ = ("_tables", "states", "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._tables = [_failure(s) for s in self.stops]
        #: per stop string, the longest beginning of it that the text ends with
        self.states = [0] * len(self.stops)

    def feed(self, piece: str, offset: int) -> tuple[int, str] | None:
        """Follow ``piece`` (which begins at character ``offset`` of the text): the start and
        the stop string of the first one it completes (the earliest to begin), or None."""
        found: tuple[int, str] | None = None
        for k, stop in enumerate(self.stops):
            table, q, size = self._tables[k], self.states[k], len(stop)
            for j, char in enumerate(piece):
                while q and stop[q] != char:
                    q = table[q - 1]
                if stop[q] == char:
                    q += 1
                if q == size:
                    start = offset + j + 1 - size
                    if found is None or start < found[0]:
                        found = (start, stop)
                    break
            self.states[k] = q
        return found

    def held(self) -> int:
        """Characters at the end of the text that could still become a stop string."""
        return max(self.states, default=0)


class IncrementalDetokenizer:
    """One sequence's text: :meth:`add` each generated token, :meth:`take` what may be sent."""

    __slots__ = (
        "_bytes",
        "_cut",
        "_held",
        "_ids",
        "_include_stop",
        "_length",
        "_pending",
        "_pieces",
        "_scan",
        "_sent",
        "_skip",
        "_stream",
        "_tail",
        "_tokenizer",
        "_unsent",
        "stop_reason",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer.backend
        tail = [int(i) for i in prompt_ids[-PRIMING:]]
        #: the byte-level stream's table (:func:`byte_pieces`) and its bytes not sent yet,
        #: or None: ``tokenizers``' DecodeStream
        self._bytes: list[bytes] | None = None
        self._held = b""
        self._stream: Any = None
        pieces = byte_pieces(tokenizer)
        if pieces is not None and _clean_end(pieces[skip_special_tokens], tail):
            self._bytes = pieces[skip_special_tokens]
        else:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=tail or None, skip_special_tokens=skip_special_tokens)
        self._tail = tail
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # the generated tokens
        self._pending = 0  # of them, how many the stream has not turned into text yet
        stops = [s for s in stop if s]
        self._scan = StopScan(stops) if stops else None
        self._include_stop = include_stop
        self._pieces: list[str] = []  # the text generated so far, as it came
        self._length = 0  # its characters
        self._cut = -1  # where a stop string cut it (-1: not cut)
        self._unsent = ""  # its end not sent yet
        self._sent = 0
        #: the stop string that ended the text, once found
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The text generated so far (cut at a stop string once one is found)."""
        text = "".join(self._pieces)
        return text[: self._cut] if self._cut >= 0 else text

    def add(self, token_id: int) -> bool:
        """Append one token's text; True when it completed a stop string (the text is then
        cut there and nothing more should be added)."""
        if self.stop_reason is not None:
            return True
        token_id = int(token_id)
        self._ids.append(token_id)
        table = self._bytes
        if table is not None:  # byte-level: the bytes not sent yet, out once they read whole
            held = self._held + (table[token_id] if 0 <= token_id < len(table) else b"")
            if held:
                piece = held.decode("utf-8", "replace")
                if piece[-1] != "\ufffd":
                    self._held = b""
                    self._pending = 0
                    return self._append(piece)
            self._held = held
            self._pending += 1
            return False
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            self._pending += 1
            return False
        self._pending = 0
        return self._append(piece)

    def _append(self, piece: str) -> bool:
        offset = self._length
        self._pieces.append(piece)
        self._length += len(piece)
        self._unsent += piece
        found = self._scan.feed(piece, offset) if self._scan is not None else None
        if found is None:
            return False
        at, stop = found
        self._cut = at + len(stop) if self._include_stop else at
        self._unsent = self._unsent[: max(0, self._cut - self._sent)]
        self._length = self._cut
        self.stop_reason = stop
        return True

    def take(self, final: bool = False) -> str:
        """The text not sent yet that may be sent now: all of it when ``final`` or once a
        stop string was found, else all but an end that could still become a stop string."""
        if final and self._pending and self.stop_reason is None:
            self._flush()
        end = self._length
        if not final and self.stop_reason is None and self._scan is not None:
            end -= self._scan.held()
        if end <= self._sent:
            return ""
        count = end - self._sent
        out, self._unsent = self._unsent[:count], self._unsent[count:]
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
        extra = decode([*context, *ids[cut:]], skip_special_tokens=self._skip)[len(before) :]
        self._pending = 0
        self._held = b""
        if extra:
            self._pieces.append(extra)
            self._length += len(extra)
            self._unsent += extra


def _clean_end(pieces: list[bytes], tail: list[int]) -> bool:
    """Whether the prompt's last tokens end on a whole character (the byte-level stream
    starts there; else ``DecodeStream``, whose prefix then holds the broken character)."""
    data = b"".join(pieces[i] if 0 <= i < len(pieces) else b"" for i in tail)
    return not data.decode("utf-8", "replace").endswith("\ufffd")
