"""optimum-onnx's decoder exports (``optimum-cli export onnx --task
text-generation-with-past``: standard ONNX ops, ``past_key_values.*`` in, ``present.*`` out, the
format of onnx-community's repositories) on NUMPY, through plugserve's Core, against
onnxruntime running the same graph: a prompt into an empty cache, then decode steps feeding
back the greedy token and the cache, for one sequence and for a left-padded batch of two (as
transformers pads for generation, ``position_ids`` from the mask). The models: the generative
test models' Llama and Qwen2 (tests/support/llm.py) and a GPT-2 made here in optimum's venv
from a config (seeded weights). The builder's folders of the same models are
test_decoder_models.py's. Measured here (2026-11-25): within 4e-7 (GPT-2), 1.2e-6 (Llama) and
3.4e-6 (Qwen2) of onnxruntime, relative to the output's largest value; nothing needed fixing.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import llm
import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")

#: a GPT-2 (learned positions, fused c_attn, GELU, LayerNorm with bias): made and exported by
#: optimum's venv, so the graph is what optimum writes for the family
GPT2_SCRIPT = """
import sys, subprocess, torch
from pathlib import Path
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
out = Path(sys.argv[1])
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=128, n_embd=64, n_layer=2,
                                   n_head=4, bos_token_id=0, eos_token_id=1))
model.save_pretrained(out / "hf")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainers.BpeTrainer(
    vocab_size=300, special_tokens=["<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(
    out / "hf")
cli = Path(sys.executable).parent / "optimum-cli"
subprocess.run([str(cli), "export", "onnx", "--model", str(out / "hf"), "--task",
                "text-generation-with-past", str(out / "onnx")], check=True)
"""


def _gpt2_export():
    """optimum's export of a small GPT-2, made once under the test cache."""
    import hashlib
    import shutil
    import tempfile

    key = hashlib.sha256((GPT2_SCRIPT + str(llm.OPTIMUM.packages)).encode()).hexdigest()[:12]
    target = llm.CACHE / f"gpt2-optimum-onnx-{key}"
    if (target / "model.onnx").exists():
        return target
    python = llm.OPTIMUM.python()
    llm.CACHE.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".gpt2-", dir=llm.CACHE))
    try:
        subprocess.run(
            [str(python), "-c", GPT2_SCRIPT, str(scratch)],
            check=True,
            capture_output=True,
            timeout=900,
        )
        with contextlib.suppress(OSError):  # another run made it meanwhile
            (scratch / "onnx").rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _folder(name: str) -> Path:
    try:
        return _gpt2_export() if name == "gpt2" else llm.export(name, "optimum-onnx")
    except llm.Unavailable as error:
        pytest.skip(str(error))


def _generate(path: Path, net, lengths: list[int], steps: int = 5):
    """Prompt + ``steps`` decode steps on NUMPY and onnxruntime, left-padded rows; the worst
    error of each output kind relative to its largest value, and whether greedy tokens agree."""
    session = ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    request = net.create_infer_request()
    batch, prompt = len(lengths), max(lengths)
    ids = np.random.default_rng(batch).integers(2, 250, (batch, prompt)).astype(np.int64)
    mask = (np.arange(prompt)[None] >= prompt - np.array(lengths)[:, None]).astype(np.int64)
    cache = {
        name: np.zeros((batch, spec.shape[1], 0, spec.shape[3]), np.float32)
        for name, spec in inputs.items()
        if name.startswith("past_key_values")
    }
    worst: dict[str, float] = {}
    agreed = True
    for _ in range(steps + 1):
        feeds = {"input_ids": ids, "attention_mask": mask, **cache}
        if "position_ids" in inputs:
            positions = np.cumsum(mask, axis=1) - 1
            positions[mask == 0] = 1
            feeds["position_ids"] = positions[:, -ids.shape[1] :]
        want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        got = request.infer(feeds)
        for name, expected in want.items():
            actual = got[name]
            assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
            keep = mask.astype(bool)  # the padding's rows and cached keys are undefined
            if name == "logits":
                keep = keep[:, -expected.shape[1] :, None]
            else:
                keep = keep[:, None, : expected.shape[2], None]
            actual, expected = actual * keep, expected * keep
            kind = name.split(".")[0]
            error = float(np.abs(actual - expected).max() / np.abs(expected).max())
            worst[kind] = max(worst.get(kind, 0.0), error)
        want_next = want["logits"][:, -1].argmax(-1)
        agreed &= bool((got["logits"][:, -1].argmax(-1) == want_next).all())
        ids = want_next[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        cache = {
            n.replace("present", "past_key_values"): v for n, v in want.items() if "present" in n
        }
    return worst, agreed


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "gpt2"])
@pytest.mark.parametrize("lengths", [[9], [9, 5]], ids=["one", "left-padded-two"])
def test_optimum_decoder_generates_as_onnxruntime(core, name, lengths):
    path = _folder(name)
    net = core.load_network(str(path / "model.onnx"), "NUMPY")
    worst, agreed = _generate(path, net, lengths)
    assert max(worst.values()) <= 1e-4, worst
    assert agreed, "greedy tokens differ from onnxruntime's"
