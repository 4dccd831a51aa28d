"""optimum-intel's OpenVINO IR export of the generative test models, served on OPENVINO in
openvino's paged-attention form (server/apps/generate/backends/openvino.py): every reference prompt
at once, of different lengths, answering transformers' own f32 greedy tokens, in process
through the engine and through a real server (KServe generate and ModelStreamInfer, and the
OpenAI API with the official client).

The IR folders are made by tests/support/llm.py with optimum-intel 2.2.0 in a venv of its
own; the tests skip, naming the reason and the install line, where it cannot run.
"""

from __future__ import annotations

import json
import queue
import threading

import numpy as np
import pytest
from conftest import continuation, exported, greedy, post, reference, run_all
from serving import RunningServer

from plugserve.plugins.api import InvalidArgument
from plugserve.server.apps.generate.backends.openvino import PagedDecoder, PagedKVCache
from plugserve.server.apps.generate.text.tokenizer import Tokenizer
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

pytest.importorskip("openvino")

MODELS = ["tiny-llama", "tiny-qwen2"]
#: f32 on openvino: what makes its answers transformers' own (ACCURACY alone would do; the
#: hint says it twice, as users write it)
F32 = {"EXECUTION_MODE_HINT": "ACCURACY", "INFERENCE_PRECISION_HINT": "f32"}
#: a small step budget: the long prompts are computed in chunks beside decoding rows
SMALL = {"MAX_NUM_SEQS": "6", "MAX_NUM_BATCHED_TOKENS": "24"}


def available(core) -> None:
    if "OPENVINO" not in core.available_devices:
        pytest.skip("OPENVINO is not available here (pip install 'plugserve[openvino]')")


@pytest.fixture(scope="module", params=MODELS)
def model(request, core):
    """(name, the IR folder loaded in f32 with a small budget, its reference answers)."""
    available(core)
    name = request.param
    folder = exported(name, "openvino")
    net = core.load_network(str(folder), "OPENVINO", {**F32, **SMALL})
    yield name, net, reference(name)
    net.close()


def test_an_ir_folder_runs_in_the_paged_form_with_its_cache_in_blocks(model):
    _name, net, _ref = model
    engine = net.engine
    assert isinstance(engine.decoder, PagedDecoder)
    assert isinstance(engine.cache, PagedKVCache)
    specs = {s.name: s for s in net.decoder_network.inputs}
    for name, array in engine.cache.arrays.items():  # what the compiled network declares
        assert array.dtype == specs[name].dtype == np.float32
        assert array.shape[1:] == specs[name].shape[1:]
        assert array.shape[0] == engine.cache.rows * engine.cache.per_slot
    assert net.precision == "f32"


def test_every_prompt_at_once_answers_transformers_token_for_token(model):
    name, net, ref = model
    engine = net.engine
    forwards, mixed = engine.decoder.forwards, engine.decoder.steps
    cases = ref["cases"]
    steps = ref["max_new_tokens"]
    results = run_all(engine, [greedy(c, steps) for c in cases])
    for case in cases:
        events = results[case["name"]]
        ids = [t for e in events for t in e.token_ids]
        assert ids == case["ids"], (name, case["name"])
        logprobs = [lp.logprob for e in events for lp in e.logprobs]
        assert logprobs == pytest.approx(case["logprobs"], abs=2e-3), case["name"]
        tops = [[t for t, _ in lp.top] for e in events for lp in e.logprobs]
        assert [t[0] for t in tops] == [top[0][0] for top in case["top_logprobs"]]
        assert events[-1].finish_reason == "length"
        assert events[-1].completion_tokens == steps
    # 9 prompts of 5 to 112 tokens against 6 slots and 24-token steps: some steps held
    # decoding rows and prompt chunks in one forward, and a step never took more than one
    assert engine.decoder.steps > mixed
    assert engine.decoder.forwards - forwards < len(cases) * (steps + 8)


def test_a_repeated_prompt_comes_from_the_prefix_cache_with_the_same_answer(model):
    _name, net, ref = model
    case = max(ref["cases"], key=lambda c: len(c["prompt_ids"]))
    engine = net.engine
    first = list(engine.generate(greedy(case, 8)))
    again = list(engine.generate(greedy({**case, "name": "again"}, 8)))
    assert again[-1].cached_tokens >= engine.table.block_size
    assert [t for e in again for t in e.token_ids] == case["ids"][:8]
    assert [e.token_ids for e in again] == [e.token_ids for e in first]


def test_seeded_samples_do_not_depend_on_the_batch(model):
    """n=2 copies the prompt's blocks into the second sequence's run of blocks."""
    _name, net, ref = model
    case = ref["cases"][5]  # the long one: its copy spans several blocks
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)

    def seeded(name):
        return GenerationRequest(name, list(case["prompt_ids"]), params, n=2)

    alone = run_all(net.engine, [seeded("alone")])["alone"]
    crowd = [greedy(c, 16) for c in ref["cases"][:4]]
    together = run_all(net.engine, [seeded("together"), *crowd])["together"]

    def by_index(events):
        return {i: [t for e in events if e.index == i for t in e.token_ids] for i in (0, 1)}

    assert by_index(alone) == by_index(together)
    assert by_index(alone)[0] != by_index(alone)[1]


def _first_margin(case: dict) -> float:
    (_t1, first), (_t2, second) = case["top_logprobs"][0][:2]
    return first - second


def test_the_device_precision_serves_too(core):
    """Without hints openvino picks its precision and its cache's (f16 here on AVX2, bf16 or
    u8 where the CPU has them): the cache follows the compiled network, and the first token
    of each prompt whose first choice is clear (a margin over 0.1) is still transformers'."""
    available(core)
    folder = exported("tiny-llama", "openvino")
    ref = reference("tiny-llama")
    net = core.load_network(str(folder), "OPENVINO", SMALL)
    try:
        specs = {s.name: s for s in net.decoder_network.inputs}
        for name, array in net.engine.cache.arrays.items():
            assert array.dtype == specs[name].dtype
        results = run_all(net.engine, [greedy(c, 1) for c in ref["cases"]])
        clear = [c for c in ref["cases"] if _first_margin(c) > 0.1]
        assert clear
        for case in clear:
            assert results[case["name"]][0].token_ids == case["ids"][:1], case["name"]
    finally:
        net.close()


def test_a_kv_budget_of_two_slots_makes_the_others_wait_and_all_answer(core, model):
    """The budget counts the paged cache's bytes (whole blocks per slot): room for two
    sequences holds two, and five requests at once all answer, transformers' tokens each."""
    name, net, ref = model
    per_slot = net.engine.decoder.layout.bytes_per_slot
    config = {**F32, "KV_CACHE_BYTES": str(2 * per_slot + per_slot // 2)}
    small = core.load_network(str(exported(name, "openvino")), "OPENVINO", config)
    try:
        assert small.engine.cache.rows == 2
        assert small.engine.cache.nbytes == 2 * per_slot
        cases = ref["cases"][:5]
        results = run_all(small.engine, [greedy(c, 8) for c in cases])
        for case in cases:
            assert [t for e in results[case["name"]] for t in e.token_ids] == case["ids"][:8]
    finally:
        small.close()


def test_the_builders_shared_buffer_graph_still_reads_its_present_back_on_openvino(core):
    """OPENVINO's infer_into shares inputs but does not let an output alias an input
    (binds_outputs False): the model builder's GroupQueryAttention graph, whose past and
    present are one buffer on ORT, keeps reading its present back here (one sequence: see
    docs/generate.md's limits)."""
    available(core)
    folder = exported("tiny-llama", "genai-fp32")
    ref = reference("tiny-llama")
    net = core.load_network(str(folder), "OPENVINO", F32)
    try:
        assert not net.engine.decoder.binds
        case = ref["cases"][1]
        events = list(net.engine.generate(greedy(case, 16)))
        assert [t for e in events for t in e.token_ids] == case["ids"][:16]
    finally:
        net.close()


def test_an_ir_folder_is_refused_on_a_device_that_cannot_read_it(core):
    folder = exported("tiny-llama", "openvino")
    with pytest.raises(InvalidArgument, match="served on OPENVINO, not NUMPY"):
        core.load_network(str(folder), "NUMPY")


# --------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def served(core, tmp_path_factory):
    """A server whose repository holds tiny-llama's IR folder as model ``tiny-ov`` (OPENVINO,
    f32, 4 sequences at once)."""
    available(core)
    folder = exported("tiny-llama", "openvino")
    root = tmp_path_factory.mktemp("ov-llm")
    (root / "tiny-ov").mkdir()
    (root / "tiny-ov" / "1").symlink_to(folder, target_is_directory=True)
    settings = {"device": "OPENVINO", "config": {**F32, "MAX_NUM_SEQS": "4"}}
    (root / "tiny-ov" / "config.json").write_text(json.dumps(settings))
    args = ["--model-repository", str(root), "--grpc-port", "0", "--http-port", "0"]
    with RunningServer(*args, "--metrics-port", "0") as server:
        yield server, folder


def test_generate_over_rest_answers_transformers_text(served):
    server, folder = served
    ref = reference("tiny-llama")
    tokenizer = Tokenizer.from_folder(folder)
    steps = ref["max_new_tokens"]
    params = {"max_tokens": steps, "temperature": 0, "ignore_eos": True}
    cases = [c for c in ref["cases"] if "prompt" in c]
    answers: dict[str, dict] = {}

    def ask(case):
        body = {
            "text_input": case["prompt"],
            "sampling_parameters": json.dumps(params),
            "exclude_input_in_output": True,
            "return_num_output_tokens": True,
        }
        answers[case["name"]] = json.loads(post(server, "/v2/models/tiny-ov/generate", body))

    threads = [threading.Thread(target=ask, args=(c,)) for c in cases]  # 6 against 4 slots
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for case in cases:
        expected = continuation(tokenizer, case["prompt_ids"], case["ids"])
        assert answers[case["name"]]["text_output"] == expected, case["name"]
        assert answers[case["name"]]["num_output_tokens"] == steps


def test_streamed_pieces_over_model_stream_infer_add_up(served):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    server, folder = served
    ref = reference("tiny-llama")
    tokenizer = Tokenizer.from_folder(folder)
    cases = [c for c in ref["cases"] if "prompt" in c]
    params = {"max_tokens": ref["max_new_tokens"], "temperature": 0, "ignore_eos": True}
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.target)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for case in cases:
            inputs = [
                grpcclient.InferInput("text_input", [1], "BYTES"),
                grpcclient.InferInput("stream", [1], "BOOL"),
                grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
            ]
            inputs[0].set_data_from_numpy(np.array([case["prompt"].encode()], dtype=object))
            inputs[1].set_data_from_numpy(np.array([True]))
            inputs[2].set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
            client.async_stream_infer(
                "tiny-ov", inputs, request_id=case["name"], enable_empty_final_response=True
            )
        texts = {c["name"]: "" for c in cases}
        open_ = set(texts)
        while open_:
            result, error = responses.get(timeout=300)
            assert error is None, error
            out = result.as_numpy("text_output")
            response = result.get_response()
            texts[response.id] += out[0].decode() if out is not None and out.size else ""
            if response.parameters["triton_final_response"].bool_param:
                open_.discard(response.id)
    finally:
        client.stop_stream()
        client.close()
    for case in cases:
        assert texts[case["name"]] == continuation(tokenizer, case["prompt_ids"], case["ids"])


def test_the_server_names_the_paged_backend_in_its_log(served):
    server, _folder = served
    assert any("PagedDecoder" in line for line in server.lines), "\n".join(server.lines[-20:])


def test_the_openai_client_gets_transformers_completions_and_chats(served):
    openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
    server, _folder = served
    ref = reference("tiny-llama")
    api = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
    count = ref["max_new_tokens"]
    extra = {"extra_body": {"ignore_eos": True, "return_token_ids": True}}
    for case in ref["cases"]:
        if "prompt" in case:
            answer = api.completions.create(
                model="tiny-ov", prompt=case["prompt"], max_tokens=count, temperature=0, **extra
            )
            text = answer.choices[0].text
        else:
            answer = api.chat.completions.create(
                model="tiny-ov", messages=case["messages"], max_completion_tokens=count,
                temperature=0, **extra,
            )  # fmt: skip
            text = answer.choices[0].message.content
        choice = answer.choices[0]
        # vLLM's places: a completion's prompt ids in its choice, a chat's at the top
        holder = choice if "prompt" in case else answer
        assert holder.model_extra["prompt_token_ids"] == case["prompt_ids"], case["name"]
        assert choice.model_extra["token_ids"] == case["ids"], case["name"]
        assert text == case["completion_ignore_eos"], case["name"]
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
            len(case["prompt_ids"]),
            count,
        )
        assert choice.finish_reason == "length"


def test_an_openai_stream_sends_the_same_tokens_as_they_come(served):
    openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
    server, _folder = served
    ref = reference("tiny-llama")
    api = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
    case = next(c for c in ref["cases"] if c["name"] == "chat-turns")
    count = ref["max_new_tokens"]
    stream = api.chat.completions.create(
        model="tiny-ov", messages=case["messages"], max_tokens=count, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == count
    choices = [ch for c in chunks[:-1] for ch in c.choices]
    ids = [t for ch in choices for t in ch.model_extra.get("token_ids") or []]
    text = "".join(ch.delta.content or "" for ch in choices)
    assert ids == case["ids"]
    assert text == case["completion_ignore_eos"]
    assert len(chunks) > count // 2, "tokens arrive as they are made"
