"""``plugserve bench --protocol openai``: a generative model's tokens/s, time to first token and
inter-token latency against a running server's OpenAI API, at several concurrencies.

At each concurrency C, C client threads each keep one streaming request in flight (a closed
loop, as vLLM's and genai-perf's concurrency mode): each request asks for ``--max-tokens``
tokens with ``ignore_eos`` (so every request generates the same number, whatever the model
says) and ``stream_options.include_usage`` (the server's own token counts). Per request it
records the time to the first streamed token (TTFT), the gaps between streamed chunks
(inter-token latency, ITL: the engine sends one chunk per token, more tokens in one chunk only
while a stop string may be starting) and the whole request (end to end). Per concurrency the
report gives output tokens/s (generated tokens over the level's wall time), requests/s and
percentiles of each latency.

The client needs nothing beyond the standard library (``http.client``: one keep-alive
connection per thread, server-sent events read line by line), so a benchmark measures the
server, not a client library's overhead.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "GenerationRunner",
    "StreamTiming",
    "measure_level",
    "parse_counts",
    "prompt_text",
    "summarize_level",
]

#: words the synthetic prompts are made of (seeded order): common English, so any trained
#: tokenizer splits them into a few tokens each
_TEXT = (
    "the of and to in is was for on that with as by at from his an were are which this be "
    "has had one not but have its new after also their first two more other time been who "
    "all into than some would only most over any when made may can many such year these "
    "then state under city where about between both while people during world three used "
    "known well part four later work however since number high around same until life "
    "before several long early many since water music house game power small school place"
)
_WORDS = _TEXT.split()


def parse_counts(text: str) -> list[int]:
    """``--concurrency 1,4,8``: the levels, each >= 1."""
    try:
        counts = [int(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise SystemExit(
            f"plugserve bench: --concurrency {text!r}: integers, comma-separated"
        ) from None
    if not counts or any(c < 1 for c in counts):
        raise SystemExit(f"plugserve bench: --concurrency {text!r}: each must be >= 1")
    return counts


def prompt_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclasses.dataclass
class StreamTiming:
    """One streamed request: seconds from sending to its first token, between its chunks, to
    its end; the tokens it generated (the server's usage) and any error."""

    ttft: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


class GenerationRunner:
    """Sends one streaming completion or chat request and times its events."""

    def __init__(
        self,
        url: str,
        model: str,
        prompt: str,
        max_tokens: int,
        endpoint: str = "completions",
        token: str | None = None,
        timeout: float = 600.0,
        temperature: float = 0.0,
    ) -> None:
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        self.https = parsed.scheme == "https"
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or (443 if self.https else 80)
        base = parsed.path.rstrip("/") or "/v1"
        self.path = f"{base}/chat/completions" if endpoint == "chat" else f"{base}/completions"
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": temperature,
        }
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        self.body = json.dumps(body).encode()
        self.headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if token:
            self.headers["authorization"] = f"Bearer {token}"
        self.timeout = timeout
        self.chat = endpoint == "chat"
        self._local = threading.local()
        self.description = f"openai {url} {model} {endpoint}"

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = kind(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def run(self) -> StreamTiming:
        timing = StreamTiming()
        start = time.perf_counter()
        last = 0.0
        try:
            conn = self._connection()
            conn.request("POST", self.path, self.body, self.headers)
            response = conn.getresponse()
            if response.status != 200:
                timing.error = f"HTTP {response.status}: {response.read()[:300]!r}"
                return timing
            while True:
                line = response.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    timing.error = str(event["error"].get("message", event["error"]))
                    break
                usage = event.get("usage")
                if usage:
                    timing.tokens = int(usage.get("completion_tokens", 0))
                    timing.prompt_tokens = int(usage.get("prompt_tokens", 0))
                for choice in event.get("choices") or ():
                    text = (
                        (choice.get("delta") or {}).get("content")
                        if self.chat
                        else (choice.get("text"))
                    )
                    if text:
                        now = time.perf_counter()
                        if last:
                            timing.itls.append(now - last)
                        else:
                            timing.ttft = now - start
                        last = now
            response.read()  # the connection is reused: the body must be consumed
        except (OSError, http.client.HTTPException, ValueError) as exc:
            timing.error = f"{type(exc).__name__}: {exc}"
            conn = getattr(self._local, "conn", None)
            if conn is not None:
                conn.close()
            self._local.conn = None
        timing.e2e = time.perf_counter() - start
        return timing

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()


def measure_level(
    runner: GenerationRunner,
    concurrency: int,
    requests: int | None = None,
    duration: float | None = None,
    progress: bool = True,
) -> tuple[list[StreamTiming], float]:
    """``concurrency`` threads, each sending one request after another, until ``requests``
    were sent or ``duration`` seconds passed (requests in flight then finish); the timings
    and the wall time."""
    lock = threading.Lock()
    sent = [0]
    done: list[StreamTiming] = []
    end = time.perf_counter() + duration if duration is not None else float("inf")

    def claim() -> bool:
        with lock:
            if requests is not None and sent[0] >= requests:
                return False
            if time.perf_counter() >= end:
                return False
            sent[0] += 1
            return True

    def worker() -> None:
        while claim():
            timing = runner.run()
            with lock:
                done.append(timing)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if progress:
        print(f"concurrency {concurrency}: {len(done)} requests in {wall:.1f} s", file=sys.stderr)
    return done, wall


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {k: float("nan") for k in ("p50", "p90", "p99", "mean")}
    ms = 1e3 * np.asarray(values)
    return {
        "p50": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
        "mean": float(ms.mean()),
    }


def summarize_level(concurrency: int, timings: list[StreamTiming], wall: float) -> dict[str, Any]:
    ok = [t for t in timings if not t.error]
    tokens = sum(t.tokens for t in ok)
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "errors": len(timings) - len(ok),
        "first_error": next((t.error for t in timings if t.error), ""),
        "duration_s": wall,
        "output_tokens": tokens,
        "prompt_tokens_mean": float(np.mean([t.prompt_tokens for t in ok])) if ok else 0.0,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_ms": _percentiles([t.ttft for t in ok]),
        "itl_ms": _percentiles([gap for t in ok for gap in t.itls]),
        "e2e_ms": _percentiles([t.e2e for t in ok]),
    }
