"""``/v1/embeddings``: a sentence-transformers folder's encoder, run through the data plane.

A repository entry whose folder holds a sentence-transformers model (``modules.json``, its
``1_Pooling/config.json``, optionally ``sentence_bert_config.json``) beside an ONNX export of
its transformer (optimum's ``model.onnx``, at the top or under ``onnx/``) and the tokenizer's
``tokenizer.json`` serves embeddings. The encoder is a plain network on whatever device the
entry names (the data plane admits, runs, budgets and counts its runs as any other); this
module does what sentence-transformers does around it: tokenize (the tokenizer's own
post-processor adds [CLS]/[SEP]), pad a batch, pool the token embeddings the way
``1_Pooling/config.json`` says (CLS, mean, max, mean-sqrt-len, last token; several modes
concatenated in sentence-transformers' order) and normalize when ``modules.json`` has a
``Normalize`` module. A ``Dense`` module (its weights are PyTorch's, not in the ONNX export)
is refused at the first request with what to do.

Bounds: an input longer than the model's ``max_seq_length`` (``sentence_bert_config.json``,
else the tokenizer's ``model_max_length``, else the config's ``max_position_embeddings``) is a
400 naming it (sentence-transformers would cut it silently), refused before it is tokenized
when its text is longer than that many of its longest tokens could be
(``server/apps/generate/limits.py``); inputs are tokenized on the adapter's workers, their memory
charged to --max-inflight-bytes first; inputs run in batches of at most
:data:`BATCH_TOKENS` padded tokens, sorted by length so little is padding; each run's
outputs are charged to --max-inflight-bytes as it is admitted. ``dimensions`` shortens each
vector (the first ``dimensions`` values, normalized again when the model normalizes: how
OpenAI's and Matryoshka models read it).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from plugserve.plugins.api import InvalidModel
from plugserve.server.apps.generate import limits
from plugserve.server.plane.errors import FieldError
from plugserve.server.plane.request import Request

if TYPE_CHECKING:
    from plugserve.server.protocols.openai.protocol import EmbeddingRequest

__all__ = ["BATCH_TOKENS", "Encoder", "embed", "encoder_graph", "encoder_of", "is_encoder"]

#: padded tokens per encoder run, at most (a 32-input batch of 256 tokens)
BATCH_TOKENS = 8192
#: characters of text tokenized at once, at least one input (a valid request's whole inputs
#: are a few hundred KB: one or a few slices; an input over the model's length stops the rest)
TOKENIZE_SLICE_BYTES = 256 << 10
_LANE = "openai.embeddings"
#: token embeddings of more values are pooled on the adapter's worker threads (about a
#: millisecond of the event loop's time, at most)
_INLINE_VALUES = 1 << 18
_MODULE = "sentence_transformers.models."
#: sentence-transformers' pooling modes, in the order it concatenates them
_MODES = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ("pooling_mode_lasttoken", "lasttoken"),
)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidModel(f"{path}: cannot read it as JSON ({exc})") from None


def _folder_of(model_file: Path) -> Path | None:
    """The sentence-transformers folder a model file belongs to (its own folder, or the one
    above an ``onnx/`` folder), if it is one."""
    for folder in (model_file, model_file.parent, model_file.parent.parent):
        if (folder / "modules.json").is_file():
            return folder
    return None


def encoder_graph(folder: str | Path) -> Path | None:
    """The encoder graph of a sentence-transformers folder (``modules.json`` beside a
    transformers folder's graph): the model folder is then loaded as that plain network, and
    this module does the rest at each request; None for any other folder (a decoder's)."""
    from plugserve.server.apps.generate.folder import graph_of

    folder = Path(folder)
    if not (folder / "modules.json").is_file():
        return None
    found = graph_of(folder)
    if found is None or found[0] != "onnx":
        return None
    return found[1]


class Encoder:
    """What sentence-transformers does around the encoder, read from its folder."""

    def __init__(self, folder: Path, input_names: list[str]) -> None:
        from plugserve.server.apps.generate.text.tokenizer import Tokenizer

        modules = _read(folder / "modules.json")
        if not isinstance(modules, list):
            raise InvalidModel(f"{folder / 'modules.json'}: expected a list of modules")
        kinds = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        unsupported = [k for k in kinds if k.removeprefix(_MODULE) not in (
            "Transformer", "Pooling", "Normalize"
        )]  # fmt: skip
        if unsupported:
            raise InvalidModel(
                f"{folder}: modules {unsupported} are not supported (their weights are not in "
                "the ONNX export); serve a model made of Transformer, Pooling and Normalize"
            )
        pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
        if pooling is None:
            raise InvalidModel(f"{folder}: modules.json has no Pooling module")
        config = _read(folder / str(pooling.get("path", "1_Pooling")) / "config.json")
        self.modes = [name for key, name in _MODES if config.get(key)]
        if config.get("pooling_mode_weightedmean_tokens"):
            raise InvalidModel(f"{folder}: weighted-mean pooling is not supported")
        if not self.modes:
            raise InvalidModel(f"{folder}: 1_Pooling/config.json turns on no pooling mode")
        self.normalize = any(k.endswith("Normalize") for k in kinds)
        self.tokenizer = Tokenizer.from_folder(folder)
        # a tokenizer.json may cut or pad by itself (sentence-transformers saves them so):
        # an input over the model's length is refused here instead, and batches padded here
        self.tokenizer.backend.no_truncation()
        self.tokenizer.backend.no_padding()
        bert = folder / "sentence_bert_config.json"
        settings = _read(bert) if bert.is_file() else {}
        self.lower = bool(settings.get("do_lower_case"))
        limit = settings.get("max_seq_length")
        if not isinstance(limit, int):
            tokenizer_config = folder / "tokenizer_config.json"
            limit = (_read(tokenizer_config) if tokenizer_config.is_file() else {}).get(
                "model_max_length"
            )
        if not isinstance(limit, int) or limit > 1 << 20:
            hf = folder / "config.json"
            limit = (_read(hf) if hf.is_file() else {}).get("max_position_embeddings", 512)
        self.max_length = int(limit)
        self.input_names = input_names
        pad = self.tokenizer.special_tokens.get("pad_token")
        found = self.tokenizer.token_id(pad) if pad is not None else None
        self.pad_id = found if found is not None else 0

    def check(self, inputs: list[str | list[int]], exact: bool = False) -> int:
        """The inputs' text bytes (characters unless ``exact``: never more than their bytes),
        each checked against the model's text bound; a 400 naming the first over it."""
        total = 0
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                size = limits.text_bytes(item) if exact else len(item)
                try:
                    limits.check_prompt(size, self.tokenizer, self.max_length, f"'input[{i}]'")
                except limits.PromptTooLong as exc:
                    raise FieldError(str(exc), "input") from None
                total += size
        return total

    def tokenize(self, inputs: list[str | list[int]]) -> list[list[int]]:
        """Each input's ids (blocking: a worker's job), their tokenizing's memory charged.
        Texts are tokenized a slice at a time (:data:`TOKENIZE_SLICE_BYTES`) and each slice's
        lengths checked before the next: 2,048 inputs of 10 KB, each far over the model's 128
        tokens but under its text bound (a WordPiece token may stand for 400 bytes), took
        31-56 s of every core before the first was refused."""
        size = self.check(inputs, exact=True)
        with limits.tokenizing(size, "the inputs"):
            ids = self._encoded(inputs)
        for i, row in enumerate(ids):
            if len(row) > self.max_length:
                raise FieldError(
                    f"'input[{i}]' is {len(row)} tokens; this model takes at most "
                    f"{self.max_length} (shorten or split it)",
                    "input",
                )
            if row and max(row) >= self.tokenizer.vocab_size:
                raise FieldError(
                    f"'input[{i}]' holds token id {max(row)}; the vocabulary has "
                    f"{self.tokenizer.vocab_size} tokens",
                    "input",
                )
        return ids

    def _encoded(self, inputs: list[str | list[int]]) -> list[list[int]]:
        """The inputs' ids, the texts tokenized a slice at a time; a slice holding an input
        over the model's length ends the work there (its check, in :meth:`tokenize`, refuses
        it)."""
        ids: list[list[int]] = []
        start = 0
        while start < len(inputs):
            end, nbytes = start, 0
            while end < len(inputs) and (end == start or nbytes < TOKENIZE_SLICE_BYTES):
                item = inputs[end]
                nbytes += len(item) if isinstance(item, str) else 0
                end += 1
            part = inputs[start:end]
            texts = [(t.lower() if self.lower else t) for t in part if isinstance(t, str)]
            encoded = iter(self.tokenizer.encode_batch(texts, True) if texts else [])
            ids += [next(encoded) if isinstance(t, str) else t for t in part]
            if any(len(row) > self.max_length for row in ids[start:]):
                break
            start = end
        return ids

    def feed(self, rows: list[list[int]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        longest = max(len(r) for r in rows)
        ids = np.full((len(rows), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), longest), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        feed = {}
        for name in self.input_names:
            if name == "input_ids":
                feed[name] = ids
            elif name == "attention_mask":
                feed[name] = mask
            elif name == "token_type_ids":
                feed[name] = np.zeros_like(ids)
            elif name == "position_ids":
                feed[name] = np.broadcast_to(np.arange(longest, dtype=np.int64), ids.shape).copy()
        return feed, mask

    def pool(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Sentence vectors from token embeddings (rows x length x hidden), float32."""
        tokens = tokens.astype(np.float32, copy=False)
        weights = mask.astype(np.float32)[:, :, None]
        parts = []
        for mode in self.modes:
            if mode == "cls":
                parts.append(tokens[:, 0])
            elif mode == "max":
                masked = np.where(weights > 0, tokens, np.float32(-1e9))
                parts.append(masked.max(axis=1))
            elif mode == "lasttoken":
                last = mask.sum(axis=1) - 1
                parts.append(tokens[np.arange(tokens.shape[0]), last])
            else:
                total = (tokens * weights).sum(axis=1)
                count = np.maximum(weights.sum(axis=1), 1e-9)
                parts.append(total / (np.sqrt(count) if mode == "mean_sqrt_len" else count))
        vectors = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return vectors.astype(np.float32, copy=False)


def encoder_of(entry: Any, control: Any) -> Encoder | None:
    """The entry's encoder (read from its folder once, kept on the entry); None when the
    entry is no sentence-transformers folder."""
    found = entry.lanes.get(_LANE)
    if found is None:
        found = False
        repository = getattr(control, "repository", None)
        if repository is not None:
            try:
                path = repository.model_path(entry.name, entry.version)
            except Exception:
                path = None
            folder = _folder_of(Path(path)) if path is not None else None
            if folder is not None:
                found = Encoder(folder, [s.name for s in entry.network.inputs])
        entry.lanes[_LANE] = found
    return found or None


def is_encoder(entry: Any) -> bool:
    return bool(entry.lanes.get(_LANE))


def _batches(lengths: list[int]) -> list[list[int]]:
    """Input numbers grouped into runs of at most BATCH_TOKENS padded tokens, shortest first."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > BATCH_TOKENS:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _token_output(outputs: dict[str, np.ndarray]) -> np.ndarray:
    for name in ("last_hidden_state", "token_embeddings"):
        if name in outputs:
            return outputs[name]
    for value in outputs.values():
        if getattr(value, "ndim", 0) == 3:
            return value
    raise InvalidModel("the encoder has no token embeddings output (last_hidden_state)")


async def embed(
    plane: Any,
    entry: Any,
    encoder: Encoder,
    ask: EmbeddingRequest,
    in_worker: Callable[..., Awaitable[Any]],
    trace: Any = None,
) -> bytes:
    """The response body for ``ask``: each input through the encoder, pooled. ``trace``: the
    request's root span when it is traced (each batch's run is a request under it)."""
    encoder.check(ask.inputs)  # refused unread when its characters alone cannot fit
    rows = await in_worker(encoder.tokenize, ask.inputs)
    vectors: list[np.ndarray | None] = [None] * len(rows)
    for batch in _batches([len(r) for r in rows]):
        feed, mask = encoder.feed([rows[i] for i in batch])
        # (the caller's tenant: without it the runs jumped every tenant's queued requests)
        future = plane.infer(
            Request(entry, feed, protocol="openai", trace=trace, tenant=ask.tenant)
        )
        outputs = future.result() if future.done() else await asyncio.wrap_future(future)
        tokens = _token_output(outputs)
        if tokens.size > _INLINE_VALUES:
            pooled = await in_worker(encoder.pool, tokens, mask)
        else:
            pooled = encoder.pool(tokens, mask)
        for j, i in enumerate(batch):
            vectors[i] = pooled[j]
    data = []
    for i, vector in enumerate(vectors):
        assert vector is not None
        if ask.dimensions is not None:
            if ask.dimensions > vector.shape[0]:
                raise FieldError(
                    f"'dimensions' is {ask.dimensions}; this model's vectors have "
                    f"{vector.shape[0]}",
                    "dimensions",
                )
            vector = vector[: ask.dimensions]
        if encoder.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        vector = vector.astype("<f4", copy=False)
        value: Any = base64.b64encode(vector.tobytes()).decode() if ask.base64 else vector
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(len(r) for r in rows)
    return orjson.dumps(
        {
            "object": "list",
            "data": data,
            "model": entry.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
