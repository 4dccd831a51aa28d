"""Pipelined decode steps (server/apps/generate/engine/overlap.py, issue 51's item 3) on the torch
decoder's CPU form: an engine launching step N+1 with step N's ids on the device, before
step N's tokens are sent, answers as the synchronous engine (``async_scheduling`` off) token
for token: greedy and seeded sampled, ``n`` > 1, stop strings, ``max_tokens``, logprobs,
``logit_bias`` and ``min_tokens``, requests arriving mid-stream, a consumer leaving
mid-stream; a failing step fails its requests and the engine goes on; a row that needs host
state its last token changes (a grammar, penalties) makes the steps synchronous; and the
count of pipelined steps is > 0 where it should be (0 where it should not), in the engine's
stats and in the server's /metrics.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import FailingGrammar, run_all

torch = pytest.importorskip("torch", reason="the torch decoder needs torch (pip install torch)")
pytest.importorskip("safetensors")

from plugserve.plugins.api import InferenceError  # noqa: E402
from plugserve.plugins.torch.decoder import TorchDecoder  # noqa: E402
from plugserve.plugins.torch.decoder_model import DecoderModel  # noqa: E402
from plugserve.server.apps.generate.engine.engine import Engine, EngineSettings  # noqa: E402
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams  # noqa: E402

ROWS = 6
SETTINGS = {"MAX_NUM_SEQS": str(ROWS), "MAX_NUM_BATCHED_TOKENS": "64", "INFERENCE_NUM_THREADS": "1"}
#: generous: a loaded 2-core machine
WAIT_S = 120


def _engine(llama, pipelined: bool, graphs: int = 0, model=None) -> Engine:
    """An engine over the loaded network's weights, pipelined or not (``model``: a test-only
    subclass of the forward; ``graphs``: decode steps through DecodeGraphs' static buffers)."""
    decoder = llama.engine.decoder
    decoder = TorchDecoder(model or decoder.model, decoder.layout, graphs=graphs, threads=1)
    settings = EngineSettings(
        max_num_seqs=ROWS, max_num_batched_tokens=64, async_scheduling=pipelined
    )
    return Engine("overlap" if pipelined else "sync", decoder, llama.tokenizer, settings, ROWS)


@pytest.fixture(scope="module")
def engines(torch_llama):
    """(synchronous, pipelined) engines, closed after the module."""
    sync, piped = _engine(torch_llama, False), _engine(torch_llama, True)
    yield sync, piped
    sync.close()
    piped.close()


def _request(name: str, prompt: list[int], **params) -> GenerationRequest:
    params = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, **params}
    n = params.pop("n", 1)
    return GenerationRequest(name, list(prompt), SamplingParams(**params), n=n)


def _answers(events) -> dict[int, tuple]:
    """Per sequence index: (token ids, text, finish reason, logprobs: the chosen id, the
    top ids, and the values rounded to 2 places, since a batch of other rows changes f32
    sums in their last bits)."""
    out: dict[int, list] = {}
    for e in events:
        got = out.setdefault(e.index, [[], "", None, []])
        got[0].extend(e.token_ids)
        got[1] += e.text
        got[2] = e.finish_reason or got[2]
        for lp in e.logprobs or ():
            got[3].append((lp.token_id, [t for t, _v in lp.top], round(lp.logprob, 2)))
    return {i: (*v[:3], v[3]) for i, v in out.items()}


def _same(got: dict[str, dict], expected: dict[str, dict]) -> None:
    """The same answers: tokens, text, finish reasons and logprob ids exactly, the logprobs'
    values within 0.01 (rounding at 2 places may still split two values 1e-5 apart)."""
    assert got.keys() == expected.keys()
    for name, answers in expected.items():
        assert got[name].keys() == answers.keys(), name
        for index, (ids, text, reason, logprobs) in answers.items():
            other = got[name][index]
            assert other[:3] == (ids, text, reason), (name, index)
            assert [lp[:2] for lp in other[3]] == [lp[:2] for lp in logprobs], (name, index)
            for a, b in zip(other[3], logprobs):
                assert abs(a[2] - b[2]) <= 0.011, (name, index, a, b)


def _run(engine: Engine, early: list[GenerationRequest], late=()) -> dict[str, dict]:
    """``early`` at once; ``late`` once one of ``early`` has streamed 3 events (requests
    arriving mid-stream); each request's answers."""
    events: dict[str, list] = {r.request_id: [] for r in (*early, *late)}

    def one(request):
        for event in engine.generate(request):
            events[request.request_id].append(event)

    threads = [threading.Thread(target=one, args=(r,)) for r in early]
    for thread in threads:
        thread.start()
    if late:
        deadline = time.monotonic() + WAIT_S
        while max(len(events[r.request_id]) for r in early) < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        for request in late:
            thread = threading.Thread(target=one, args=(request,))
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join(timeout=WAIT_S)
        assert not thread.is_alive(), "a request did not end"
    return {name: _answers(got) for name, got in events.items()}


def _workload(prompts: list[list[int]], stop: str) -> tuple[list, list]:
    """Greedy and seeded sampled requests of many shapes; (early, late)."""
    a, b, c, d = prompts
    early = [
        _request("greedy", a, max_tokens=24, logprobs=3),
        _request("short", b, max_tokens=3),
        _request(
            "seeded",
            c,
            max_tokens=20,
            temperature=0.9,
            top_p=0.95,
            top_k=40,
            seed=7,
            logprobs=2,
        ),
        _request("n3", d, max_tokens=10, temperature=1.1, seed=3, n=3),
        _request("stop", a, max_tokens=24, stop=[stop]),
    ]
    late = [
        _request("late-greedy", b, max_tokens=12, logit_bias={7: 3.0, 11: -2.0}),
        _request("late-seeded", d, max_tokens=9, temperature=0.7, min_p=0.05, seed=11),
        _request("late-min", c, max_tokens=8, min_tokens=6, temperature=0.8, seed=5,
                 ignore_eos=False),
        _request("late-eos", a, max_tokens=30, ignore_eos=False, temperature=1.0, seed=9),
        # token 9 masked for its first 4 tokens, then chosen (and a stop): its 5th token
        _request("late-min-stop", b, max_tokens=12, min_tokens=4, stop_token_ids=[9],
                 logit_bias={9: 100.0}),
    ]  # fmt: skip
    return early, late


def _prompts(llama) -> list[list[int]]:
    tokenizer = llama.tokenizer
    texts = ("The capital of France is", "Once upon a time", "def main():", "1, 2, 3, 4,")
    return [tokenizer.encode(t, add_special_tokens=True) for t in texts]


def _stop_string(engine, prompt) -> str:
    """Three characters from the middle of the greedy answer: a stop string that is met."""
    text = _answers(engine.generate(_request("probe", prompt, max_tokens=24)))[0][1]
    middle = len(text) // 2
    stop = text[middle : middle + 3]
    assert stop.strip(), text
    return stop


def test_pipelined_answers_are_the_synchronous_engines(engines, torch_llama):
    sync, piped = engines
    prompts = _prompts(torch_llama)
    stop = _stop_string(sync, prompts[0])
    early, late = _workload(prompts, stop)
    before = piped.stats().pipelined_steps
    expected = _run(sync, early, late)
    got = _run(piped, *_workload(prompts, stop))
    assert piped.stats().pipelined_steps > before, "no step was pipelined"
    assert sync.stats().pipelined_steps == 0 and sync.stream is None
    _same(got, expected)
    # the workload's shapes did happen: a stop string, a length, three choices
    assert expected["stop"][0][2] == "stop" and stop not in expected["stop"][0][1]
    assert expected["short"][0][2] == "length" and len(expected["short"][0][0]) == 3
    assert sorted(expected["n3"]) == [0, 1, 2]
    assert len({tuple(v[0]) for v in expected["n3"].values()}) > 1
    assert len(expected["late-min"][0][0]) >= 6
    forced = expected["late-min-stop"][0]
    assert forced[0][4:] == [9] and 9 not in forced[0][:4] and forced[2] == "stop"
    # and both engines are idle again: every slot free
    for engine in engines:
        assert _idle(engine)


def test_the_static_step_pipelines_as_well(torch_llama):
    """DecodeGraphs' padded static buffers (a CUDA graph's on a card): the pipelined step
    copies the last step's ids into them on the device, and answers as before."""
    prompts = _prompts(torch_llama)
    requests = [
        _request(f"p{i}", p, max_tokens=6 + 3 * i, temperature=0.8 * (i % 2), seed=i)
        for i, p in enumerate(prompts)
    ]
    sync = _engine(torch_llama, False, graphs=8)
    piped = _engine(torch_llama, True, graphs=8)
    try:
        expected = run_all(sync, requests)
        got = run_all(piped, requests)
        assert piped.stats().pipelined_steps > 0
        assert piped.decoder.graphs.runs > 0
    finally:
        sync.close()
        piped.close()
    _same({k: _answers(v) for k, v in got.items()}, {k: _answers(v) for k, v in expected.items()})


def test_a_batch_of_sampled_rows_only_pipelines(engines, torch_llama):
    """Every row sampled (no greedy row: the sampler's draw over the whole batch, each cut
    on some rows only, logprobs on some): its steps pipeline (the sampler's draw waits for
    nothing, plugins/torch/sampler.py) and the seeded answers are the synchronous engine's."""
    sync, piped = engines
    a, b, c, d = _prompts(torch_llama)

    def requests():
        return [
            _request("t", a, max_tokens=18, temperature=0.8, seed=21),
            _request("k", b, max_tokens=14, temperature=1.0, top_k=5, seed=22, logprobs=2),
            _request("p", c, max_tokens=16, temperature=0.9, top_p=0.7, seed=23),
            _request("m", d, max_tokens=12, temperature=1.2, min_p=0.1, seed=24, logprobs=0),
            _request("b", a, max_tokens=15, temperature=0.7, logit_bias={7: 2.0}, seed=25),
        ]

    expected = _run(sync, requests())
    before = piped.stats().pipelined_steps
    got = _run(piped, requests())
    assert piped.stats().pipelined_steps > before, "no sampled step was pipelined"
    _same(got, expected)
    assert len({tuple(v[0][0]) for v in expected.values()}) == 5


def test_a_consumer_leaving_mid_stream_ends_its_request_only(engines, torch_llama):
    sync, piped = engines
    prompts = _prompts(torch_llama)
    others = [
        _request("a", prompts[1], max_tokens=20),
        _request("b", prompts[2], max_tokens=20, temperature=0.9, seed=4),
    ]
    expected = _run(sync, others)
    seen: list = []

    def leaving():
        stream = piped.generate(_request("leaves", prompts[0], max_tokens=200))
        for event in stream:
            seen.append(event)
            if len(seen) == 4:
                break
        stream.close()  # the consumer leaves: the engine aborts it at its next step

    thread = threading.Thread(target=leaving)
    thread.start()
    got = _run(piped, others)
    thread.join(timeout=WAIT_S)
    assert len(seen) == 4
    _same(got, expected)
    assert _idle(piped)
    # the engine goes on
    _same(_run(piped, others), expected)


class FailsAt(DecoderModel):
    """The tiny model, failing any forward that writes position :attr:`AT` (a device's
    failure mid-stream, as a CUDA error surfaces in torch: the real one cannot be made on a
    CPU)."""

    AT = 20

    def forward(self, cache, ids, positions, slots, plan):
        if bool((positions == self.AT).any()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return super().forward(cache, ids, positions, slots, plan)


def _outcome(engine, request):
    events = []
    try:
        for event in engine.generate(request):
            events.append(event)
    except Exception as exc:
        return events, exc
    return events, None


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(torch_llama):
    base = torch_llama.engine.decoder.model
    faulty = FailsAt(base.shape, base.w, base.device, base.dtype)
    prompt = _prompts(torch_llama)[0]
    assert len(prompt) < FailsAt.AT - 4  # the failure comes a few decode steps in
    outcomes = {}
    for pipelined in (False, True):
        engine = _engine(torch_llama, pipelined, model=faulty)
        try:
            events, error = _outcome(engine, _request("bad", prompt, max_tokens=40))
            # the engine goes on: requests whose positions stay short of it are answered
            after = _run(
                engine,
                [
                    _request("ok", prompt[:3], max_tokens=8, temperature=0.9, seed=2),
                    _request("ok2", prompt[:2], max_tokens=6),
                ],
            )
            steps = engine.stats().pipelined_steps
        finally:
            engine.close()
        assert isinstance(error, InferenceError), (events, error)
        assert "illegal memory access" in str(error)
        outcomes[pipelined] = ([t for e in events for t in e.token_ids], after)
        assert (steps > 0) == pipelined
    # the same tokens before the failure, the same answers after it
    assert outcomes[True] == outcomes[False]
    # the prompt's token, then one per decode step until the one writing position AT
    assert len(outcomes[True][0]) == FailsAt.AT + 1 - len(prompt)


def test_rows_needing_host_state_make_the_steps_synchronous(engines, torch_llama):
    """A grammar's mask and penalties read what the last token changed: a batch with such a
    row runs synchronously (no pipelined step while it runs), and answers as before."""
    sync, piped = engines
    prompts = _prompts(torch_llama)

    def held(name, prompt, **params):
        return [_request(name, prompt, max_tokens=12, **params)]

    for name, params in (
        ("grammar", {"constraint": FailingGrammar(1000)}),
        ("repetition", {"repetition_penalty": 1.3}),
        ("frequency", {"frequency_penalty": 0.5, "temperature": 0.9, "seed": 1}),
        ("presence", {"presence_penalty": 0.4}),
    ):
        before = piped.stats().pipelined_steps
        got = _run(piped, held(name, prompts[0], **params))
        assert piped.stats().pipelined_steps == before, name
        if name != "grammar":  # its state is one object: made again for the other engine
            _same(got, _run(sync, held(name, prompts[0], **params)))
    # beside plain requests: the same answers as the synchronous engine
    mixed = lambda: [  # noqa: E731
        _request("g", prompts[1], max_tokens=14, constraint=FailingGrammar(1000)),
        _request("plain", prompts[2], max_tokens=14, temperature=0.9, seed=8),
    ]
    _same(_run(piped, mixed()), _run(sync, mixed()))


def _idle(engine, wait_s: float = 30.0) -> bool:
    """Every slot free and nothing running (bounded wait: the loop's last turn)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if engine.scheduler.held == 0 and engine.table.held() == 0:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.slow
def test_the_servers_metrics_count_pipelined_steps(hf_llama):
    """Through a real server: streamed completions on a TORCH model pipeline their steps
    (/metrics' plugserve_generate_pipelined_steps_total > 0); with ASYNC_SCHEDULING NO they
    do not, and the answers are the same."""
    pytest.importorskip("openai", reason="pip install openai (the test extra)")
    from openai_serving import client, metric, serving

    config = {"INFERENCE_NUM_THREADS": "1"}
    entries = {
        "piped": (hf_llama, "TORCH", config),
        "sync": (hf_llama, "TORCH", {**config, "ASYNC_SCHEDULING": "NO"}),
    }
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 3,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # fmt: skip
    with serving(entries) as server:
        api = client(server)
        answers = {}
        for model in ("piped", "sync"):
            stream = api.completions.create(model=model, stream=True, **body)
            answers[model] = "".join(c.choices[0].text for c in stream if c.choices)
        piped = metric(server, "plugserve_generate_pipelined_steps_total", "piped")
        synced = metric(server, "plugserve_generate_pipelined_steps_total", "sync")
    assert answers["piped"] == answers["sync"] and answers["piped"]
    assert piped > 0 and synced == 0
