"""A deterministic BPE trainer: the same words give the same merges in every process.

``tokenizers``' own trainers (BpeTrainer, WordPieceTrainer) are not: they number some symbols
in hash-map order and break ties between equally frequent pairs by those numbers, so two runs
on the same text gave different merges from the 21st on (seen with tokenizers 0.23.3; the
upstream issue is huggingface/tokenizers#1794). Here ties go to the lexicographically
smallest pair and nothing depends on iteration order, so a recipe's tokenizer is the same
everywhere; ``tokenizers`` still pre-tokenizes the text (the words are exactly those its
pre-tokenizer makes) and runs the result (``models.BPE`` / ``models.WordPiece`` from the
vocabulary and merges).

The classic incremental algorithm: pair counts and, for each pair, the words it occurs in;
each merge rewrites only those words; a heap keyed by (-count, pair) with stale entries
skipped. Bounded by the merges asked for; tiny (2 k) trains in about a second, 16 k in tens.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable

Pair = tuple[str, str]


def count_words(texts: Iterable[str], pre_tokenize) -> Counter[str]:
    """How often each pre-token occurs (``pre_tokenize(text)`` gives ``(piece, offsets)``, as
    a ``tokenizers`` pre-tokenizer's ``pre_tokenize_str``)."""
    words: Counter[str] = Counter()
    for text in texts:
        words.update(piece for piece, _ in pre_tokenize(text))
    return words


def train(
    words: Counter[str], size: int, prefix: str = "", initial: Iterable[str] = ()
) -> tuple[list[str], list[Pair]]:
    """Merges learned from ``words`` until there are ``size`` tokens (fewer if every word is
    whole first): returns the tokens in id order (the starting symbols sorted: ``initial``
    and every character of the words, which with ``prefix``, WordPiece's ``##``, the
    non-initial ones carry; then each new merge result) and the merges in order (two merges
    may make the same token; it is numbered once, as tokenizers' trainer does)."""
    ordered = sorted(words.items())
    symbols = [[w[0], *(prefix + c for c in w[1:])] if prefix else list(w) for w, _ in ordered]
    freqs = [f for _, f in ordered]
    tokens = sorted({*initial, *(s for word in symbols for s in word)})
    known = set(tokens)
    counts: dict[Pair, int] = defaultdict(int)
    where: dict[Pair, set[int]] = defaultdict(set)
    for i, word in enumerate(symbols):
        for pair in itertools.pairwise(word):
            counts[pair] += freqs[i]
            where[pair].add(i)
    heap = [(-c, a, b) for (a, b), c in counts.items()]
    heapq.heapify(heap)
    learned: list[Pair] = []
    while heap and len(tokens) < size:
        negative, a, b = heapq.heappop(heap)
        if counts.get((a, b), 0) != -negative or negative >= 0:
            continue  # stale: the pair's count changed since this entry was pushed
        learned.append((a, b))
        joined = a + (b[len(prefix) :] if prefix else b)
        if joined not in known:
            known.add(joined)
            tokens.append(joined)
        changed: set[Pair] = set()
        for i in sorted(where.pop((a, b))):
            old = symbols[i]
            new = _merge(old, a, b, joined)
            for pair in itertools.pairwise(old):
                counts[pair] -= freqs[i]
                where[pair].discard(i)
                changed.add(pair)
            for pair in itertools.pairwise(new):
                counts[pair] += freqs[i]
                where[pair].add(i)
                changed.add(pair)
            symbols[i] = new
        counts.pop((a, b), None)
        changed.discard((a, b))
        for pair in sorted(changed):
            if counts[pair] > 0:
                heapq.heappush(heap, (-counts[pair], *pair))
    return tokens, learned


def _merge(word: list[str], a: str, b: str, joined: str) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out
