"""``<think>...</think>`` reasoning (Qwen3, QwQ, DeepSeek-R1).

Where the reasoning begins: a model may write ``<think>`` as its answer's first text (Qwen3),
or its template opens it at the end of the prompt (DeepSeek-R1's ``<think>\\n``), so the answer
begins inside it; :meth:`Think.opened` reads the prompt's end. Reasoning ends at ``</think>``;
an answer that never closes it is reasoning only (cut by ``max_tokens``, as vLLM splits it).
Qwen3 with ``enable_thinking`` false renders an empty ``<think></think>`` in the prompt: the
answer is content from its first token.

:class:`Splitter` streams: text that may still become a marker is held back (at most the
marker's length), so a streamed answer's reasoning and content join to the same as the whole
answer's, and no marker reaches either. The whitespace just after ``</think>`` (Qwen3 writes
two newlines) is not content.
"""

from __future__ import annotations

__all__ = ["Splitter", "Think"]


class Think:
    """The ``<think>`` family's markers, and where a prompt leaves the answer."""

    name = "think"
    start = "<think>"
    end = "</think>"

    def opened(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_tail`` leaves the answer inside reasoning."""
        at = prompt_tail.rfind(self.start)
        return at >= 0 and self.end not in prompt_tail[at:]

    def splitter(self, opened: bool) -> Splitter:
        return Splitter(self.start, self.end, opened)


class Splitter:
    """One answer's text in, ``(reasoning, content)`` pieces out, as it streams."""

    def __init__(self, start: str, end: str, opened: bool) -> None:
        self.start, self.end = start, end
        #: "start" (the answer may open reasoning), "in", "after" (whitespace after the end
        #: dropped), "out"
        self.state = "in" if opened else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._drain(False)

    def finish(self) -> tuple[str, str]:
        return self._drain(True)

    @property
    def reasoning(self) -> bool:
        """Still inside reasoning (or before it may open)."""
        return self.state in ("start", "in")

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._buf:
            buf = self._buf
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(self.start):
                    self.state, self._buf = "in", stripped[len(self.start) :]
                    continue
                if not final and self.start.startswith(stripped):
                    break
                self.state = "out"
            elif self.state == "in":
                at = buf.find(self.end)
                if at >= 0:
                    reasoning.append(buf[:at])
                    self.state, self._buf = "after", buf[at + len(self.end) :]
                    continue
                hold = 0 if final else _held(buf, self.end)
                reasoning.append(buf[: len(buf) - hold])
                self._buf = buf[len(buf) - hold :]
                break
            elif self.state == "after":
                self._buf = buf.lstrip()
                if self._buf:
                    self.state = "out"
            else:
                content.append(buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)


def _held(text: str, marker: str) -> int:
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
