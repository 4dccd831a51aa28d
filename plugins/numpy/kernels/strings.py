"""String ops (object arrays of str at run time).

String tensors have no vectorized numpy arithmetic worth using, so these kernels map Python
string functions over object arrays with ``np.frompyfunc``; the cost is per element but these
ops only see short pre/post-processing tensors.
"""

from __future__ import annotations

import itertools
import operator
import re

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register

try:  # RE2, ONNX's regex syntax, in linear time (see regex_full_match)
    import re2 as _regex

    _QUIET = _regex.Options()
    _QUIET.log_errors = False  # (RE2 logs a bad pattern to stderr: a client's text, newlines
    # and all; a query of 20,000 bad patterns wrote 180,000 lines, forged ones among them)
except ImportError:  # pragma: no cover - the bindings are a dependency
    _regex = re
    _QUIET = None


def _compiled(pattern: str):
    """``pattern`` compiled by RE2 without logging, or by ``re`` where RE2 is not installed."""
    return _regex.compile(pattern, _QUIET) if _QUIET is not None else _regex.compile(pattern)


_concat = np.frompyfunc(operator.add, 2, 1)


@register("StringConcat", 20)
def string_concat(ctx: KernelContext):
    def run(a, b):
        out = _concat(a.astype(object, copy=False), b.astype(object, copy=False))
        return np.asarray(out, dtype=object)

    return run


@register("StringNormalizer", 10)
def string_normalizer(ctx: KernelContext):
    """Stop-word filtering then case change, on a [C] or [1, C] tensor.

    Case-insensitive stop-word matching compares ``str.casefold`` forms; the ``locale``
    attribute is not consulted (Python's case mapping is locale-independent Unicode).
    """
    action = ctx.attr("case_change_action", "NONE")
    if action not in ("NONE", "LOWER", "UPPER"):
        raise ctx.unsupported(f"case_change_action {action!r}")
    sensitive = bool(ctx.attr("is_case_sensitive", 0))
    stopwords = list(ctx.attr("stopwords", []) or [])
    stops = set(stopwords) if sensitive else {w.casefold() for w in stopwords}
    change = {"NONE": None, "LOWER": str.lower, "UPPER": str.upper}[action]

    def run(x):
        two_d = x.ndim == 2
        if two_d and x.shape[0] != 1:
            raise ValueError(f"input must be [C] or [1, C], got {x.shape}")
        words = [str(w) for w in x.ravel()]
        if stops:
            if sensitive:
                words = [w for w in words if w not in stops]
            else:
                words = [w for w in words if w.casefold() not in stops]
        if change is not None:
            words = [change(w) for w in words]
        if not words:
            words = [""]
        out = np.empty(len(words), dtype=object)
        out[:] = words
        return out.reshape(1, -1) if two_d else out

    return run


@register("StringSplit", 20, multi_output=True)
def string_split(ctx: KernelContext):
    """Split every string; pad the last axis to the longest split with empty strings.

    An absent or empty ``delimiter`` splits on runs of whitespace (Python's ``str.split()``).
    """
    delimiter = ctx.attr("delimiter", "") or None
    maxsplit = ctx.attr("maxsplit", -1)
    if maxsplit is None:
        maxsplit = -1

    def run(x):
        parts = [str(s).split(delimiter, maxsplit) for s in x.ravel()]
        width = max((len(p) for p in parts), default=0)
        out = np.full((len(parts), width), "", dtype=object)
        for i, p in enumerate(parts):
            out[i, : len(p)] = p
        counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
        return out.reshape(*x.shape, width), counts

    return run


@register("RegexFullMatch", 20)
def regex_full_match(ctx: KernelContext):
    """Full-match each string against ``pattern`` with RE2 (``google-re2``), as ONNX specifies.

    RE2 matches in time linear in the string: Python's ``re`` backtracks, and a pattern such
    as ``(a+)+$`` against 30 ``a`` and a ``!`` holds the GIL for minutes, where the strings
    are a client's (a request's), or the whole node is (a model a client sends to
    QueryNetwork, whose constants NUMPY folds). A pattern RE2 does not take (backreferences,
    lookaround: Python-only syntax) leaves the node unsupported. Where the RE2 bindings are not
    installed, Python's ``re`` stands in.
    """
    pattern = ctx.attr("pattern")
    try:
        compiled = _compiled(pattern)
    except Exception as exc:  # re.error, re2.error: the pattern is not one the engine takes
        raise ctx.unsupported(f"pattern {pattern!r}: {exc}") from exc
    match = np.frompyfunc(lambda s: compiled.fullmatch(str(s)) is not None, 1, 1)

    def run(x):
        return np.asarray(match(x), dtype=bool).reshape(x.shape)

    return run


@register("TfIdfVectorizer", 9)
def tfidf_vectorizer(ctx: KernelContext):
    """Count pool n-grams (optionally with skips) per row of a [C] or [N, C] token tensor.

    The builder turns the pool into a dict from token tuples to n-gram numbers, keeping only
    n-grams with ``min_gram_length <= n <= max_gram_length``. A request zips shifted column
    slices into n-gram tuples, looks them up with ``dict.get`` and histograms the hits into
    output columns with one ``np.bincount``.

    Skips follow onnxruntime: an n-gram with skip distance ``d`` takes tokens ``i, i+d, ...``
    for ``d = 1 .. max_skip_count + 1``; unigrams are counted once, not once per distance.
    ``weights[i]`` belongs to the i-th pool n-gram, as the spec says and onnxruntime (1.31)
    does (the ONNX reference indexes it by output column instead; they agree when
    ``ngram_indexes`` is the identity). IDF with two differently weighted n-grams sharing an
    output column depends on scan order in onnxruntime and is refused.
    """
    mode = ctx.attr("mode")
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ctx.unsupported(f"mode {mode!r}")
    min_n = int(ctx.attr("min_gram_length"))
    max_n = int(ctx.attr("max_gram_length"))
    max_skip = int(ctx.attr("max_skip_count"))
    if min_n < 1 or max_n < min_n or max_skip < 0:
        raise ctx.unsupported(f"gram lengths {min_n}..{max_n} with max_skip_count {max_skip}")
    counts = [int(c) for c in ctx.attr("ngram_counts")]
    indexes = [int(i) for i in ctx.attr("ngram_indexes")]
    if not indexes or min(indexes) < 0:
        raise ctx.unsupported("ngram_indexes must be non-empty and non-negative")
    pool_ints = list(ctx.attr("pool_int64s", []) or [])
    pool_strs = list(ctx.attr("pool_strings", []) or [])
    if bool(pool_ints) == bool(pool_strs):
        raise ctx.unsupported("exactly one of pool_int64s and pool_strings must be given")
    pool = [int(v) for v in pool_ints] if pool_ints else [str(v) for v in pool_strs]
    dtype = ctx.input_dtype(0)
    if dtype is not None:
        is_str = dtype.kind in "OUS"
        if is_str != bool(pool_strs) or (not is_str and dtype not in (np.int32, np.int64)):
            raise ctx.unsupported(f"input dtype {dtype} with this pool")
    weights = list(ctx.attr("weights", []) or []) if mode != "TF" else []
    if weights and len(weights) != len(indexes):
        raise ctx.unsupported(f"{len(weights)} weights for {len(indexes)} ngram_indexes")

    # ngram_counts[k] is where the (k+1)-grams start in the pool; the running n-gram ordinal
    # (over all sizes, kept or not) selects the output column and the weight.
    table: dict[tuple, int] = {}
    ordinals: list[int] = []
    ordinal = 0
    for k, start in enumerate(counts):
        n = k + 1
        end = counts[k + 1] if k + 1 < len(counts) else len(pool)
        if not 0 <= start <= end <= len(pool) or (end - start) % n:
            raise ctx.unsupported(f"ngram_counts do not split the pool into whole {n}-grams")
        for pos in range(start, end, n):
            if min_n <= n <= max_n:
                if ordinal >= len(indexes):
                    raise ctx.unsupported("ngram_indexes is shorter than the pool's n-grams")
                table[tuple(pool[pos : pos + n])] = len(ordinals)
                ordinals.append(ordinal)
            ordinal += 1
    width = max(indexes) + 1
    cols = np.array([indexes[o] for o in ordinals], dtype=np.int64)
    sizes = sorted({len(key) for key in table})
    scans = [(n, d) for n in sizes for d in (range(1, max_skip + 2) if n > 1 else (1,))]

    hit_weights = col_weights = None
    if weights and mode == "TFIDF":
        hit_weights = np.array([weights[o] for o in ordinals], dtype=np.float64)
    elif weights:
        col_weights = np.zeros(width, dtype=np.float32)
        seen: dict[int, float] = {}
        for o in ordinals:
            w = np.float32(weights[o])
            if seen.setdefault(indexes[o], w) != w:
                raise ctx.unsupported("IDF n-grams with different weights share an output column")
            col_weights[indexes[o]] = w
    lookup = table.get

    def run(x):
        if x.ndim > 2:
            raise ValueError(f"input must be [C] or [N, C], got {x.shape}")
        rows = x.reshape(1, -1) if x.ndim < 2 else x
        n_rows, n_cols = rows.shape
        found = []
        for n, d in scans:
            length = n_cols - (n - 1) * d
            if length <= 0 or n_rows == 0:
                continue
            parts = [rows[:, k * d : k * d + length].ravel().tolist() for k in range(n)]
            hits = np.fromiter(
                map(lookup, zip(*parts), itertools.repeat(-1)), np.int64, n_rows * length
            ).reshape(n_rows, length)
            row_of = np.broadcast_to(np.arange(n_rows, dtype=np.int64)[:, None], hits.shape)
            mask = hits >= 0
            found.append((row_of[mask], hits[mask]))
        if found:
            row_ids = np.concatenate([r for r, _ in found])
            ngrams = np.concatenate([g for _, g in found])
        else:
            row_ids = ngrams = np.empty(0, np.int64)
        flat = row_ids * width + cols[ngrams]
        size = n_rows * width
        if hit_weights is not None:
            y = np.bincount(flat, hit_weights[ngrams], minlength=size).astype(np.float32)
        else:
            y = np.bincount(flat, minlength=size).astype(np.float32)
        y = y.reshape(n_rows, width)
        if mode == "IDF":
            y = (y > 0).astype(np.float32)
            if col_weights is not None:
                y *= col_weights
        return y if x.ndim == 2 else y.reshape(width)

    return run


@register("Tokenizer", 1, domain="com.microsoft")
def tokenizer(ctx: KernelContext):
    """onnxruntime's contrib Tokenizer (skl2onnx emits it for text pipelines): each string is
    split into tokens by ``tokenexp`` matches, by ``separators`` (regular expressions; ``[""]``
    means characters), tokens shorter than ``mincharnum`` are dropped, ``mark`` wraps each row
    in 0x02 / 0x03, and rows are padded with ``pad_value`` to the longest. A batch in which no
    string has a token gives a last dimension of 0, as onnxruntime does."""
    mark = bool(ctx.attr("mark"))
    shortest = max(int(ctx.attr("mincharnum")), 1)
    pad = ctx.attr("pad_value")
    separators = [s.decode() if isinstance(s, bytes) else s for s in ctx.attr("separators", [])]
    expression = ctx.attr("tokenexp", "")
    try:
        if expression and separators:
            raise ctx.unsupported("give tokenexp or separators, not both")
        if expression:
            found = _compiled(expression)  # (RE2, as onnxruntime's Tokenizer)

            def split(text: str) -> list[str]:
                return [m.group(0) for m in found.finditer(text)]
        elif separators == [""]:
            if shortest > 1:
                raise ctx.unsupported("mincharnum > 1 with character tokenization")
            split = list
        elif separators:
            between = _compiled("|".join(f"(?:{s})" for s in separators))
            split = between.split
        else:
            raise ctx.unsupported("neither tokenexp nor separators is given")
    except (re.error, getattr(_regex, "error", re.error)) as exc:
        raise ctx.unsupported(f"pattern: {exc}") from exc

    def run(x):
        rows = [[t for t in split(str(s)) if len(t) >= shortest] for s in x.ravel().tolist()]
        width = max((len(r) for r in rows), default=0)
        if width == 0:
            return np.empty((*x.shape, 0), dtype=object)
        if mark:
            rows = [["\x02", *r, "\x03"] for r in rows]
            width += 2
        out = np.full((len(rows), width), pad, dtype=object)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out.reshape(*x.shape, width)

    return run
