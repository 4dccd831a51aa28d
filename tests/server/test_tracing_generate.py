"""Generation's traces as users see them: a real server serving a generative model (made in
code, tests/support/tiny_decoder.py) exports OTLP over HTTP to a real receiver on 127.0.0.1
(tests/support/otlp.py), driven by the official ``openai`` client (chat and completions,
streamed and not, embeddings) and tritonclient's ModelStreamInfer, each sending the W3C
``traceparent`` a traced client sends (docs/tracing.md, "Generation").

The model computes prompts in chunks of 16 tokens (``MAX_NUM_BATCHED_TOKENS``), so a prompt of
a few dozen tokens shows several ``prefill`` spans. Every prompt begins with a fresh id, so no
request's prompt comes from the prefix cache of another's.
"""

from __future__ import annotations

import itertools
import json
import queue
import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
from openai_serving import client as openai_client  # noqa: E402
from serving import RunningServer  # noqa: E402
from tiny_decoder import write as write_model  # noqa: E402
from traced import grpcclient, otlp  # noqa: E402

MODEL = "tiny"
ENCODER = "encoder"
CHUNK = 16


def _encoder() -> Path | None:
    """The tiny sentence-transformers encoder when this machine has it (tests/support/llm.py)."""
    try:
        import llm

        return llm.encoder_onnx("tiny-bert-mean")
    except Exception:  # llm.Unavailable, or its exporter's venv missing
        return None


@pytest.fixture(scope="module")
def encoder():
    return _encoder()


@pytest.fixture(scope="module")
def server(receiver, encoder):
    root = Path(tempfile.mkdtemp(prefix="plugserve-trace-generate-"))
    try:
        # a layer 1,024 wide before the logits: a step computes for a while, as a small real
        # model's does, so a client can leave in the middle of an answer
        write_model(root / MODEL / "1", context=4096, width=1024)
        config = {"device": "NUMPY", "config": {"MAX_NUM_BATCHED_TOKENS": str(CHUNK)}}
        (root / MODEL / "config.json").write_text(json.dumps(config))
        if encoder is not None:
            (root / ENCODER).mkdir()
            (root / ENCODER / "1").symlink_to(encoder, target_is_directory=True)
            (root / ENCODER / "config.json").write_text(json.dumps({"device": "NUMPY"}))
        args = [
            "--model-repository", str(root),
            *otlp.server_flags(receiver.url, rate=1),
        ]  # fmt: skip
        with RunningServer(*args) as running:
            yield running
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def api(server, receiver):
    yield openai_client(server)
    receiver.clear()


def _trace(receiver, trace_id: str) -> dict[str, list]:
    """The spans of one trace by name, once its request's span has arrived."""
    assert receiver.wait(lambda r: any(s.trace_id == trace_id for s in r.roots())), (
        f"no trace {trace_id} arrived"
    )
    found: dict[str, list] = {}
    for span in receiver.traces()[trace_id]:
        found.setdefault(span.name, []).append(span)
    for spans in found.values():
        spans.sort(key=lambda s: s.start_ns)
    return found


def _one(spans: dict[str, list], name: str):
    assert len(spans.get(name, [])) == 1, f"{name}: {spans.get(name)}"
    return spans[name][0]


def _prompt(words: int) -> str:
    """A prompt of about ``words`` x 6 byte tokens, beginning with an id of its own."""
    return " ".join([uuid.uuid4().hex[:8], *(["tide"] * words)])


def test_a_streamed_chat_is_traced_end_to_end(api, receiver):
    """The issue's case: InferRequest continues the client's trace, the model's span under it,
    and under that the engine's queue, each prompt chunk and the decoding, with one event per
    step's tokens; the counts and the finish reason where the module says."""
    header, trace_id, client_span = otlp.traceparent()
    stream = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": _prompt(6)}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": header},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.completion_tokens == 12
    spans = _trace(receiver, trace_id)

    root = _one(spans, "InferRequest")
    assert (root.parent_span_id, root.kind) == (client_span, 2)  # SERVER, the client's child
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["triton.request_id"] == chunks[0].id
    assert root.attributes["triton.model_name"] == MODEL
    assert root.attributes["plugserve.response_bytes"] > 0
    model = _one(spans, MODEL)
    assert model.parent_span_id == root.span_id
    assert model.attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert model.attributes["gen_ai.usage.completion_tokens"] == 12
    assert model.attributes["gen_ai.response.finish_reasons"] == ["length"]

    queue_span, decode = _one(spans, "queue"), _one(spans, "decode")
    prefills = spans["prefill"]
    for span in (queue_span, decode, *prefills):
        assert span.parent_span_id == model.span_id, span.name
        assert span.attributes["triton.model_name"] == MODEL  # the model's, at export
        assert not span.failed
    # the prompt in chunks of at most 16 tokens, each from where the one before ended
    cached = model.attributes["plugserve.cached_prompt_tokens"]
    offsets = [p.attributes["plugserve.prompt_offset"] for p in prefills]
    counts = [p.attributes["plugserve.tokens"] for p in prefills]
    assert len(prefills) >= 2 and max(counts) <= CHUNK
    assert offsets == [cached + sum(counts[:i]) for i in range(len(counts))]
    assert cached + sum(counts) == usage.prompt_tokens
    # waiting, then the prompt, then its tokens, all within the request's spans
    assert root.start_ns <= model.start_ns <= queue_span.start_ns
    assert queue_span.end_ns <= prefills[0].start_ns
    assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(prefills))
    assert prefills[-1].end_ns <= decode.start_ns <= decode.end_ns <= model.end_ns <= root.end_ns
    # one event per step: one token each (n is 1), all of them
    assert [name for name, _a in decode.events] == ["tokens"] * 12
    assert [a["plugserve.tokens"] for _n, a in decode.events] == [1] * 12
    assert all(a["plugserve.batch_rows"] >= 1 for _n, a in decode.events)
    assert decode.attributes["gen_ai.usage.completion_tokens"] == 12
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]


def test_a_completion_of_two_choices_has_one_event_per_step(api, receiver):
    """Not streamed, ``n`` 2, sampled by the rate (no traceparent): the prompt is computed
    once (its chunks once), each step's event carries both choices' tokens."""
    answer = api.completions.create(
        model=MODEL, prompt=_prompt(2), max_tokens=5, n=2, temperature=0.8, seed=7
    )
    assert answer.usage.completion_tokens == 10
    assert receiver.wait(
        lambda r: any(s.attributes.get("triton.request_id") == answer.id for s in r.roots())
    )
    root = next(s for s in receiver.roots() if s.attributes["triton.request_id"] == answer.id)
    assert root.parent_span_id == ""
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    spans = _trace(receiver, root.trace_id)
    decode = _one(spans, "decode")
    assert [a["plugserve.tokens"] for _n, a in decode.events] == [2] * 5
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length", "length"]
    assert _one(spans, MODEL).attributes["gen_ai.usage.completion_tokens"] == 10
    prompt_tokens = answer.usage.prompt_tokens
    assert sum(p.attributes["plugserve.tokens"] for p in spans["prefill"]) == prompt_tokens


def test_a_refused_request_records_its_error_on_its_span(api, receiver):
    header, trace_id, _span = otlp.traceparent()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        api.completions.create(
            model=MODEL, prompt="hello", max_tokens=10_000, extra_headers={"traceparent": header}
        )
    spans = _trace(receiver, trace_id)
    root = _one(spans, "InferRequest")
    assert root.failed and "maximum context length" in root.status_message
    name, attributes = root.events[0]  # OpenTelemetry's exception event
    assert name == "exception" and "maximum context length" in attributes["exception.message"]
    assert set(spans) == {"InferRequest"}  # refused before the engine saw it


def test_a_client_that_leaves_ends_its_trace_with_the_tokens_made(api, server, receiver):
    """The trace ends when the client leaves: the model's span says it was cancelled, the
    decoding span holds the tokens made until then; the engine frees the sequence and the
    server answers the next request."""
    header, trace_id, _span = otlp.traceparent()
    stream = api.completions.create(
        model=MODEL,
        prompt=_prompt(2),
        max_tokens=3000,
        stream=True,
        extra_headers={"traceparent": header},
    )
    for i, _chunk in enumerate(stream):
        if i == 4:
            break
    stream.close()
    spans = _trace(receiver, trace_id)
    root, model, decode = _one(spans, "InferRequest"), _one(spans, MODEL), _one(spans, "decode")
    assert model.failed and "Cancelled" in model.status_message
    made = sum(a["plugserve.tokens"] for _n, a in decode.events)
    assert 5 <= made < 3000
    assert decode.end_ns <= root.end_ns
    again = api.completions.create(model=MODEL, prompt=_prompt(1), max_tokens=3)
    assert again.usage.completion_tokens == 3


def test_a_grpc_stream_to_the_model_is_traced(server, receiver):
    """tritonclient's ModelStreamInfer (Triton's LLM inputs): the engine's spans are in the
    client's trace, under its InferRequest."""
    header, trace_id, client_span = otlp.traceparent()
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.target) as client:
        client.start_stream(
            callback=lambda result, error: answers.put((result, error)),
            headers={"traceparent": header},
        )
        inputs = [
            grpcclient.InferInput("text_input", [1], "BYTES"),
            grpcclient.InferInput("stream", [1], "BOOL"),
            grpcclient.InferInput("max_tokens", [1], "INT32"),
        ]
        inputs[0].set_data_from_numpy(np.array([_prompt(4).encode()], dtype=object))
        inputs[1].set_data_from_numpy(np.array([True]))
        inputs[2].set_data_from_numpy(np.array([6], dtype=np.int32))
        client.async_stream_infer(MODEL, inputs, request_id="g1", enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    spans = _trace(receiver, trace_id)
    root = _one(spans, "InferRequest")
    assert root.parent_span_id == client_span
    assert root.attributes["triton.request_id"] == "g1"
    by_id = {s.span_id: s for group in spans.values() for s in group}

    def under_root(span) -> bool:
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
        return span is root

    decode = _one(spans, "decode")
    # two queues: the data plane's (the request's wait for the network's stream, as any
    # decoupled request's) and the engine's (its wait for a sequence slot)
    assert len(spans["queue"]) == 2
    for span in (*spans["queue"], decode, *spans["prefill"]):
        assert under_root(span), span.name
    assert sum(a["plugserve.tokens"] for _n, a in decode.events) == 6
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]


def test_an_embeddings_request_is_traced(api, receiver, encoder):
    if encoder is None:
        pytest.skip("the tiny encoder needs its exporter: python tests/support/llm.py prepare")
    header, trace_id, client_span = otlp.traceparent()
    answer = api.embeddings.create(
        model=ENCODER, input=["the sea", "a tide"], extra_headers={"traceparent": header}
    )
    assert len(answer.data) == 2
    spans = _trace(receiver, trace_id)
    root = _one(spans, "InferRequest")
    assert root.parent_span_id == client_span
    assert root.attributes["gen_ai.operation.name"] == "embeddings"
    runs = spans[ENCODER]  # one per batch the inputs were run in
    assert runs and all(s.parent_span_id == root.span_id for s in runs)
    for name in ("queue", "compute"):
        assert {s.parent_span_id for s in spans[name]} <= {s.span_id for s in runs}
