"""A traced generation's spans as the engine records them, in process (``Engine.generate`` on
a model folder made in code, tests/support/tiny_decoder.py): what the end-to-end tests through
a server and an OTLP receiver (tests/server/test_tracing_generate.py) cannot provoke, a
sequence that fails while its token is chosen, and the bound on a span's events."""

from __future__ import annotations

import time

import pytest
from conftest import FailingGrammar

from plugserve.plugins.api import InferenceError
from plugserve.plugins.tracing import MAX_EVENTS, Trace
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    from tiny_decoder import write

    from plugserve.server import Core

    # a layer 1,024 wide before the logits: a step takes a while, so a consumer can leave
    # in the middle of an answer
    folder = write(tmp_path_factory.mktemp("traced") / "m", context=512, width=1024)
    net = Core().load_network(str(folder), "NUMPY", {"MAX_NUM_BATCHED_TOKENS": "16"})
    yield net
    net.close()


def _traced(name: str, prompt: list[int], params: SamplingParams) -> tuple[list, Trace, object]:
    """A request under a model's span of a trace whose finished spans land in the list."""
    finished: list[Trace] = []
    root = Trace(finished.append)
    model = root.span("tiny")
    return finished, root, GenerationRequest(name, prompt, params, trace=model)


def _spans(trace: Trace, name: str) -> list:
    return [s for s in trace.spans if s.name == name]


def test_a_sequence_that_fails_records_its_error_and_the_batch_goes_on(network):
    engine = network.engine
    finished, root, broken = _traced(
        "broken", list(range(40, 60)), SamplingParams(max_tokens=8, constraint=FailingGrammar(2))
    )
    beside = GenerationRequest("beside", list(range(60, 70)), SamplingParams(max_tokens=8))
    broken_events = engine.generate(broken)
    beside_events = engine.generate(beside)
    with pytest.raises(InferenceError, match="while sampling"):
        list(broken_events)
    assert sum(len(e.token_ids) for e in beside_events) == 8
    root.end()
    (decode,) = _spans(finished[0], "decode")
    assert decode.end_ns and "matcher broke" in decode.error
    assert len(decode.events) == 2  # the two tokens chosen before it broke
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert not any(s.error for s in _spans(finished[0], "prefill"))


def test_a_long_answer_keeps_the_first_events_and_counts_the_rest(network):
    finished, root, request = _traced(
        "long", list(range(80, 90)), SamplingParams(max_tokens=MAX_EVENTS + 40, ignore_eos=True)
    )
    events = list(network.engine.generate(request))
    assert sum(len(e.token_ids) for e in events) == MAX_EVENTS + 40
    root.end()
    (decode,) = _spans(finished[0], "decode")
    assert len(decode.events) == MAX_EVENTS
    assert decode.attributes["plugserve.dropped_events"] == 40
    assert decode.attributes["gen_ai.usage.completion_tokens"] == MAX_EVENTS + 40
    model = request.trace
    assert model.attributes["gen_ai.usage.completion_tokens"] == MAX_EVENTS + 40
    assert model.attributes["gen_ai.response.finish_reasons"] == ["length"]


def test_a_request_whose_consumer_leaves_ends_abort_in_its_spans(network):
    """Its consumer gone, the engine ends the request at its next step ("abort"): the spans
    say so while the request's trace is still open (through a server, the stream's end ends
    the trace first: tests/server/test_tracing_generate.py)."""
    engine = network.engine
    aborted = engine.stats().snapshot().finished["abort"]
    finished, root, request = _traced(
        "gone", list(range(20, 30)), SamplingParams(max_tokens=480, ignore_eos=True)
    )
    events = engine.generate(request)
    assert next(events).token_ids  # the request is decoding now
    events.close()  # its consumer leaves
    deadline = time.monotonic() + 30
    while engine.stats().snapshot().finished["abort"] == aborted:
        assert time.monotonic() < deadline, "the engine did not end the request"
        time.sleep(0.01)
    root.end()
    (decode,) = _spans(finished[0], "decode")
    assert decode.end_ns and decode.error is None
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert 1 <= decode.attributes["gen_ai.usage.completion_tokens"] < 480
