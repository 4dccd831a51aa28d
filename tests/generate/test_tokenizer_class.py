"""Tokenization equals transformers' (issue 42) on folders whose tokenizer class rebuilds
``tokenizer.json``'s pipeline: transformers 5 loads a Qwen2-type folder as ``Qwen2Tokenizer``,
which replaces the file's pre-tokenizer (GPT-2's byte-level regex, as a freshly trained
tokenizer has it) with Qwen2's (digits one by one), so the file alone gives other ids.

Folders are made as transformers 5 saves them (``save_pretrained`` of a trained tokenizer and a
``Qwen2Config``) and compared with ``AutoTokenizer`` itself; then a served Qwen2-type model's
prompt ids and greedy answer are compared with transformers 5 running the same weights (torch).
Needs transformers >= 5 (the test extra's transformers may be older: then these skip).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="pip install 'transformers>=5'")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(
        f"transformers {transformers.__version__} reads tokenizer.json as it is; these tests "
        "compare with transformers 5's class rebuild: pip install 'transformers>=5'",
        allow_module_level=True,
    )

from plugserve.server.apps.generate.text.tokenizer import Tokenizer  # noqa: E402
from plugserve.server.apps.generate.text.tokenizer_class import transformers_class  # noqa: E402

TEXTS = [
    "There are 42 apples in the box; 17 + 25 = 42, in 2024.",
    "def add(a, b):\n    return a + b  # x**2\n\n",
    "Café naïve 東京 ☕ — e\u0301 (a combining accent, NFC joins it)",
    "I'm here, you'll see: they've 3.14159 reasons.",
    "  leading spaces\tand\ttabs\r\n\r\nand lines",
    "<|im_start|>user\nWhat is 12*12?<|im_end|>\n",
]
CHAT = [
    {"role": "system", "content": "You count: 1, 2, 3."},
    {"role": "user", "content": "What comes after 99 and 1000?"},
]


def _save(folder: Path, model_type: str, declared: str | None) -> None:
    """A tokenizer trained as tests/support/llm_hf.py trains tiny-qwen2's (byte-level BPE with
    GPT-2's regex), saved by transformers 5 with a config of ``model_type``; the tokenizer
    config then declares ``declared`` (None: no class)."""
    import llm
    import llm_hf

    spec = llm.MODELS["tiny-qwen2"]
    style = llm_hf.STYLES["qwen2"]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=llm_hf.train_tokenizer(spec),
        eos_token=style.eos,
        pad_token=style.pad,
        chat_template=style.template,
    )
    fast.save_pretrained(str(folder))
    config = transformers.AutoConfig.for_model(model_type, vocab_size=spec.vocab)
    config.save_pretrained(str(folder))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("tokenizer_class", None)
    if declared is not None:
        settings["tokenizer_class"] = declared
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.fixture(scope="module")
def scratch():
    root = Path(tempfile.mkdtemp(prefix="plugserve-tokenizer-class-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_qwen2_folder_saved_by_transformers_5_tokenizes_as_autotokenizer(scratch):
    folder = scratch / "saved"
    _save(folder, "qwen2", "TokenizersBackend")  # what save_pretrained writes
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert type(reference).__name__ == "Qwen2Tokenizer"
    ours = Tokenizer.from_folder(folder)
    from tokenizers import Tokenizer as Backend

    as_written = Backend.from_file(str(folder / "tokenizer.json"))
    differs = 0
    for text in TEXTS:
        for special in (True, False):
            expected = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, special) == expected, (text, special)
            differs += as_written.encode(text, add_special_tokens=special).ids != expected
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert differs, "the file's own pipeline gives transformers' ids: the test shows nothing"
    chat = reference.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert ours.encode_chat(CHAT) == chat


#: (model type, declared class): transformers 5's choice differs across these
COMBINATIONS = [
    (model_type, declared)
    for model_type in ("qwen2", "qwen3", "mistral", "llama")
    for declared in (None, "PreTrainedTokenizerFast", "TokenizersBackend", "Qwen2Tokenizer")
]


@pytest.mark.parametrize(("model_type", "declared"), COMBINATIONS, ids=str)
def test_the_class_transformers_picks_and_its_ids(scratch, model_type, declared):
    folder = scratch / f"{model_type}-{declared}"
    _save(folder, model_type, declared)
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    rebuilt = type(reference).__name__ in ("Qwen2Tokenizer", "Qwen3_5Tokenizer")
    assert bool(transformers_class(model_type, declared)) == rebuilt, type(reference).__name__
    ours = Tokenizer.from_folder(folder)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), (model_type, declared, text)


def test_a_served_qwen2_model_s_prompt_and_greedy_answer_are_transformers_5s(llm_folder):
    """The served folder's tokenizer files are those tests/support/llm.py wrote for a
    Qwen2-type model (tokenizer_class PreTrainedTokenizerFast): transformers 5 tokenizes a
    prompt with numbers into more ids than the file alone (the reference answers, made with
    transformers 4, have the file's); the server gives transformers 5's ids, and its greedy
    answer to them is transformers 5's, computed here from the same weights."""
    torch = pytest.importorskip("torch", reason="pip install torch (the test extra's zoo)")
    openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
    from openai_serving import client, serving

    served = llm_folder("tiny-qwen2", "optimum-onnx")
    weights = llm_folder("tiny-qwen2", "hf")
    prompt = "There are 42 apples in the quiet box. What is 17 plus 25? 17 + 25 ="
    expected_prompt = transformers.AutoTokenizer.from_pretrained(str(served)).encode(prompt)
    from tokenizers import Tokenizer as Backend

    as_written = Backend.from_file(str(served / "tokenizer.json")).encode(prompt).ids
    assert len(expected_prompt) > len(as_written), "transformers 5 splits the digits"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    model.eval()
    sequence = list(expected_prompt)
    with torch.no_grad():
        for _ in range(16):
            logits = model(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(torch.argmax(logits)))
    expected_answer = sequence[len(expected_prompt) :]
    with serving({"qwen": (served, "NUMPY")}) as server:
        answer = client(server).completions.create(
            model="qwen", prompt=prompt, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
    assert isinstance(answer, openai.types.Completion)
    choice = answer.choices[0]
    assert choice.model_extra["prompt_token_ids"] == expected_prompt
    assert choice.model_extra["token_ids"] == expected_answer
