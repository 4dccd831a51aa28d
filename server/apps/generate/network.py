"""A transformers model folder as a network the server serves: :class:`GenerativeNetwork`.

``load_generative(core, folder, device, config)`` (the Core's ``load_network`` calls it for a
folder, so a repository entry, a LoadNetwork and an in-process user get the same thing) reads
the folder (:mod:`.folder`), loads its tokenizer, compiles the decoder graph on ``device``
through the Core like any network (so every device that runs the graph serves it: NUMPY, ORT,
OPENVINO, HETERO, AUTO...), sizes the cache from the settings and starts the engine. One
request of two tokens runs before the network is returned, so a graph that does not run on
the device fails its load, not its first request; then the warm-up (:mod:`.warmup`: prefill
and decode at a few batch sizes, CUDA graphs captured), so the model is listed (and reported
ready) only once it has generated as its clients will.

Sleep and wake (:meth:`GenerativeNetwork.sleep`, :meth:`GenerativeNetwork.wake_up`; the
``/sleep`` and ``/wake_up`` routes): the engine's (:meth:`.engine.Engine.sleep`); a sleeping
model is not ready (KServe model readiness) and refuses requests 503; the wake warms it up
again before it takes requests.

Settings: the config keys of :data:`ENGINE_KEYS` (in a model's ``config.json`` ``config``, a
Triton ``config.pbtxt``'s ``parameters``, or a load's config) over the server's flags
(``--max-num-seqs`` ...); the other keys go to the device.

The KServe face (Triton's LLM convention, as its vLLM backend's ``model.json``): the network
is decoupled, its inputs ``text_input`` (BYTES; or ``input_ids``, INT32, the prompt's token ids
as TensorRT-LLM's models take them), and, optional, ``stream`` (BOOL),
``sampling_parameters`` (BYTES: a JSON object of vLLM's sampling parameters),
``exclude_input_in_output`` (BOOL), ``max_tokens`` (INT32), ``temperature``, ``top_p``
(FP32), ``top_k`` (INT32), ``seed`` (INT64), ``return_num_input_tokens``,
``return_num_output_tokens`` and ``return_finish_reason`` (BOOL); its outputs ``text_output``
(BYTES), and, when asked by the ``return_*`` inputs, ``num_input_tokens``,
``num_output_tokens`` (UINT32) and ``finish_reason`` (BYTES). Streaming, each response carries
the new text; not streaming, one response carries the prompt and the answer (the answer alone
with ``exclude_input_in_output``), as Triton's vLLM backend answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import (
    CompiledNetwork,
    InferRequest,
    InvalidArgument,
    InvalidInput,
    InvalidModel,
    PerfCount,
    TensorSpec,
    Unsupported,
)
from plugserve.plugins.configuration import Configuration
from plugserve.plugins.responses import Response
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.tracing import Span
from plugserve.server.apps.generate import limits
from plugserve.server.apps.generate.backends.onnx import SharedBufferDecoder, choose_decoder
from plugserve.server.apps.generate.backends.openvino import PagedDecoder, is_paged, serving_device
from plugserve.server.apps.generate.engine import warmup
from plugserve.server.apps.generate.engine.engine import Engine, EngineSettings, QueueSender
from plugserve.server.apps.generate.folder import ModelFolder
from plugserve.server.apps.generate.text.tokenizer import Tokenizer
from plugserve.server.apps.generate.types import GenerationEvent, GenerationRequest, SamplingParams
from plugserve.server.control.devices import parse_device

__all__ = ["GenerativeNetwork", "load_generative"]

log = logging.getLogger(__name__)

#: config keys the engine takes (the rest are the device's), and the EngineSettings field:
#: each field's name upper-cased, but the server's KV-events publisher (not a model's key)
ENGINE_KEYS = {
    f.name.upper(): f.name for f in dataclasses.fields(EngineSettings) if f.name != "kv_events"
}
#: the most tokens one event may hold (STREAM_INTERVAL, --stream-interval)
MAX_STREAM_INTERVAL = 1024
#: config keys the OpenAI face reads (each model's tool-call and reasoning parser, over the
#: server's --tool-call-parser and --reasoning-parser), and the attribute of ``parsers``
PARSER_KEYS = {"TOOL_CALL_PARSER": "tool_call_parser", "REASONING_PARSER": "reasoning_parser"}
#: without a context length in the config, the longest sequence served by default
DEFAULT_CONTEXT = 2048
#: the share of the machine's memory an unset kv_cache_bytes may take at most
AUTO_KV_SHARE = 0.25

_OBJECT = np.dtype(object)
_INPUTS = [
    TensorSpec("text_input", _OBJECT, (1,), optional=True),
    TensorSpec("input_ids", np.dtype(np.int32), (None,), optional=True),
    TensorSpec("stream", np.dtype(bool), (1,), optional=True),
    TensorSpec("sampling_parameters", _OBJECT, (1,), optional=True),
    TensorSpec("exclude_input_in_output", np.dtype(bool), (1,), optional=True),
    TensorSpec("max_tokens", np.dtype(np.int32), (1,), optional=True),
    TensorSpec("temperature", np.dtype(np.float32), (1,), optional=True),
    TensorSpec("top_p", np.dtype(np.float32), (1,), optional=True),
    TensorSpec("top_k", np.dtype(np.int32), (1,), optional=True),
    TensorSpec("seed", np.dtype(np.int64), (1,), optional=True),
    TensorSpec("return_num_input_tokens", np.dtype(bool), (1,), optional=True),
    TensorSpec("return_num_output_tokens", np.dtype(bool), (1,), optional=True),
    TensorSpec("return_finish_reason", np.dtype(bool), (1,), optional=True),
]
_OUTPUTS = [
    TensorSpec("text_output", _OBJECT, (None,)),
    TensorSpec("num_input_tokens", np.dtype(np.uint32), (1,)),
    TensorSpec("num_output_tokens", np.dtype(np.uint32), (1,)),
    TensorSpec("finish_reason", _OBJECT, (1,)),
]
#: sampling_parameters keys and their types (vLLM's SamplingParams names)
#: the most bytes of ``sampling_parameters`` JSON a request may send: a parsed JSON value holds
#: up to ~28x its text (``[[],[],...]``: a 99 MB string grew the server 2.7 GB and held the GIL
#: 8 s before it was refused), and every valid one is a few KB
MAX_SAMPLING_BYTES = 256 << 10
_SAMPLING_KEYS: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "seed": (int,),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "min_tokens": (int,),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "repetition_penalty": (int, float),
    "skip_special_tokens": (bool,),
    "include_stop_str_in_output": (bool,),
    "n": (int,),
}


def engine_settings(
    defaults: EngineSettings, config: Mapping[str, Any]
) -> tuple[EngineSettings, dict[str, Any]]:
    """The engine's settings (``config``'s :data:`ENGINE_KEYS` over ``defaults``) and the
    rest of ``config`` (the device's keys)."""
    values: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in config.items():
        field = ENGINE_KEYS.get(key.upper()) if isinstance(key, str) else None
        if field is None:
            rest[key] = value
            continue
        if field == "warmup":
            warmup.parse(str(value))  # InvalidArgument naming what is wrong
            values[field] = str(value)
            continue
        if field in ("enable_prefix_caching", "async_scheduling"):
            text = str(value).strip().upper()
            if text not in ("YES", "NO", "TRUE", "FALSE", "1", "0"):
                raise InvalidArgument(f"config key {key!r}: expected YES or NO, got {value!r}")
            values[field] = text in ("YES", "TRUE", "1")
            continue
        if field in ("kv_offloading_size", "kv_disk_size"):
            values[field] = _gib(key, value)
            continue
        if field == "kv_disk_path":
            values[field] = str(value)
            continue
        try:
            number = int(str(value))
        except ValueError:
            raise InvalidArgument(
                f"config key {key!r}: expected an integer, got {value!r}"
            ) from None
        least = 0 if field in ("kv_cache_bytes", "max_model_len", "max_num_batched_tokens") else 1
        if number < least:
            raise InvalidArgument(f"config key {key!r}: must be at least {least}, got {number}")
        if field == "stream_interval" and number > MAX_STREAM_INTERVAL:
            raise InvalidArgument(
                f"config key {key!r}: must be at most {MAX_STREAM_INTERVAL}, got {number}"
            )
        values[field] = number
    return dataclasses.replace(defaults, **values), rest


def _gib(key: str, value: Any) -> float:
    """A config key's GiB (a number at least 0: KV_OFFLOADING_SIZE, KV_DISK_SIZE), or
    InvalidArgument."""
    try:
        number = float(str(value))
    except ValueError:
        raise InvalidArgument(
            f"config key {key!r}: expected a number of GiB, got {value!r}"
        ) from None
    if not number >= 0 or number == float("inf"):
        raise InvalidArgument(f"config key {key!r}: must be a finite number of GiB at least 0")
    return number


def identity(folder: ModelFolder, device: str) -> tuple[str, bytes]:
    """Where this model's KV disk-tier files go under ``kv_disk_path`` (a folder named by a
    digest of the model folder's real path and the device: a model changed in place finds its
    old files there and refuses them) and what tells its files from another's
    (:mod:`.engine.kv_disk_tier`): its config, its graph's kind, name and size, the device
    (hashing a graph of gigabytes at each load would cost more than the tier saves)."""
    place = f"{folder.path.resolve()}|{device}".encode()
    try:
        size = folder.graph.stat().st_size
    except OSError:
        size = -1
    parts = [json.dumps(folder.config, sort_keys=True), folder.kind, folder.graph.name, str(size)]
    digest = hashlib.blake2b("|".join([*parts, device]).encode(), digest_size=32).digest()
    return hashlib.blake2b(place, digest_size=8).hexdigest(), digest


def _parsers(config: dict[str, Any]) -> dict[str, str]:
    """The parser keys of ``config`` (removed from it), checked against the names known."""
    from plugserve.server.apps.generate import reasoning, tool_parsers

    names = {"tool_call_parser": tool_parsers.NAMES, "reasoning_parser": reasoning.NAMES}
    found = {}
    for key in [k for k in config if isinstance(k, str) and k.upper() in PARSER_KEYS]:
        field = PARSER_KEYS[key.upper()]
        value = str(config.pop(key)).strip()
        if value not in names[field]:
            raise InvalidArgument(
                f"config key {key!r}: {value!r} is not a parser; one of {', '.join(names[field])}"
            )
        found[field] = value
    return found


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 8 << 30


def load_generative(
    core: Any,
    path: str | Path,
    device: str,
    config: Mapping[str, Any] | None = None,
    defaults: EngineSettings | None = None,
) -> GenerativeNetwork:
    """Load a transformers folder as a generative network on ``device``."""
    folder = ModelFolder.read(path)
    config = dict(config or {})
    parsers = _parsers(config)  # taken out: not the device's keys
    settings, device_config = engine_settings(defaults or EngineSettings(), config)
    tokenizer = Tokenizer.from_folder(folder.path)
    context = folder.context_length or DEFAULT_CONTEXT
    capacity = min(settings.max_model_len or context, context)
    if capacity < 2:
        raise InvalidArgument(f"max_model_len must be at least 2, got {capacity}")
    if folder.kind == "safetensors":  # weights, no graph: the torch decoder
        return _load_torch(core, folder, device, device_config, settings, tokenizer, capacity)
    if folder.kind == "openvino":  # an IR runs on OPENVINO, in the paged-attention form
        device, device_config = serving_device(folder.graph, device, device_config)
    if parse_device(device).kind == "ORT":
        # onnxruntime's threads do not spin between runs: the engine's own thread samples and
        # streams there. On 2 shared cores a 169 M model's decode step in the engine took 88
        # ms at batch 1 and 147 at 8 without spinning, 92/153 spinning 20 us, 107/170
        # spinning 100 us; onnxruntime's default (unbounded) made raw steps up to 2x slower
        # (docs/generate.md)
        device_config.setdefault("SPIN_DURATION_US", "0")
    decoder_network = core.load_network(str(folder.graph), device, device_config)
    try:
        if is_paged(decoder_network):
            decoder = PagedDecoder.create(decoder_network, folder.text_config, capacity)
        else:
            decoder = choose_decoder(
                decoder_network, folder.graph, folder.kind, folder.text_config,
                folder.genai_config, capacity,
            )  # fmt: skip
        if isinstance(decoder, SharedBufferDecoder) and decoder_network.plugin.name == "OPENVINO":
            decoder.batches = False  # (the attribute's docstring)
        if not is_paged(decoder_network):  # level-2 sleep closes it; the wake compiles it
            # (the paged form's network is kept: its load is serving_device's, not redone here)
            decoder.reload = lambda: core.load_network(str(folder.graph), device, device_config)
        per_slot = decoder.layout.bytes_per_slot
        rows = _slots(folder, settings, capacity, per_slot)
        network = GenerativeNetwork(
            decoder_network, folder, tokenizer, decoder, settings, rows, device
        )
        network.parsers = parsers
    except BaseException:
        decoder_network.close()
        raise
    return _warmed(
        network,
        "generative model %s on %s: %s graph (%s), context %d, %d sequences x %.1f MiB of cache",
        folder.path, device, folder.kind, type(decoder).__name__, capacity, rows,
        per_slot / (1 << 20),
    )  # fmt: skip


def _warmed(network: GenerativeNetwork, loaded: str, *values: Any) -> GenerativeNetwork:
    """``network`` warmed up (closed when that fails: the load fails), then its load logged
    (``loaded % values``): the end of every load path."""
    try:
        network.warm_up()
    except BaseException:
        network.close()
        raise
    log.info(loaded, *values)
    return network


def _slots(folder: ModelFolder, settings: EngineSettings, capacity: int, per_slot: int) -> int:
    """The cache slots the budget holds (``kv_cache_bytes``, else ``max_num_seqs`` slots at
    most a quarter of the machine), at most ``max_num_seqs``; InvalidArgument for none."""
    budget = settings.kv_cache_bytes or min(
        settings.max_num_seqs * per_slot, int(_physical_memory() * AUTO_KV_SHARE)
    )
    rows = min(settings.max_num_seqs, budget // per_slot)
    if rows < 1:
        raise InvalidArgument(
            f"{folder.path}: kv_cache_bytes {budget} holds no sequence: one takes "
            f"{per_slot} bytes (max_model_len {capacity} x {per_slot // capacity} "
            "bytes a token); raise KV_CACHE_BYTES or lower MAX_MODEL_LEN"
        )
    return rows


def _load_torch(
    core: Any,
    folder: ModelFolder,
    device: str,
    device_config: dict[str, Any],
    settings: EngineSettings,
    tokenizer: Tokenizer,
    capacity: int,
) -> GenerativeNetwork:
    """A safetensors folder on the device that runs its weights: the device plugin's
    :meth:`~plugserve.plugins.api.Plugin.load_decoder` (TORCH's and GPU's torch decoder; the
    other devices refuse it), configured by that device's keys."""
    missing = [name for name in ("torch", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:  # the folder format's extra (its devices are then unavailable too)
        raise InvalidModel(
            f"{folder.path}: a safetensors folder is served by the torch decoder, which needs "
            f"torch and safetensors ({', '.join(missing)} not installed): "
            "pip install 'plugserve[torch]'"
        )
    served = weights_device(core, device)
    plugin, merged = core.resolve(served, device_config)
    decoder, rows, report = plugin.load_decoder(
        folder.path,
        folder.text_config,
        merged,
        capacity,
        lambda per_slot: _slots(folder, settings, capacity, per_slot),
    )
    network = GenerativeNetwork(
        None, folder, tokenizer, decoder, settings, rows, served,
        config=plugin.merged_config(merged),
    )  # fmt: skip
    return _warmed(
        network,
        "generative model %s on %s: safetensors (%s on %s, %s), context %d, %d sequences x "
        "%.1f MiB of cache, weights read in %.2f s",
        folder.path, served, type(decoder).__name__, report["torch_device"],
        report["precision"], capacity, rows, decoder.layout.bytes_per_slot / (1 << 20),
        report["load_seconds"],
    )  # fmt: skip


def weights_device(core: Any, device: str) -> str:
    """The device a safetensors folder loads on: ``device``, or for ``AUTO`` (``AUTO:GPU,
    TORCH``, ``AUTO:-GPU``) the first of its devices (GPU, then TORCH) the Core has."""
    name = parse_device(device)
    if name.kind != "AUTO":
        return device
    wanted = [c.kind for c in name.children] or ["GPU", "TORCH"]
    have = set(core.available_devices)
    return next((k for k in wanted if k not in name.excluded and k in have), device)


class GenerativeNetwork(CompiledNetwork):
    """A generative model: its engine (``.engine``), tokenizer (``.tokenizer``), and the
    KServe face's tensors (decoupled)."""

    decoupled = True
    open_ended = True
    #: the model's own tool-call and reasoning parsers (config keys :data:`PARSER_KEYS`)
    parsers: dict[str, str] = {}  # replaced per network, never changed in place

    def __init__(
        self,
        decoder_network: CompiledNetwork | None,
        folder: ModelFolder,
        tokenizer: Tokenizer,
        decoder: Any,
        settings: EngineSettings,
        rows: int,
        device: str,
        config: Configuration | None = None,
    ) -> None:
        """``decoder_network``: the graph compiled on a device; None for a decoder that owns
        its module (the torch decoder), which then gives its device config as ``config``."""
        # its name until the server names it: a repository's version folder ("1") says less
        # than its model's folder, which the engine's load-time logs then say
        path = folder.path
        label = path.parent.name if path.name.isdigit() and path.parent.name else path.name
        # made first: naming the network (the base class does) names its engine
        self.engine = Engine(
            label, decoder, tokenizer, settings, rows, identity=identity(folder, device)
        )
        if decoder_network is not None:
            super().__init__(decoder_network.plugin, label, decoder_network.config)
        else:
            super().__init__(None, label, config or Configuration())  # type: ignore[arg-type]
        #: a graph decoder's (None: the torch decoder's own module), and its precision
        self._graph = decoder_network is not None
        self._precision = decoder_network.precision if decoder_network is not None else ""
        self.folder = folder
        self.tokenizer = tokenizer
        self.settings = settings
        self.device_name = device
        # the strings' bounds, for a protocol to refuse one before it builds it
        bounds = {
            "text_input": limits.prompt_limit(tokenizer, self.engine.max_model_len),
            "sampling_parameters": MAX_SAMPLING_BYTES,
        }
        self._inputs = [
            dataclasses.replace(spec, max_bytes=bounds[spec.name]) if spec.name in bounds else spec
            for spec in _INPUTS
        ]
        self._outputs = list(_OUTPUTS)
        self._sleep_lock = threading.Lock()  # one sleep or wake at a time

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        """The name it is served under (the server names it after loading): the engine's
        errors and logs say it, not the folder's (a repository's version folder, "1")."""
        self._name = value
        self.engine.name = self.engine.output.name = value

    @property
    def decoder_network(self) -> CompiledNetwork | None:
        """The graph compiled on its device (None: the torch decoder, or a graph closed by a
        level-2 sleep until the wake compiles it again)."""
        return self.engine.decoder.network if self._graph else None

    @property
    def device(self) -> str:
        return self.plugin.name if self._graph else self.device_name

    @property
    def precision(self) -> str:
        return self._precision if self._graph else self.engine.decoder.precision

    # --- generation's one entry, which every face uses (OpenAI, KServe, in-process)

    def generate(self, request: GenerationRequest, sender: Any, trace: Span | None = None) -> None:
        """Start ``request``: its events go to ``sender`` (a :class:`ResponseStream` of the
        data plane, or a :class:`QueueSender` in process), the last one final. Its bound on
        unread events (``limits.stream_bounded``) is put on the sender here, once for every
        face, and the engine checks what it needs (the prompt against the context and the
        vocabulary, ``n`` against the slots, each sampling parameter's range) before the
        request enters it: a refusal raises here, for the caller's request alone.

        A request of a traced run is traced: its generation's spans open under ``trace`` (the
        model's span the data plane hands a stream's producer; a device run's, its run
        context's ``trace``), unless the face gave it one (``request.trace``)."""
        limits.stream_bounded(sender, request)
        if request.trace is None:
            request.trace = trace
        self.engine.add(request, sender)

    @property
    def context(self) -> int:
        """The longest sequence, prompt and answer (the engine's max_model_len)."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """The decoder's logits (a padded embedding may have more rows than the tokenizer)."""
        return self.engine.decoder.vocab or self.tokenizer.vocab_size

    @property
    def max_n(self) -> int:
        """Choices one request may ask for at most (the engine's sequences at once)."""
        return self.engine.scheduler.max_num_seqs

    @property
    def prompt_logits(self) -> bool:
        """Whether the decoder scores prompts (``SamplingParams.prompt_logprobs``)."""
        return self.engine.decoder.prompt_logits

    def _metric(self, name: str) -> Any:
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self.engine.scheduler.max_num_seqs
        return super()._metric(name)

    def warm_up(self) -> None:
        """Two tokens for a two-token prompt (the graph runs on its device, or the load
        fails), then the warm-up the settings ask (:mod:`.warmup`), logged."""
        first = self.tokenizer.bos_token_id or 0
        request = GenerationRequest(
            f"warm-up-{uuid.uuid4().hex}",
            [first, first],
            SamplingParams(max_tokens=2, temperature=0.0),
        )
        saved = self.engine.stats_.counters()
        try:
            for _event in self.engine.generate(request, warm=True):
                pass
        finally:
            self.engine.stats_.restore(saved)
        plan = warmup.parse(self.settings.warmup)
        if plan is None:
            return
        done = warmup.run(self.engine, plan, first)
        log.info(
            "generative model %s warmed up: %d requests (batch size x prompt length: %s) in "
            "%.2f s; decode graphs captured: %d",
            self.folder.path, done["requests"], ", ".join(f"{b}x{n}" for b, n in done["rounds"]),
            done["seconds"], done["graphs"],
        )  # fmt: skip

    # --- sleep and wake (the module's docstring)

    @property
    def sleeping(self) -> int:
        """The sleep level (0: awake)."""
        return self.engine.sleeping

    def sleep(self, level: int) -> None:
        """The engine asleep at ``level`` (1 or 2); returns once its memory is released."""
        with self._sleep_lock:
            self.engine.sleep(level)

    def wake_up(self) -> None:
        """The weights and the cache back, the model warmed up, requests taken again."""
        with self._sleep_lock:
            if not self.engine.sleeping:
                return
            self.engine.wake_up()
            try:
                self.warm_up()
            finally:
                self.engine.resume()

    def ready(self) -> bool:
        """Not while asleep (KServe model readiness: a sleeping model refuses requests)."""
        return not self.engine.sleeping

    def create_infer_request(self) -> GenerativeInferRequest:
        return GenerativeInferRequest(self)

    def export(self) -> bytes:
        raise Unsupported("a generative model is not exported; serve its folder")

    def close(self) -> None:
        self.engine.close()
        network = self.decoder_network
        if network is not None:
            network.close()
        super().close()


class GenerativeInferRequest(InferRequest):
    """The KServe face's requests (see the module docstring)."""

    network: GenerativeNetwork

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        """A blocking run (in-process, or a unary call): the whole answer in one response."""
        sender = QueueSender()
        values = dict(zip((s.name for s in self.network.inputs), arrays))
        values["stream"] = None  # one response
        collected: list[Any] = []
        face = _Face(self.network, values, sender)
        face.request.tenant = run.tenant  # the caller's: its own part of the prefix cache
        self.network.generate(face.request, face, run.trace)
        try:
            for item in sender:
                collected.append(item)
        finally:
            sender.close()
        return dict(collected[-1].outputs) if collected else {}

    def infer_decoupled(
        self, arrays: list[Any], sender: Any, run: RunContext | None = None
    ) -> None:
        """Start the generation; its responses go to ``sender`` (the last with final)."""
        values = dict(zip((s.name for s in self.network.inputs), arrays))
        face = _Face(self.network, values, sender)
        if run is not None:
            face.request.tenant = run.tenant  # its own part of the prefix cache
        self.network.generate(face.request, face, None if run is None else run.trace)

    def get_performance_counts(self) -> list[PerfCount]:
        return []


def _scalar(values: Mapping[str, Any], name: str) -> Any:
    value = values.get(name)
    if value is None:
        return None
    array = np.asarray(value)
    if array.size != 1:
        raise InvalidInput(f"input {name!r}: expected one element, got {array.size}")
    item = array.reshape(-1)[0]
    return item.item() if isinstance(item, np.generic) else item


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"input {name!r}: not UTF-8 text") from None
    if isinstance(value, str):
        return value
    raise InvalidInput(f"input {name!r}: expected text, got {type(value).__name__}")


def sampling_from(values: Mapping[str, Any], vocab: int = 0) -> SamplingParams:
    """The request's sampling: ``sampling_parameters`` JSON, then the single inputs over it,
    each checked against its range (``vocab``: the model's, for token ids)."""
    params: dict[str, Any] = {}
    raw = _scalar(values, "sampling_parameters")
    if raw is not None:
        if isinstance(raw, bytes | str) and len(raw) > MAX_SAMPLING_BYTES:
            raise InvalidInput(
                f"input 'sampling_parameters' is {len(raw):,} bytes; at most "
                f"{MAX_SAMPLING_BYTES:,} (its largest valid form, 16 stop strings of 1,024 "
                "characters, fits many times over)"
            )
        text = _text(raw, "sampling_parameters")
        try:  # Python's json: integers of any width and NaN parse, to be named as out of range
            parsed = json.loads(text) if text.strip() else {}
        except RecursionError:  # arrays in arrays: 200,000 deep was a 500 and a traceback
            raise InvalidInput("input 'sampling_parameters': nested too deeply") from None
        except ValueError as exc:
            raise InvalidInput(f"input 'sampling_parameters': not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise InvalidInput("input 'sampling_parameters': expected a JSON object")
        unknown = sorted(set(parsed) - set(_SAMPLING_KEYS))
        if unknown:
            raise InvalidInput(
                f"input 'sampling_parameters': unknown key(s) {unknown}; known: "
                f"{', '.join(sorted(_SAMPLING_KEYS))}"
            )
        for key, value in parsed.items():
            kinds = _SAMPLING_KEYS[key]
            if value is None:
                continue
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise InvalidInput(
                    f"input 'sampling_parameters': {key!r} must be "
                    f"{' or '.join(k.__name__ for k in kinds)}, got {value!r}"
                )
            params[key] = value
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = _scalar(values, name)
        if value is not None:
            params[name] = value
    if params.pop("n", 1) != 1:
        raise InvalidInput("input 'sampling_parameters': n must be 1 on this protocol")
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    return check_sampling(SamplingParams(**params), vocab)


def check_sampling(p: SamplingParams, vocab: int = 0) -> SamplingParams:
    """InvalidArgument naming the first parameter out of its range (the engine's table,
    ``SamplingParams.check``: the same bounds on every face); ``top_k`` -1 becomes 0."""
    p.check(vocab)
    if p.top_k < 0:
        p.top_k = 0
    return p


class _Face:
    """A KServe request's sender for the engine: events into Triton-style responses."""

    __slots__ = ("_parts", "_prompt", "_returns", "exclude", "request", "sender", "stream")

    def __init__(self, network: GenerativeNetwork, values: Mapping[str, Any], sender: Any) -> None:
        raw_ids = values.get("input_ids")
        text = values.get("text_input")
        if (raw_ids is None) == (text is None):
            raise InvalidInput("give the prompt as text_input or as input_ids (one of them)")
        raw = _scalar(values, "text_input") if text is not None else None
        size = limits.text_bytes(raw) if isinstance(raw, bytes | str) else 0
        if (
            raw is not None
        ):  # refused before it is decoded or tokenized (server/apps/generate/limits.py)
            limits.check_prompt(
                size, network.tokenizer, network.engine.max_model_len, "input 'text_input'"
            )
        prompt = _text(raw, "text_input") if raw is not None else ""
        self.stream = bool(_scalar(values, "stream") or False)
        self.exclude = bool(_scalar(values, "exclude_input_in_output") or False)
        self._returns = {
            name: bool(_scalar(values, f"return_{name}") or False)
            for name in ("num_input_tokens", "num_output_tokens", "finish_reason")
        }
        params = sampling_from(values, network.engine.decoder.vocab or 0)
        if raw_ids is not None:  # TensorRT-LLM's way: the prompt's token ids
            flat = np.asarray(raw_ids).reshape(-1)
            context = network.engine.max_model_len
            if flat.size >= context:  # refused before a Python int is made of each
                raise InvalidInput(
                    f"input 'input_ids' has {flat.size} tokens; this model's context holds "
                    f"{context} (max_model_len), prompt and answer together"
                )
            ids = flat.astype(np.int64).tolist()
        else:
            with limits.tokenizing(size, "input 'text_input'"):
                ids = network.tokenizer.encode(prompt, add_special_tokens=True)
        self.request = GenerationRequest(f"kserve-{uuid.uuid4().hex}", ids, params)
        limits.stream_bounded(sender)
        self.sender = sender
        self._prompt = prompt
        self._parts: list[str] = []

    @property
    def cancelled(self) -> bool:
        return bool(self.sender.cancelled)

    def on_cancel(self, callback: Any) -> Any:
        return self.sender.on_cancel(callback)

    def fail(self, error: BaseException) -> None:
        self.sender.fail(error)

    def send(self, event: GenerationEvent, final: bool = False) -> bool:
        if self.stream:
            if not event.text and not final:
                return not self.sender.cancelled
            return self.sender.send(self._response(event.text, event, final), final)
        self._parts.append(event.text)
        if not final:
            return not self.sender.cancelled
        text = "".join(self._parts)
        if not self.exclude:
            text = self._prompt + text
        return self.sender.send(self._response(text, event, True), True)

    def _response(self, text: str, event: GenerationEvent, final: bool) -> Any:
        outputs: dict[str, np.ndarray] = {
            "text_output": np.array([text.encode("utf-8")], dtype=object)
        }
        if final and self._returns["num_input_tokens"]:
            outputs["num_input_tokens"] = np.array([event.prompt_tokens], np.uint32)
        if final and self._returns["num_output_tokens"]:
            outputs["num_output_tokens"] = np.array([event.completion_tokens], np.uint32)
        if final and self._returns["finish_reason"]:
            outputs["finish_reason"] = np.array(
                [(event.finish_reason or "").encode()], dtype=object
            )
        return Response(outputs)
