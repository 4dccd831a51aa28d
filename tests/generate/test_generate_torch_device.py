"""The torch decoder's device side (issue 51's items 2-4), in its CPU form (CI has no GPU; the
same code runs on a card, checked there by tests/gpu/gpu_check.py's ``gen`` part):

- decode steps through :class:`DecodeGraphs`' static buffers (a CUDA graph per shape on a card;
  the same padded step eagerly here): its logits equal the unpadded eager step's, and an engine
  running its decode steps that way answers token for token the engine that does not;
- the step's logits stay on the decoder's device: the engine's sampler is the torch one, and
  what crosses to the host is the chosen ids;
- a device failure in a step (an injected CUDA error or out-of-memory in a test-only model:
  the real ones cannot be made on a CPU) fails that step's requests with a clear typed error,
  and the engine goes on serving;
- through the OpenAI API on a TORCH model: seeded sampled answers repeat, and their logprobs
  are transformers' log-softmax of the same sequence's logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_all

torch = pytest.importorskip("torch", reason="the torch decoder needs torch (pip install torch)")
pytest.importorskip("safetensors")

from plugserve.plugins.api import InferenceError, ResourceExhausted  # noqa: E402
from plugserve.plugins.torch.decoder import (  # noqa: E402
    GRAPH_SIZES,
    DecodeGraphs,
    TorchDecoder,
)
from plugserve.plugins.torch.decoder_model import DecoderModel  # noqa: E402
from plugserve.plugins.torch.sampler import TorchSampler  # noqa: E402
from plugserve.server.apps.generate.engine.engine import Engine, EngineSettings  # noqa: E402
from plugserve.server.apps.generate.text.tokenizer import Tokenizer  # noqa: E402
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams  # noqa: E402

SETTINGS = {"MAX_NUM_SEQS": "6", "MAX_NUM_BATCHED_TOKENS": "24", "INFERENCE_NUM_THREADS": "1"}
ENGINE = EngineSettings(max_num_seqs=6, max_num_batched_tokens=24)
#: tokens each answer runs (greedy, end of sequence ignored)
STEPS = 12


def _prompts(folder) -> dict[str, list[int]]:
    import llm

    tokenizer = Tokenizer.from_folder(folder)
    out = {}
    for case in llm.PROMPTS:
        if "messages" in case:
            out[case["name"]] = tokenizer.encode_chat(case["messages"])
        else:
            out[case["name"]] = tokenizer.encode(case["prompt"], add_special_tokens=True)
    return out


def _greedy(name: str, ids: list[int], steps: int = STEPS, **params) -> GenerationRequest:
    params = {"max_tokens": steps, "temperature": 0.0, "ignore_eos": True, **params}
    return GenerationRequest(name, list(ids), SamplingParams(**params))


def _ids(results) -> dict[str, list[int]]:
    return {n: [t for e in events for t in e.token_ids] for n, events in results.items()}


def _engine(llama, model=None, graphs=8) -> Engine:
    """Another engine over the loaded network's weights (``model``: a test-only subclass of
    the forward), its decode steps through DecodeGraphs' static buffers when ``graphs`` (the
    shapes kept, CUDA_GRAPHS) is above 0."""
    decoder = llama.engine.decoder
    decoder = TorchDecoder(model or decoder.model, decoder.layout, graphs=graphs, threads=1)
    return Engine("twin", decoder, llama.tokenizer, ENGINE, rows=6)


def test_the_engine_samples_on_the_decoders_device(torch_llama):
    engine = torch_llama.engine
    assert isinstance(engine.sampler, TorchSampler)
    assert engine.sampler.device == torch.device("cpu")
    assert engine.decoder.graphs is None  # on the CPU, decode steps run eagerly by default
    # the cache's tensors are the decoder's, on its device (a GPU's slots live on the card)
    assert all(t.device == engine.decoder.device for t in engine.cache.arrays.values())
    # a step's logits stay there: torch tensors, not host arrays (an idle engine's decoder)
    twin = _engine(torch_llama, graphs=0)
    try:
        decoded, prompted = twin.decoder.step(twin.cache, [], [], [], [(0, 0, [1, 2, 3])])
        assert isinstance(prompted, torch.Tensor) and prompted.device == twin.decoder.device
        decoded, prompted = twin.decoder.step(twin.cache, [0], [4], [3], [(1, 0, [5, 6])])
        assert isinstance(decoded, torch.Tensor) and decoded.shape == (1, twin.decoder.vocab)
        assert prompted.shape == (1, twin.decoder.vocab)
    finally:
        twin.close()


def test_the_padded_static_decode_step_answers_as_the_eager_engine(torch_llama, hf_llama):
    prompts = _prompts(hf_llama)
    expected = _ids(run_all(torch_llama.engine, [_greedy(n, p) for n, p in prompts.items()]))
    twin = _engine(torch_llama)
    try:
        got = _ids(run_all(twin, [_greedy(n, p) for n, p in prompts.items()]))
        graphs = twin.decoder.graphs
        assert isinstance(graphs, DecodeGraphs) and not graphs.capture  # the CPU twin
        assert graphs.runs > 0 and graphs.replays == 0
        assert twin.cache.tensors.keys[0].shape[0] == 7  # 6 slots and the scratch one
        sizes = {size for size, _width, _front in graphs.shapes}
        assert sizes <= set(GRAPH_SIZES) and len(graphs.shapes) <= 8, graphs.shapes
        assert sizes - {1, 2}, "some steps were padded up to a bigger size"
    finally:
        twin.close()
    assert got == expected


def test_the_padded_steps_logits_equal_the_unpadded_steps(torch_llama, hf_llama):
    """Three rows padded to 4 (the scratch slot's row), the keys read over a width of 128:
    the logits of the real rows are the eager step's."""
    twin = _engine(torch_llama)
    try:
        # 16-18 prompt tokens: each answer leaves a whole block (16) cached in its slot, so a
        # request that comes after another finished takes a slot of its own (the table takes
        # a slot holding no block first), however the three threads are scheduled; with
        # shorter prompts a late one took the first one's slot (failed under a loaded CI)
        prompts = {f"p{i}": list(range(20 + 30 * i, 36 + 31 * i)) for i in range(3)}
        run_all(twin, [_greedy(n, p, 4) for n, p in prompts.items()])
        model = twin.decoder.model
        rows = [s.index for s in twin.table.slots if len(s.tokens) > 4]
        assert len(rows) == 3, [len(s.tokens) for s in twin.table.slots]
        lens = [len(twin.table.slots[r].tokens) for r in rows]
        ids = np.arange(7, 10, dtype=np.int64)
        positions = np.asarray(lens, np.int64)
        with torch.inference_mode():
            fixed = twin.decoder.graphs.run(ids, positions, rows)
            at = torch.from_numpy(positions)
            eager = model.forward(
                twin.cache.tensors, torch.from_numpy(ids), at, torch.tensor(rows),
                model.plan(lens, [1] * 3, rows, at),
            )  # fmt: skip
            # the rows in the other order: the other way of reading the keys (in place when
            # the rows are 0..2, gathered when not), the same logits in that order
            turned = twin.decoder.graphs.run(ids[::-1].copy(), positions[::-1].copy(), rows[::-1])
        shapes = twin.decoder.graphs.shapes
        assert (4, 128, False) in shapes and (rows != [0, 1, 2] or (4, 128, True) in shapes)
        assert fixed.shape == (3, model.shape.vocab)
        torch.testing.assert_close(fixed, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(turned, eager.flip(0), rtol=1e-5, atol=1e-5)
    finally:
        twin.close()


class Faulty(DecoderModel):
    """The tiny model, failing any forward whose tokens include :attr:`CUDA_ERROR` (as a
    CUDA kernel's fault surfaces in torch) or :attr:`OOM` (the card's out-of-memory)."""

    CUDA_ERROR, OOM = 5, 6

    def forward(self, cache, ids, positions, slots, plan):
        if bool((ids == self.CUDA_ERROR).any()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        if bool((ids == self.OOM).any()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB (injected)")
        return super().forward(cache, ids, positions, slots, plan)


def _events(engine, request):
    try:
        return list(engine.generate(request)), None
    except Exception as exc:
        return None, exc


@pytest.mark.parametrize("graphs", [8, 0], ids=["static-step", "eager"])
def test_a_device_failure_fails_its_step_and_the_engine_goes_on(torch_llama, hf_llama, graphs):
    base = torch_llama.engine.decoder.model
    faulty = Faulty(base.shape, base.w, base.device, base.dtype)
    engine = _engine(torch_llama, faulty, graphs=graphs)
    prompts = _prompts(hf_llama)
    hello = prompts["hello"]
    try:
        expected = _ids(run_all(torch_llama.engine, [_greedy("ok", hello)]))["ok"]
        # a decode step fails: the first token is forced to the faulty one, the next step
        # feeds it to the forward
        for token, kind, words in (
            (Faulty.CUDA_ERROR, InferenceError, "illegal memory access"),
            (Faulty.OOM, ResourceExhausted, "out of memory"),
        ):
            events, error = _events(
                engine, _greedy(f"bad-{token}", hello, logit_bias={token: 100.0})
            )
            assert isinstance(error, kind), (events, error)
            assert "torch decoder" in str(error) and words in str(error)
            # a prompt step fails
            _, error = _events(engine, _greedy(f"prompt-{token}", [*hello[:3], token]))
            assert isinstance(error, kind)
            # the engine goes on: the next request gets its whole answer
            got = _ids({"ok": list(engine.generate(_greedy("ok", hello)))})["ok"]
            assert got == expected
    finally:
        engine.close()


@pytest.mark.slow
def test_seeded_answers_repeat_and_logprobs_are_transformers_through_the_api(hf_llama):
    """A real server, the folder on TORCH, the official client: a seeded sampled completion
    twice gives the same tokens; each token's logprob and top_logprobs are log-softmax of
    transformers' logits for the same sequence (f32); a JSON schema's answers parse."""
    pytest.importorskip("openai", reason="pip install openai (the test extra)")
    transformers = pytest.importorskip("transformers", reason="the reference is transformers'")
    from openai_serving import client, serving

    body = {
        "model": "llama", "prompt": "The capital of France is", "max_tokens": 10,
        "temperature": 0.9, "top_p": 0.95, "seed": 1234, "logprobs": 3,
        "extra_body": {"ignore_eos": True, "return_token_ids": True, "top_k": 40},
    }  # fmt: skip
    with serving({"llama": (hf_llama, "TORCH", {"INFERENCE_NUM_THREADS": "1"})}) as server:
        api = client(server)
        first = api.completions.create(**body)
        again = api.completions.create(**body)
        other = api.completions.create(**{**body, "seed": 99})
        # structured output: the grammar's mask applied on the device, n = 3 sampled choices
        schema = {
            "type": "object",
            "properties": {
                "color": {"type": "string", "enum": ["red", "green", "blue"]},
                "ok": {"type": "boolean"},
            },
            "required": ["color", "ok"],
            "additionalProperties": False,
        }
        shaped = api.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "A thing as JSON."}],
            max_tokens=40, temperature=0.9, seed=5, n=3,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        )  # fmt: skip
    for answer in shaped.choices:
        assert answer.finish_reason == "stop", answer.message.content
        value = json.loads(answer.message.content)
        assert value["color"] in ("red", "green", "blue") and value["ok"] in (True, False)
    choice = first.choices[0]
    ids = choice.model_extra["token_ids"]
    prompt_ids = first.choices[0].model_extra.get("prompt_token_ids") or Tokenizer.from_folder(
        hf_llama
    ).encode(body["prompt"], add_special_tokens=True)
    assert len(ids) == 10
    assert again.choices[0].model_extra["token_ids"] == ids
    assert again.choices[0].text == choice.text
    assert other.choices[0].model_extra["token_ids"] != ids
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_llama), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
    got = choice.logprobs.token_logprobs
    want = [float(lp[i, t]) for i, t in enumerate(ids)]
    assert np.allclose(got, want, atol=1e-4), (got, want)
    for i, top in enumerate(choice.logprobs.top_logprobs):
        # the 3 best, and the chosen token's (OpenAI's completions add it); two ids of one
        # text share a key
        allowed = [*torch.topk(lp[i], 3).values.tolist(), want[i]]
        assert top and all(min(abs(v - a) for a in allowed) < 1e-4 for v in top.values())


def test_a_step_on_the_cpu_takes_512_tokens_unless_told(torch_llama):
    """MAX_NUM_BATCHED_TOKENS unset (0, the server's default) is the decoder's own: the torch
    decoder's LM head runs on each sequence's last token only, so its step takes 512 tokens on
    the CPU (2048 on a card) where a graph's, whose logits are every position's, takes 256. A
    300-token prompt is then one forward, not 256 + 44, and its answer is the chunked one's."""
    decoder = torch_llama.engine.decoder
    engines = {}
    for name, budget in (("default", 0), ("chunked", 256)):
        twin = TorchDecoder(decoder.model, decoder.layout, threads=1)
        settings = EngineSettings(max_num_seqs=2, max_num_batched_tokens=budget)
        engines[name] = Engine(name, twin, torch_llama.tokenizer, settings, rows=2)
    try:
        assert engines["default"].settings.max_num_batched_tokens == 512
        assert engines["chunked"].settings.max_num_batched_tokens == 256
        prompt = [int(t) for t in np.random.default_rng(3).integers(100, 1000, 300)]
        answers, forwards = {}, {}
        for name, engine in engines.items():
            before = engine.decoder.forwards
            events = list(engine.generate(_greedy(name, prompt, steps=1)))
            answers[name] = [t for e in events for t in e.token_ids]
            forwards[name] = engine.decoder.forwards - before
        assert forwards == {"default": 1, "chunked": 2}
        assert answers["default"] == answers["chunked"] and len(answers["default"]) == 1
    finally:
        for engine in engines.values():
            engine.close()
