"""The pipeline transformers 5 runs on a folder's ``tokenizer.json``: its tokenizer class may
rebuild what the file declares, and plugserve's ids must be transformers' (and so vLLM's).

transformers 5's ``AutoTokenizer`` picks a class from the folder's model type and the
``tokenizer_class`` its files declare (``models/auto/tokenization_auto.py``), and a class with
a pipeline of its own (``Qwen2Tokenizer``) takes only the vocabulary, the merges and the
post-processor from ``tokenizer.json``: its normalizer, pre-tokenizer, decoder and BPE options
are the class's. A folder whose file declares another pipeline (a tokenizer trained with
GPT-2's byte-level regex and saved for a Qwen2-type model, as transformers 5 saves one) is
then tokenized differently from what the file says: digits one by one, ``[^\\r\\n\\p{L}\\p{N}]?
\\p{L}+`` pieces, NFC. transformers 4 read the file as it is; vLLM follows transformers.

What this module follows, as transformers 5.24 decides it (without importing it: it takes
seconds and brings dependencies a server does not need):

* the class (:func:`transformers_class`): a folder with ``auto_map`` (remote code, which a
  server does not run) keeps its file; else, when the declared class differs from the one
  registered for the model type, a specific registered class wins for the model types
  transformers lists as declaring wrong classes (:data:`INCORRECT_HUB_CLASS`, ``qwen2``
  among them), the declared one for the others, and a generic registered class
  (:data:`GENERIC_MODEL_TYPES`) means the file as it is; without a declared class, the
  registered one;
* the classes whose pipeline is rebuilt here (:data:`PIPELINES`): ``Qwen2Tokenizer`` (the
  qwen2 and qwen3 families, :data:`QWEN2_MODEL_TYPES`) and ``Qwen3_5Tokenizer``. Another
  class with a pipeline of its own (``GPT2Tokenizer``, ``GemmaTokenizer``, ...) keeps the
  file's, and the load says so in the log;
* the post-processor, for every class: when ``tokenizer_config.json`` sets ``add_bos_token``
  or ``add_eos_token`` (or the file has none), transformers writes it again from those flags
  (a BOS before the text, an EOS after), whatever the file's said.

Costs nothing at load beyond reading the two JSON settings files (already read): the backend
loaded from the file is changed in place, with ``tokenizers``' own objects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = [
    "GENERIC_MODEL_TYPES",
    "INCORRECT_HUB_CLASS",
    "PIPELINES",
    "QWEN2_MODEL_TYPES",
    "apply",
    "token_text",
    "transformers_class",
]

log = logging.getLogger(__name__)

#: the classes that load tokenizer.json as it is (named with or without "Fast")
GENERIC = (
    "TokenizersBackend",
    "PythonBackend",
    "PreTrainedTokenizer",
    "PreTrainedTokenizerFast",
    "MistralCommonBackend",
)


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: model types registered with Qwen2Tokenizer (transformers 5.24's TOKENIZER_MAPPING_NAMES)
QWEN2_MODEL_TYPES = _names(
    "audioflamingo3 colqwen2 cosmos3_omni dots3_note fun_asr_nano hunyuan_vl internvl "
    "lighton_ocr moss_transcribe_diarize ovis2 qianfan_ocr qwen2 qwen2_5_omni qwen2_5_vl "
    "qwen2_audio qwen2_moe qwen2_vl qwen3 qwen3_asr qwen3_moe qwen3_next qwen3_omni_moe "
    "qwen3_vl qwen3_vl_moe vibevoice"
)
#: model types registered with Qwen3_5Tokenizer
QWEN3_5_MODEL_TYPES = _names("qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text qwen4_exp")
#: model types registered with a generic class (the file as it is), besides those of
#: INCORRECT_HUB_CLASS that transformers registers with the generic class too
GENERIC_MODEL_TYPES = _names(
    "EvollaModel aria beam bigbird_pegasus canary flex_olmo glm glm4 glm4_moe glm4_moe_lite "
    "glm4v glm4v_moe glm_image glmasr got_ocr2 gpt_bigcode gradium_phonon_tts granite "
    "granitemoe granitemoehybrid granitemoeshared kimi_k25 kimi_linear kosmos-2 mimo_v2_flash "
    "minicpm_ocr minicpmv4_6 minicpmv4_7 ministral ministral3 mistral mistral3 mistral_large4 "
    "mixtral nemo_speechlm nystromformer olmo2 olmo3 olmo_hybrid omniasr pegasus_x persimmon "
    "pix2struct pixtral pocket_tts stablelm umt5 voxtral voxtral_realtime xlm-roberta-xl"
)
#: model types whose folders transformers believes declare a wrong tokenizer class: their
#: registered class is used whatever the folder declares
INCORRECT_HUB_CLASS = _names(
    "arctic camembertv2-base chatlm cohere_asr ernie4_5 ernie4_5_moe fuyu h2ovl_chat "
    "hyperclovax hyperclovax_vision_v2 hyperclovax_vlm internlm2 internlm3 iquestcoder jamba "
    "llava llava_next minicpm3 minicpmv minimax_m2 modernbert modernbert-decoder molmo molmo2 "
    "nemotron nvfp4 opencua openvla paddleocr_vl phi3 phi3_v phimoe qwen2 qwen3_5 qwen3_5_moe "
    "qwen3_5_moe_text qwen4_exp siglip2 smolvlm step3_vl vipllava"
)

_QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN3_5_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: the classes whose pipeline is rebuilt, and their pre-tokenizer's regex (both: NFC, the
#: regex split then byte-level without its own regex, the byte-level decoder, plain BPE)
PIPELINES = {"Qwen2Tokenizer": _QWEN2_REGEX, "Qwen3_5Tokenizer": _QWEN3_5_REGEX}


def _registered(model_type: str) -> str | None:
    """The class transformers registers for ``model_type``, as far as it matters here
    ("" for the generic ones; None when not one of these tables')."""
    if model_type in QWEN2_MODEL_TYPES:
        return "Qwen2Tokenizer"
    if model_type in QWEN3_5_MODEL_TYPES:
        return "Qwen3_5Tokenizer"
    if model_type in GENERIC_MODEL_TYPES or model_type in INCORRECT_HUB_CLASS:
        return ""
    return None


def transformers_class(
    model_type: str | None, declared: str | None, remote_code: bool = False
) -> str:
    """The tokenizer class transformers 5 loads a folder as: a class name, "" for one that
    reads tokenizer.json as it is (or one this module cannot tell)."""
    if remote_code:
        return ""
    stem = declared.removesuffix("Fast") if declared else None
    if stem in GENERIC:
        stem = ""
    registered = _registered(model_type or "")
    if declared and registered is not None and registered != stem:
        if registered:  # a specific class registered for the type
            chosen = registered if model_type in INCORRECT_HUB_CLASS else stem
            if chosen:
                return chosen
        return ""
    if declared:
        return stem or ""
    return registered or ""


def apply(
    backend: Any,
    tokenizer_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    where: str = "tokenizer",
) -> str:
    """Make ``backend`` (the folder's ``tokenizers.Tokenizer``, loaded from its file) run what
    transformers 5 runs; returns the class transformers loads the folder as ("" generic)."""
    auto_map = tokenizer_config.get("auto_map")
    remote = bool(auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map)
    model_type = model_config.get("model_type")
    declared = tokenizer_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    name = transformers_class(
        model_type if isinstance(model_type, str) else None,
        declared if isinstance(declared, str) else None,
        remote,
    )
    if name in PIPELINES:
        _rebuild(backend, PIPELINES[name], bool(tokenizer_config.get("add_prefix_space")), where)
        log.info(
            "%s: tokenized as transformers 5 loads it, with %s's pipeline (tokenizer.json's "
            "vocabulary, merges and post-processor)",
            where,
            name,
        )
    elif name:
        log.info(
            "%s: transformers 5 loads this folder as %s, whose pipeline is not rebuilt here; "
            "tokenized as tokenizer.json declares",
            where,
            name,
        )
    _post_processor(backend, tokenizer_config)
    return name


def _rebuild(backend: Any, regex: str, add_prefix_space: bool, where: str) -> None:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    model = backend.model
    if not isinstance(model, BPE):
        log.warning(
            "%s: its class rebuilds a BPE pipeline but tokenizer.json's model is %s; "
            "tokenized as tokenizer.json declares",
            where,
            type(model).__name__,
        )
        return
    # the class's BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix
    # "", end_of_word_suffix "", fuse_unk=False, byte_fallback=False), ignore_merges unset
    model.dropout = None
    model.unk_token = None
    model.continuing_subword_prefix = ""
    model.end_of_word_suffix = ""
    model.fuse_unk = False
    model.byte_fallback = False
    model.ignore_merges = False
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _post_processor(backend: Any, config: Mapping[str, Any]) -> None:
    """transformers' ``update_post_processor``: when the config says whether to add BOS and
    EOS (or the file has no post-processor), a template adding what it says."""
    explicit = "add_bos_token" in config or "add_eos_token" in config
    if not explicit and backend.post_processor is not None:
        return
    from tokenizers import processors

    special: list[tuple[str, int]] = []
    parts: dict[str, str] = {}
    for key, flag in (("bos", "add_bos_token"), ("eos", "add_eos_token")):
        token = token_text(config.get(f"{key}_token"))
        token_id = backend.token_to_id(token) if token is not None else None
        if config.get(flag) and token is not None and token_id is not None:
            parts[key] = token
            special.append((token, token_id))
    bos, eos = parts.get("bos"), parts.get("eos")
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )
