"""The bundled example pipelines: applications as Triton ensembles, built in code.

``text_sentiment``: text (BYTES) in, a label out, in three steps:
``text_tokenizer`` (a Python model: BERT's WordPiece over a vocabulary written here),
``text_encoder`` (an ONNX model on the server's default device: token embeddings averaged over
the text, then a linear layer to two logits) and ``text_labels`` (a Python model: softmax, the
best label and its probability).

``image_color``: an encoded image's bytes (UINT8, as Triton's image examples send them) in, the
picture's main color out: ``image_decoder`` (a Python model: Pillow decodes, resizes to 32x32
and scales to [0, 1]), ``image_classifier`` (an ONNX model: the image's mean color, then the
nearest of seven prototype colors as logits) and ``image_labels`` (the same Python model as
``text_labels``, with the colors as its labels).

The weights are made here from a seed; the encoder's embeddings are random but for a sentiment
direction given to a small list of positive and negative words, so the example's answers mean
something ("a wonderful film" is positive) while the model stays a few kilobytes.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from plugserve.server.control.examples.files import model as onnx_model
from plugserve.server.control.examples.files import write_if_changed

__all__ = ["IMAGE_LABELS", "SEQUENCE_LENGTH", "TEXT_LABELS", "build_pipelines", "vocabulary"]

#: tokens per text the tokenizer gives the encoder ([CLS] and [SEP] included)
SEQUENCE_LENGTH = 32
TEXT_LABELS = ("negative", "positive")
#: the image classifier's colors and their RGB prototypes in [0, 1]
COLORS = {
    "red": (1, 0, 0),
    "green": (0, 1, 0),
    "blue": (0, 0, 1),
    "yellow": (1, 1, 0),
    "white": (1, 1, 1),
    "black": (0, 0, 0),
    "gray": (0.5, 0.5, 0.5),
}
IMAGE_LABELS = tuple(COLORS)
IMAGE_SIZE = 32


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


POSITIVE = _words(
    "good great excellent wonderful love loved loves lovely happy best amazing awesome "
    "fantastic beautiful brilliant enjoy enjoyed like liked fun perfect nice delightful"
)
NEGATIVE = _words(
    "bad terrible awful worst hate hated hates boring poor sad ugly horrible dull "
    "disappointing disappointed waste annoying broken slow angry mediocre"
)
COMMON = _words(
    "the a an and or but not no this that these those it is was are were be been i you he "
    "she we they me my your our their of to in on at for with from by about as so very "
    "really too quite film movie book story food service place day time thing work product "
    "show music game plot acting ending price staff"
)
SUFFIXES = ("##s", "##es", "##ed", "##ing", "##ly", "##er", "##est", "##ness", "##ful")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")


def vocabulary() -> list[str]:
    """The WordPiece vocabulary, ids in order: the special tokens (``[PAD]`` is 0), whole
    words, common continuations, then every letter, digit and punctuation mark alone and as a
    continuation, so any ASCII word has a spelling."""
    words = dict.fromkeys([*POSITIVE, *NEGATIVE, *COMMON])
    chars = string.ascii_lowercase + string.digits
    return [
        *SPECIAL,
        *words,
        *SUFFIXES,
        *chars,
        *(f"##{c}" for c in chars),
        *string.punctuation,
    ]


def text_encoder(vocab: list[str], width: int = 32, seed: int = 5) -> onnx.ModelProto:
    """Token ids [batch, SEQUENCE_LENGTH] -> logits [batch, 2]: the embeddings of the text's
    tokens ([PAD] left out) averaged, then a linear layer."""
    rng = np.random.default_rng(seed)
    embeddings = rng.normal(0, 0.1, (len(vocab), width)).astype(np.float32)
    embeddings[:, 0] = 0.0  # the sentiment direction: none but the words below have any
    index = {token: i for i, token in enumerate(vocab)}
    for word in POSITIVE:
        embeddings[index[word], 0] += 1.0
    for word in NEGATIVE:
        embeddings[index[word], 0] -= 1.0
    weights = rng.normal(0, 0.05, (width, 2)).astype(np.float32)
    weights[0] = (-6.0, 6.0)  # the sentiment direction decides the two logits
    bias = np.zeros(2, np.float32)
    nodes = [
        helper.make_node("Gather", ["embeddings", "INPUT_IDS"], ["vectors"], name="embed"),
        helper.make_node("Greater", ["INPUT_IDS", "pad"], ["real"], name="not_padding"),
        helper.make_node("Cast", ["real"], ["mask"], to=TensorProto.FLOAT, name="mask"),
        helper.make_node("Unsqueeze", ["mask", "last"], ["mask3"], name="mask_3d"),
        helper.make_node("Mul", ["vectors", "mask3"], ["kept"], name="keep_tokens"),
        helper.make_node("ReduceSum", ["kept", "tokens"], ["total"], keepdims=0, name="sum"),
        helper.make_node("ReduceSum", ["mask", "tokens"], ["count"], keepdims=1, name="count"),
        helper.make_node("Max", ["count", "one"], ["divisor"], name="at_least_one"),
        helper.make_node("Div", ["total", "divisor"], ["mean"], name="mean"),
        helper.make_node("Gemm", ["mean", "weights", "bias"], ["LOGITS"], name="classify"),
    ]
    initializers = [
        numpy_helper.from_array(embeddings, "embeddings"),
        numpy_helper.from_array(weights, "weights"),
        numpy_helper.from_array(bias, "bias"),
        numpy_helper.from_array(np.array(0, np.int64), "pad"),
        numpy_helper.from_array(np.array([2], np.int64), "last"),
        numpy_helper.from_array(np.array([1], np.int64), "tokens"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    graph = helper.make_graph(
        nodes,
        "text_encoder",
        [helper.make_tensor_value_info("INPUT_IDS", TensorProto.INT64, ["batch", SEQUENCE_LENGTH])],
        [helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, ["batch", 2])],
        initializer=initializers,
    )
    return onnx_model(graph)


def image_classifier() -> onnx.ModelProto:
    """Pixels [1, 3, H, W] in [0, 1] -> logits [1, colors]: the mean color's nearness to each
    prototype (``-|mean - p|^2`` less the term all colors share, times 10)."""
    prototypes = np.array(list(COLORS.values()), np.float32)  # [colors, 3]
    scale = 10.0
    weights = (2 * scale * prototypes.T).astype(np.float32)  # [3, colors]
    bias = (-scale * (prototypes**2).sum(axis=1)).astype(np.float32)
    nodes = [
        helper.make_node("GlobalAveragePool", ["PIXELS"], ["pooled"], name="mean_color"),
        helper.make_node("Flatten", ["pooled"], ["rgb"], name="flatten"),
        helper.make_node("Gemm", ["rgb", "weights", "bias"], ["LOGITS"], name="nearest"),
    ]
    graph = helper.make_graph(
        nodes,
        "image_classifier",
        [
            helper.make_tensor_value_info(
                "PIXELS", TensorProto.FLOAT, [1, 3, IMAGE_SIZE, IMAGE_SIZE]
            )
        ],
        [helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, [1, len(COLORS)])],
        initializer=[
            numpy_helper.from_array(weights, "weights"),
            numpy_helper.from_array(bias, "bias"),
        ],
    )
    return onnx_model(graph)


def _tensor(name: str, kind: str, dims: list[int]) -> str:
    return f'{{ name: "{name}" data_type: {kind} dims: [ {", ".join(map(str, dims))} ] }}'


def _config(name: str, inputs: list[str], outputs: list[str], extra: str = "") -> str:
    return (
        f'name: "{name}"\n'
        + extra
        + "max_batch_size: 0\n"
        + f"input [ {', '.join(inputs)} ]\n"
        + f"output [ {', '.join(outputs)} ]\n"
    )


def _python(name: str, source: str, inputs: list[str], outputs: list[str], labels=()) -> dict:
    """A Python model's files: its config.pbtxt and 1/model.py (``source``, a file of
    ``server/control/examples/python_models``)."""
    extra = 'backend: "python"\n'
    if labels:
        extra += f'parameters {{ key: "labels" value: {{ string_value: "{",".join(labels)}" }} }}\n'
    code = (Path(__file__).parent / "python_models" / source).read_bytes()
    return {"config.pbtxt": _config(name, inputs, outputs, extra).encode(), "1/model.py": code}


def _ensemble(name: str, inputs: list[str], outputs: list[str], steps: list[tuple]) -> dict:
    """An ensemble's config.pbtxt (and its empty version folder): ``steps`` are
    ``(model, {model input: tensor}, {model output: tensor})``."""
    body = []
    for model, ins, outs in steps:
        maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in ins.items()]
        maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outs.items()]
        body.append(f'  {{ model_name: "{model}" model_version: -1\n    ' + " ".join(maps) + " }")
    text = _config(name, inputs, outputs, 'platform: "ensemble"\n')
    text += "ensemble_scheduling { step [\n" + ",\n".join(body) + "\n] }\n"
    return {"config.pbtxt": text.encode(), "1/": b""}


def _labelled(
    name: str, input: str, steps: list[tuple[str, str]], labeller: tuple[str, str, tuple]
) -> dict[str, dict[str, bytes]]:
    """An application's last model and the application: ``labeller``, ``(model, its LOGITS
    input, labels)``, names the logits that ``steps`` compute from the ensemble's ``input``
    (:func:`_chain`), and answers LABEL and SCORE."""
    model, logits, labels = labeller
    outputs = [_tensor("LABEL", "TYPE_STRING", [-1]), _tensor("SCORE", "TYPE_FP32", [-1])]
    return {
        model: _python(model, "labels.py", [logits], outputs, labels),
        name: _ensemble(name, [input], outputs, _chain(steps, model)),
    }


def _chain(steps: list[tuple[str, str]], labeller: str) -> list[tuple]:
    """Both pipelines' steps, one after another: ``(model, its input)``, each input fed the one
    output of the step before (the first, the ensemble's input of that name), then
    ``labeller``, which reads LOGITS and answers the ensemble's LABEL and SCORE."""
    inputs = [key for _model, key in steps[1:]] + ["LOGITS"]
    chained = [
        (model, {key: key.lower() if i else key}, {out: out.lower()})
        for i, ((model, key), out) in enumerate(zip(steps, inputs))
    ]
    return [*chained, (labeller, {"LOGITS": "logits"}, {"LABEL": "LABEL", "SCORE": "SCORE"})]


def pipeline_models() -> dict[str, dict[str, bytes]]:
    """Every model folder of the two pipelines: ``{model: {relative file: bytes}}``."""
    vocab = vocabulary()
    text = _tensor("TEXT", "TYPE_STRING", [-1])
    ids = _tensor("INPUT_IDS", "TYPE_INT64", [-1, SEQUENCE_LENGTH])
    image = _tensor("IMAGE", "TYPE_UINT8", [-1])
    pixels = _tensor("PIXELS", "TYPE_FP32", [1, 3, IMAGE_SIZE, IMAGE_SIZE])
    text_logits = _tensor("LOGITS", "TYPE_FP32", [-1, len(TEXT_LABELS)])
    image_logits = _tensor("LOGITS", "TYPE_FP32", [1, len(IMAGE_LABELS)])
    encoder = text_encoder(vocab).SerializeToString(deterministic=True)
    classifier = image_classifier().SerializeToString(deterministic=True)
    return {
        "text_tokenizer": {
            **_python("text_tokenizer", "tokenizer.py", [text], [ids]),
            "1/vocab.txt": ("\n".join(vocab) + "\n").encode(),
        },
        "text_encoder": {"1/model.onnx": encoder},
        **_labelled(
            "text_sentiment",
            text,
            [("text_tokenizer", "TEXT"), ("text_encoder", "INPUT_IDS")],
            ("text_labels", text_logits, TEXT_LABELS),
        ),
        "image_decoder": _python("image_decoder", "image_decoder.py", [image], [pixels]),
        "image_classifier": {"1/model.onnx": classifier},
        **_labelled(
            "image_color",
            image,
            [("image_decoder", "IMAGE"), ("image_classifier", "PIXELS")],
            ("image_labels", image_logits, IMAGE_LABELS),
        ),
    }


def build_pipelines(root: Path) -> list[str]:
    """Write the pipelines' model folders into ``root`` (files that hold the same bytes are
    left untouched); returns their names."""
    models = pipeline_models()
    for name, files in models.items():
        for relative, data in files.items():
            path = root / name / relative
            if relative.endswith("/"):
                path.mkdir(parents=True, exist_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            write_if_changed(path, data)
    return list(models)
