"""Safetensors folders on the torch decoder (issue 51, its CPU form): the engine in process on a
Hugging Face folder as published (``config.json``, ``tokenizer.json``, ``model.safetensors`` of
seeded random weights, the trained byte-level BPE of tests/support/llm_hf.py), greedy in f32,
token for token transformers' own greedy ``generate`` on the same folder for 12 prompts run at
once (batched decoding, chunked prompts beside decoding rows in one forward, slots reused);
Llama-style (GQA, untied head, BOS) and Qwen2-style (q/k/v bias, tied head) folders, and the
other families' switches (Qwen3's q/k norms, Mistral's sliding window, Gemma's scaled
embeddings, Phi-3's fused projections) on folders derived from them. Forks (``n`` > 1), the
prefix cache, sharded weights, bf16, and the refusals. transformers runs in process (torch's
CPU wheel and the zoo extra's transformers); the tests skip without them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import post, run_all

torch = pytest.importorskip("torch", reason="the torch decoder needs torch (pip install torch)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers'")
pytest.importorskip("safetensors")

from plugserve.plugins.api import (  # noqa: E402
    InvalidArgument,
    InvalidModel,
    NotFound,
    ResourceExhausted,
)
from plugserve.server.apps.generate.folder import graph_of, is_transformers_folder  # noqa: E402
from plugserve.server.apps.generate.text.tokenizer import Tokenizer  # noqa: E402
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams  # noqa: E402

#: tokens each answer is compared over (greedy, end of sequence ignored)
STEPS = 16
#: the 12 prompts: the references' 9 (raw and chats) and three more
EXTRA = [
    {"name": "numbers", "prompt": "1 2 3 4 5 6 7 8 9 10 11 12"},
    {"name": "one-word", "prompt": "apples"},
    {"name": "json", "prompt": '{"name": "Bob", "age": 31, "city": "Rome"}'},
]
#: a small step budget and fewer slots than prompts: the long prompts are chunked beside
#: decoding rows, and slots are freed and taken again; one torch thread (a tiny model's steps
#: on 2 busy cores are 10x slower with 2: plugins/torch/decoder.py's docstring)
SETTINGS = {"MAX_NUM_SEQS": "6", "MAX_NUM_BATCHED_TOKENS": "24", "INFERENCE_NUM_THREADS": "1"}


def _prompts():
    import llm

    return [*llm.PROMPTS, *EXTRA]


def _prompt_ids(folder: Path) -> dict[str, list[int]]:
    """Each prompt's ids as the server makes them (the template rendered, then tokenized)."""
    tokenizer = Tokenizer.from_folder(folder)
    out = {}
    for case in _prompts():
        if "messages" in case:
            out[case["name"]] = tokenizer.encode_chat(case["messages"])
        else:
            out[case["name"]] = tokenizer.encode(case["prompt"], add_special_tokens=True)
    return out


def _transformers_greedy(folder: Path, prompts: dict[str, list[int]], dtype=None) -> dict:
    """transformers' own ``generate`` (greedy, no stop at EOS) on ``folder``, one prompt at a
    time, in ``dtype`` (f32 by default)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype or torch.float32
    )
    model.eval()
    # no end of sequence: every answer runs STEPS tokens (the engine's ignore_eos)
    model.generation_config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=STEPS, eos_token_id=None, pad_token_id=0
    )
    out = {}
    with torch.no_grad():
        for name, ids in prompts.items():
            tensor = torch.tensor([ids])
            made = model.generate(
                tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=STEPS
            )
            out[name] = made[0, len(ids) :].tolist()
    return out


def _greedy(name: str, ids: list[int], steps: int = STEPS, **extra) -> GenerationRequest:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    return GenerationRequest(name, list(ids), params, **extra)


def _engine_greedy(network, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    results = run_all(network.engine, [_greedy(n, ids) for n, ids in prompts.items()])
    return {n: [t for e in events for t in e.token_ids] for n, events in results.items()}


def _rewrite(source: Path, target: Path, config: dict, tensors: dict) -> Path:
    """A copy of ``source`` with another config.json and model.safetensors."""
    from safetensors.numpy import save_file

    shutil.copytree(source, target)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _load(folder: Path):
    from safetensors.numpy import load_file

    return json.loads((folder / "config.json").read_text()), load_file(
        str(folder / "model.safetensors")
    )


def _qwen3(source: Path, target: Path) -> Path:
    """tiny-qwen2 as Qwen3: no q/k/v bias, an RMSNorm over each head of q and k."""
    config, tensors = _load(source)
    config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False)
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    rng = np.random.default_rng(3)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn."
        for x in "qkv":
            tensors.pop(f"{p}{x}_proj.bias")
        for x in "qk":
            tensors[f"{p}{x}_norm.weight"] = (
                1 + 0.2 * rng.standard_normal(config["head_dim"])
            ).astype(np.float32)
    return _rewrite(source, target, config, tensors)


def _mistral(source: Path, target: Path) -> Path:
    """tiny-llama as Mistral with a sliding window of 8 (the long prompts outgrow it)."""
    config, tensors = _load(source)
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    return _rewrite(source, target, config, tensors)


def _gemma(source: Path, target: Path) -> Path:
    """tiny-llama as Gemma: tied head, embeddings scaled by sqrt(hidden), norms as 1 + w. The
    table is divided by that scale (the residual stream starts at unit variance), attention's
    and the MLP's outputs made 10x (else a tied head answers the last token again and again)
    and the final norm 4x (logits of a standard deviation near 4)."""
    config, tensors = _load(source)
    config.update(
        model_type="gemma", architectures=["GemmaForCausalLM"], tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip
    tensors.pop("lm_head.weight")
    tensors["model.embed_tokens.weight"] /= np.float32(config["hidden_size"] ** 0.5)
    tensors["model.norm.weight"] *= np.float32(4.0)
    for name in list(tensors):  # what attention and the MLP add outweighs the token's own
        if name.endswith(("o_proj.weight", "down_proj.weight")):  # embedding (llm_hf's gain)
            tensors[name] *= np.float32(10.0)
    for name in list(tensors):
        if name.endswith("norm.weight"):
            tensors[name] = tensors[name] - 1.0
    return _rewrite(source, target, config, tensors)


def _phi3(source: Path, target: Path) -> Path:
    """tiny-llama as Phi-3: q/k/v and gate/up fused, half the head's features rotated."""
    config, tensors = _load(source)
    config.update(
        model_type="phi3", architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.5,
        rope_theta=10000.0,
    )  # fmt: skip
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [tensors.pop(f"{p}self_attn.{x}_proj.weight") for x in "qkv"]
        )
        tensors[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [tensors.pop(f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")]
        )
    return _rewrite(source, target, config, tensors)


VARIANTS = {
    "tiny-llama": ("tiny-llama", None),
    "tiny-qwen2": ("tiny-qwen2", None),
    "qwen3": ("tiny-qwen2", _qwen3),
    "mistral": ("tiny-llama", _mistral),
    "gemma": ("tiny-llama", _gemma),
    "phi3": ("tiny-llama", _phi3),
}


@pytest.fixture(scope="module")
def folders(llm_folder, tmp_path_factory):
    """``get(variant)``: the folder of a key of :data:`VARIANTS`."""
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            recipe, rewrite = VARIANTS[variant]
            source = llm_folder(recipe, "hf")
            made[variant] = (
                source
                if rewrite is None
                else rewrite(source, tmp_path_factory.mktemp("torch") / variant)
            )
        return made[variant]

    return get


@pytest.fixture(scope="module")
def llama(core, folders):
    network = core.load_network(str(folders("tiny-llama")), "TORCH", SETTINGS)
    yield network
    network.close()


def test_a_safetensors_folder_is_a_generative_model(folders, core):
    folder = folders("tiny-llama")
    assert is_transformers_folder(folder)
    assert graph_of(folder) == ("safetensors", folder / "model.safetensors")
    if not torch.cuda.is_available():  # AUTO: the GPU when torch sees one, else the CPU
        network = core.load_network(str(folder), "AUTO", {"INFERENCE_NUM_THREADS": "1"})
        try:
            assert network.device == "TORCH"
            assert network.engine.decoder.model.device.type == "cpu"
        finally:
            network.close()


@pytest.mark.parametrize("variant", ["tiny-llama", "tiny-qwen2"])
def test_greedy_ids_are_transformers_own_for_12_prompts(core, folders, variant):
    folder = folders(variant)
    prompts = _prompt_ids(folder)
    assert len(prompts) == 12
    network = core.load_network(str(folder), "TORCH", SETTINGS)
    try:
        got = _engine_greedy(network, prompts)
        assert network.precision == "f32"
        assert network.engine.decoder.steps > 0  # chunks and decoding rows shared forwards
    finally:
        network.close()
    expected = _transformers_greedy(folder, prompts)
    assert got == expected


def test_the_decoder_reads_the_devices_one_configuration(core, folders):
    """The decoder is configured by the torch device's keys, with their one meaning:
    CUDA_GRAPHS a count of decode shapes kept (a config.pbtxt's "8"; on TORCH the CPU twin's
    static buffers, the least recently used shape dropped past it), the old YES/NO read as
    64/0, the precision's old long names read; the greedy ids stay transformers' own."""
    from plugserve.plugins.torch.config import GRAPHS_YES, TorchConfiguration

    old = TorchConfiguration({"CUDA_GRAPHS": "YES", "INFERENCE_PRECISION_HINT": "float32"})
    assert old.get("CUDA_GRAPHS") == GRAPHS_YES and old.get("INFERENCE_PRECISION_HINT") == "f32"
    assert TorchConfiguration({"CUDA_GRAPHS": "NO"}).get("CUDA_GRAPHS") == 0
    folder = folders("tiny-llama")
    prompts = _prompt_ids(folder)
    network = core.load_network(
        str(folder), "TORCH", {**SETTINGS, "CUDA_GRAPHS": "2", "INFERENCE_PRECISION_HINT": "fp32"}
    )
    try:
        got = _engine_greedy(network, prompts)
        graphs = network.engine.decoder.graphs
        assert network.precision == "f32" and graphs is not None and graphs.keep == 2
        assert graphs.runs > 0 and 0 < len(graphs.shapes) <= 2, graphs.shapes
    finally:
        network.close()
    assert got == _transformers_greedy(folder, prompts)


@pytest.mark.parametrize("variant", ["qwen3", "mistral", "gemma", "phi3"])
def test_other_families_are_transformers_own(core, folders, variant):
    folder = folders(variant)
    prompts = dict(list(_prompt_ids(folder).items())[:6])
    network = core.load_network(str(folder), "TORCH", SETTINGS)
    try:
        got = _engine_greedy(network, prompts)
    finally:
        network.close()
    assert got == _transformers_greedy(folder, prompts)


def test_forks_and_the_prefix_cache_give_the_same_answer(llama, folders):
    prompts = _prompt_ids(folders("tiny-llama"))
    ids = prompts["long"]
    engine = llama.engine
    alone = [t for e in engine.generate(_greedy("alone", ids)) for t in e.token_ids]
    again = list(engine.generate(_greedy("again", ids)))
    assert again[-1].cached_tokens >= engine.table.block_size
    assert [t for e in again for t in e.token_ids] == alone
    forked = list(engine.generate(_greedy("forked", ids, n=3)))
    by_choice: dict[int, list[int]] = {}
    for event in forked:
        by_choice.setdefault(event.index, []).extend(event.token_ids)
    assert by_choice == {0: alone, 1: alone, 2: alone}


def test_sharded_weights_load_as_one_file(core, folders, tmp_path):
    from safetensors.numpy import load_file, save_file

    source = folders("tiny-llama")
    folder = tmp_path / "sharded"
    shutil.copytree(source, folder)
    (folder / "model.safetensors").unlink()
    tensors = load_file(str(source / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    assert graph_of(folder) == ("safetensors", folder / "model.safetensors.index.json")
    prompts = dict(list(_prompt_ids(source).items())[:3])
    network = core.load_network(
        str(folder), "TORCH", {"MAX_NUM_SEQS": "3", "INFERENCE_NUM_THREADS": "1"}
    )
    try:
        got = _engine_greedy(network, prompts)
    finally:
        network.close()
    single = core.load_network(
        str(source), "TORCH", {"MAX_NUM_SEQS": "3", "INFERENCE_NUM_THREADS": "1"}
    )
    try:
        assert got == _engine_greedy(single, prompts)
    finally:
        single.close()


@pytest.mark.slow
def test_bf16_weights_and_cache(core, folders):
    folder = folders("tiny-llama")
    prompts = dict(list(_prompt_ids(folder).items())[:6])
    network = core.load_network(
        str(folder), "TORCH", {**SETTINGS, "INFERENCE_PRECISION_HINT": "bf16"}
    )
    try:
        assert network.precision == "bf16"
        cache = network.engine.cache
        assert all(t.dtype == torch.bfloat16 for t in cache.arrays.values())
        f32_bytes = network.engine.decoder.layout.bytes_per_slot
        assert cache.nbytes == f32_bytes * cache.rows  # two bytes an element
        got = _engine_greedy(network, prompts)
    finally:
        network.close()
    expected = _transformers_greedy(folder, prompts, dtype=torch.bfloat16)
    # bf16 rounds differently in each implementation: the first tokens agree
    agree = sum(got[n][:4] == expected[n][:4] for n in prompts)
    assert agree >= len(prompts) - 1, (got, expected)


def test_refusals_are_typed_and_say_why(core, folders, tmp_path):
    folder = folders("tiny-llama")
    with pytest.raises(InvalidArgument, match="TORCH"):
        core.load_network(str(folder), "NUMPY")
    if "GPU" not in core.available_devices:  # the Core's answer, as for any model on it
        with pytest.raises(NotFound, match="'GPU' is unavailable"):
            core.load_network(str(folder), "GPU")
    # the cache's bytes are checked against the free memory before anything is allocated
    with pytest.raises(ResourceExhausted, match="free"):
        core.load_network(
            str(folder), "TORCH", {"MAX_NUM_SEQS": str(10**8), "KV_CACHE_BYTES": str(2**50)}
        )
    with pytest.raises(InvalidArgument, match="INFERENCE_PRECISION_HINT"):
        core.load_network(str(folder), "TORCH", {"INFERENCE_PRECISION_HINT": "f8"})
    config, tensors = _load(folder)
    config.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    other = _rewrite(folder, tmp_path / "neox", config, tensors)
    with pytest.raises(InvalidModel, match="gpt_neox"):
        core.load_network(str(other), "TORCH")
    config, tensors = _load(folder)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    broken = _rewrite(folder, tmp_path / "broken", config, tensors)
    with pytest.raises(InvalidModel, match="up_proj"):
        core.load_network(str(broken), "TORCH")


@pytest.mark.slow
def test_the_openai_chat_route_streams_transformers_answer(folders):
    """A real server (the folder as a repository entry on TORCH), the official client: the
    streamed chat's token ids are transformers' greedy ones, arriving as they are made."""
    pytest.importorskip("openai", reason="pip install openai (the test extra)")
    from openai_serving import client, serving

    folder = folders("tiny-qwen2")
    prompts = _prompt_ids(folder)
    expected = _transformers_greedy(folder, {"chat": prompts["chat"]})["chat"]
    case = next(c for c in _prompts() if c["name"] == "chat")
    with serving({"qwen": (folder, "TORCH")}) as server:
        api = client(server)
        stream = api.chat.completions.create(
            model="qwen",
            messages=case["messages"],
            max_tokens=STEPS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        chunks = list(stream)
        ids, text = [], []
        for chunk in chunks[:-1]:
            for choice in chunk.choices:
                ids += choice.model_extra.get("token_ids") or []
                text.append(choice.delta.content or "")
        assert chunks[-1].usage.completion_tokens == STEPS
        assert chunks[-1].usage.prompt_tokens == len(prompts["chat"])
        assert ids == expected
        assert "".join(text) == Tokenizer.from_folder(folder).decode(expected, True)
        assert len(chunks) > STEPS // 2, "tokens arrive as they are made, not in one piece"
        models = [m.id for m in api.models.list().data]
        assert "qwen" in models
        # Triton's generate route, the same engine: a raw prompt's greedy answer
        raw = _transformers_greedy(folder, {"capital": prompts["capital"]})["capital"]
        body = {
            "text_input": "The capital of France is",
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(
                {"max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
            ),
        }
        answer = json.loads(post(server, "/v2/models/qwen/generate", body))
        assert answer["text_output"] == Tokenizer.from_folder(folder).decode(raw, True)


def test_the_fixed_shape_decode_step_gives_the_eager_steps_logits(llama, folders):
    """What a CUDA graph captures (decoding rows over the whole slot, masked past each row's
    position: ``DecoderModel.decode_plan``) computes the eager step's logits, here on the CPU."""
    prompts = _prompt_ids(folders("tiny-llama"))
    engine = llama.engine
    run_all(engine, [_greedy(n, prompts[n], 4) for n in ("hello", "long", "chat")])
    model = engine.decoder.model
    tensors = engine.cache.tensors
    capacity = engine.decoder.layout.capacity
    rows = [slot.index for slot in engine.table.slots if len(slot.tokens) > 4]
    assert len(rows) >= 2  # slots keep their tokens (the prefix cache)
    lens = [len(engine.table.slots[r].tokens) for r in rows]
    ids = torch.arange(7, 7 + len(rows))
    positions = torch.tensor(lens)
    slots = torch.tensor(rows)
    with torch.inference_mode():
        eager = model.forward(
            tensors, ids, positions, slots, model.plan(lens, [1] * len(rows), rows, positions)
        )
        fixed = model.forward(
            tensors, ids, positions, slots, model.decode_plan(slots, positions, capacity)
        )
    assert eager.shape == (len(rows), model.shape.vocab)
    torch.testing.assert_close(fixed, eager, rtol=1e-5, atol=1e-5)


def test_without_torch_the_load_says_what_to_install(folders):
    """The base server has no torch: a safetensors folder's load is refused, naming the
    extra (torch made unimportable in a process of its own)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from plugserve.server import Core\n"
        "from plugserve.plugins.api import InvalidModel\n"
        "try:\n"
        f"    Core().load_network({str(folders('tiny-llama'))!r}, 'TORCH')\n"
        "except InvalidModel as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "REFUSED" in done.stdout, done.stdout + done.stderr
    assert "plugserve[torch]" in done.stdout


def _fused_and_not(model) -> dict[bool, torch.Tensor]:
    """A prompt chunk's and a decode step's logits with the fused forward and without."""
    from plugserve.plugins.torch.decoder_model import KVTensors

    ids = torch.tensor([5, 17, 42, 99, 7, 300, 12, 8])
    logits = {}
    for fused in (True, False):
        model.fused = fused
        cache = KVTensors(model.shape, 2, 32, model.dtype, torch.device("cpu"))
        with torch.inference_mode():
            positions = torch.arange(8)
            chunk = model.forward(cache, ids, positions, torch.zeros(8, dtype=torch.long),
                                  model.plan([0], [8], [0], positions))  # fmt: skip
            step = torch.tensor([8])
            decoded = model.forward(cache, torch.tensor([23]), step, torch.tensor([0]),
                                    model.plan([8], [1], [0], step))  # fmt: skip
        logits[fused] = torch.cat([chunk, decoded])
    return logits


@pytest.mark.parametrize("variant", ["tiny-llama", "tiny-qwen2", "phi3"])
def test_the_fused_low_precision_forward_computes_transformers_layers(folders, variant):
    """bf16 and f16 run each layer in about half the kernels (``DecoderModel._layer_fused``:
    fused rms_norm, one q/k/v product rotated at once, one gate/up product; issue 59's H100
    run found the 220 M decoder's step kernel-bound at 43 kernels a layer). The same function
    as transformers' order: forced on f32 weights its logits are the unfused forward's within
    float32 rounding, over a prompt chunk and a decode step, with biases (qwen2) and a partial
    rotary (phi3); in bf16 within bf16's; the single weights are views into the fused ones
    (no second copy). f32 itself keeps the unfused order (greedy ids = transformers')."""
    from plugserve.plugins.torch.decoder_model import DecoderModel, _fuse

    folder = folders(variant)
    config = json.loads((folder / "config.json").read_text())
    exact = DecoderModel.load(folder, config, torch.device("cpu"), torch.float32)
    assert not exact.fused
    _fuse(exact.shape, exact.w)
    logits = _fused_and_not(exact)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-4)
    model = DecoderModel.load(folder, config, torch.device("cpu"), torch.bfloat16)
    assert model.fused
    p = "model.layers.0."
    assert model.w[p + "self_attn.v_proj.weight"].untyped_storage().data_ptr() == (
        model.w[p + "qkv"].untyped_storage().data_ptr()
    )
    logits = _fused_and_not(model)
    scale = float(logits[False].abs().max())
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=0.05 * scale)
