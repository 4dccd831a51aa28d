"""A structured-output grammar that waits for the reasoning to end.

A reasoning model thinks first (``<think>...</think>``) and answers after: a grammar applied
from the first token would forbid the thinking (the model is made to write ``{`` at once). The
gate lets every token through while the sequence reasons (but the end-of-sequence ones: an
answer must follow), and hands each token after the end marker to the grammar, which then
masks and ends the sequence as it would alone. Before anything is written the first token may
be the grammar's or the start marker (when the marker is one token, as Qwen3's and
DeepSeek-R1's ``<think>`` are): a model that does not think is held to the grammar from its
first token.

The end is found in the tokens' bytes (``TokenNames``, the logprobs' table), so an end marker
split over several tokens is found too; at most the marker's length is kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ReasoningGate"]


class ReasoningGate:
    """``inner`` (a grammar's constraint) once the reasoning has ended; see the module."""

    def __init__(
        self,
        inner: Any,
        names: Any,
        start_id: int | None,
        end: str,
        eos_ids: tuple[int, ...],
        opened: bool,
    ) -> None:
        self.inner = inner
        self._names = names
        self._start_id = start_id
        self._end = end.encode()
        self._eos = np.fromiter(eos_ids, dtype=np.int64) if eos_ids else None
        #: "start" (reasoning may open), "in" (reasoning), "out" (the grammar's)
        self.state = "in" if opened else "start"
        self._tail = b""

    def mask(self, vocab_size: int) -> np.ndarray:
        if self.state == "out":
            return self.inner.mask(vocab_size)
        if self.state == "start":
            allowed = np.array(self.inner.mask(vocab_size), dtype=bool)
            if self._start_id is not None and self._start_id < vocab_size:
                allowed[self._start_id] = True
            return allowed
        allowed = np.ones(vocab_size, dtype=bool)
        if self._eos is not None:
            allowed[self._eos[self._eos < vocab_size]] = False
        return allowed

    def accept(self, token_id: int) -> bool:
        if self.state == "out":
            return self.inner.accept(token_id)
        if self.state == "start":
            if token_id != self._start_id:
                self.state = "out"
                return self.inner.accept(token_id)
            self.state = "in"
            return True
        data = self._tail + self._names.get(int(token_id))[0]
        if self._end in data:
            self.state = "out"
        self._tail = data[-(len(self._end) - 1) :]
        return True

    def done(self) -> bool:
        return self.state == "out" and self.inner.done()

    @property
    def error(self) -> str:
        return getattr(self.inner, "error", "")
