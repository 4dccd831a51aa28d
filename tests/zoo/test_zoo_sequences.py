"""Real stateful models served with implicit state (Triton's sequence batching), on NUMPY, ORT
and OPENVINO, against onnxruntime fed the state by hand.

- Silero VAD from its PyPI wheel (on OPENVINO its if-less export, from the same wheel): 30
  chunks of audio per stream, its LSTM state carried by the server; 8 streams at once.
- A GRU and an LSTM exported by torch (hidden and cell state in and out, batch first): 8
  sequences at once through the ``oldest`` strategy, so rows of different sequences share runs.
- A GPT-2-like decoder (transformers, random weights) generating 16 tokens greedily with its
  key/value cache as a growing implicit state that starts empty (``initial_state`` dims with
  a 0-length past).

A real server on a Triton repository; tritonclient sends only the model's own inputs.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from sequence_models import write_model

from zoo import ZOO, load_all

ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
pytest.importorskip("torch", reason="pip install torch==2.13.0 (the zoo's exporters)")
pytest.importorskip("transformers", reason="pip install transformers")

from serving import RunningServer  # noqa: E402

load_all()

DEVICES = {
    "ORT": 'platform: "onnxruntime_onnx"',
    "NUMPY": "",  # the server's default device
    "OPENVINO": 'platform: "openvino"\n'
    'parameters [ { key: "EXECUTION_MODE_HINT" value: { string_value: "ACCURACY" } } ]',
}

RNN_STATES = {"gru": ["h"], "lstm": ["h", "c"]}


def _vad(device: str) -> str:
    """openvino cannot convert the If on the sample rate: the wheel's if-less export there."""
    return "silero_vad_ifless" if device == "OPENVINO" else "silero_vad"


def _state(name: str, output: str, dims: str, initial: str = "") -> str:
    return (
        f'{{ input_name: "{name}" output_name: "{output}" data_type: TYPE_FP32 dims: {dims}'
        f" {initial} }}"
    )


def _config(name: str, device: str, max_batch_size: int, batching: str) -> str:
    return f"""
name: "{name}"
{DEVICES[device]}
max_batch_size: {max_batch_size}
sequence_batching {{
{batching}
}}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("stateful")
    for device in DEVICES:
        vad = _state("state", "stateN", "[ 2, 1, 128 ]")
        write_model(
            root,
            f"vad_{device}",
            _load(_vad(device)),
            _config(f"vad_{device}", device, 0, f"state [ {vad} ]"),
        )
        for kind, states in RNN_STATES.items():
            pairs = ", ".join(_state(s, f"{s}_out", "[ 2, 16 ]") for s in states)
            oldest = "oldest { max_candidate_sequences: 16 max_queue_delay_microseconds: 5000 }"
            write_model(
                root,
                f"{kind}_{device}",
                _load(f"{kind}_state_script"),
                _config(f"{kind}_{device}", device, 8, f"{oldest}\nstate [ {pairs} ]"),
            )
        empty = (
            "initial_state: { data_type: TYPE_FP32 dims: [ 1, 2, 0, 16 ] zero_data: true "
            'name: "empty" }'
        )
        cache = ", ".join(
            _state(f"past.{i}.{kv}", f"present.{i}.{kv}", "[ 1, 2, -1, 16 ]", empty)
            for i in range(2)
            for kv in ("key", "value")
        )
        write_model(
            root,
            f"gpt2_{device}",
            _load("gpt2_past_script"),
            _config(f"gpt2_{device}", device, 0, f"state [ {cache} ]"),
        )
    with RunningServer("--model-repository", str(root)) as running:
        yield running


def _load(name: str):
    import onnx

    return onnx.load(str(ZOO[name].path()))


def _session(name: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(ZOO[name].path()), providers=["CPUExecutionProvider"])


def _infer(client, model, feeds, sequence_id, start, end, outputs):
    tensors = []
    for key, value in feeds.items():
        tensor = grpcclient.InferInput(
            key, list(value.shape), "FP32" if value.dtype == np.float32 else "INT64"
        )
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    result = client.infer(
        model,
        tensors,
        outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
        sequence_id=sequence_id,
        sequence_start=start,
        sequence_end=end,
    )
    return {o: result.as_numpy(o) for o in outputs}


def _concurrently(run, count):
    failures: list[BaseException] = []

    def guarded(k):
        try:
            run(k)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures[0]


def _audio(k: int, chunks: int) -> np.ndarray:
    """Noise with a tone in its middle third, one stream's 30 chunks of 512 samples."""
    rng = np.random.default_rng(k)
    samples = chunks * 512
    t = np.arange(samples) / 16000
    signal = rng.normal(size=samples) * 0.01
    middle = slice(samples // 3, 2 * samples // 3)
    signal[middle] += 0.5 * np.sin(2 * np.pi * (200 + 40 * k) * t[middle])
    return signal.astype(np.float32).reshape(chunks, 1, 512)


@pytest.mark.parametrize("device", list(DEVICES))
def test_vad_streams(server, device):
    reference = _session(_vad(device))
    chunks = 30

    def stream(k):
        audio = _audio(k, chunks)
        state = np.zeros((2, 1, 128), np.float32)
        sr = np.array(16000, np.int64)
        client = grpcclient.InferenceServerClient(server.target)
        try:
            for i in range(chunks):
                want, state = reference.run(None, {"input": audio[i], "state": state, "sr": sr})
                got = _infer(
                    client,
                    f"vad_{device}",
                    {"input": audio[i], "sr": sr},
                    700 + k,
                    i == 0,
                    i == chunks - 1,
                    ["output"],
                )["output"]
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"chunk {i}")
        finally:
            client.close()

    _concurrently(stream, 8)


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("kind", list(RNN_STATES))
def test_rnn_sequences_through_oldest(server, kind, device):
    reference = _session(f"{kind}_state_script")
    states = RNN_STATES[kind]
    chunks = 10

    def sequence(k):
        rng = np.random.default_rng(100 + k)
        held = {s: np.zeros((1, 2, 16), np.float32) for s in states}
        client = grpcclient.InferenceServerClient(server.target)
        try:
            for i in range(chunks):
                x = rng.normal(size=(1, 5, 8)).astype(np.float32)
                want = reference.run(None, {"x": x, **held})
                held = dict(zip(states, want[1:]))
                got = _infer(
                    client, f"{kind}_{device}", {"x": x}, 800 + k, i == 0, i == chunks - 1, ["y"]
                )["y"]
                np.testing.assert_allclose(got, want[0], rtol=1e-3, atol=1e-4, err_msg=f"chunk {i}")
        finally:
            client.close()

    _concurrently(sequence, 8)
    client = grpcclient.InferenceServerClient(server.target)
    try:
        stats = client.get_inference_statistics(f"{kind}_{device}").model_stats[0]
    finally:
        client.close()
    assert stats.inference_count == 8 * chunks
    assert stats.execution_count < stats.inference_count  # rows of several sequences batched


def _cache_names():
    return [f"past.{i}.{kv}" for i in range(2) for kv in ("key", "value")]


@pytest.mark.parametrize("device", list(DEVICES))
def test_decoder_generates_with_server_side_cache(server, device):
    """16 tokens, greedy: the client sends the prompt, then each new token and the attention
    mask; the cache grows on the server. onnxruntime with the cache passed by hand agrees."""
    reference = _session("gpt2_past_script")
    prompt = np.array([[5, 17, 42, 8]], np.int64)
    tokens = 16

    cache = {n: np.zeros((1, 2, 0, 16), np.float32) for n in _cache_names()}
    ids, total, want_tokens, want_logits = prompt, 0, [], []
    for _ in range(tokens):
        total += ids.shape[1]
        mask = np.ones((1, total), np.int64)
        out = reference.run(None, {"input_ids": ids, "attention_mask": mask, **cache})
        cache = dict(zip(_cache_names(), out[1:]))
        want_logits.append(out[0][:, -1])
        ids = out[0][:, -1:].argmax(-1).astype(np.int64)
        want_tokens.append(int(ids[0, 0]))

    client = grpcclient.InferenceServerClient(server.target)
    try:
        ids, total, got_tokens = prompt, 0, []
        for step in range(tokens):
            total += ids.shape[1]
            feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64)}
            logits = _infer(
                client, f"gpt2_{device}", feeds, 900, step == 0, step == tokens - 1, ["logits"]
            )["logits"]
            np.testing.assert_allclose(
                logits[:, -1], want_logits[step], rtol=1e-3, atol=1e-4, err_msg=f"token {step}"
            )
            ids = logits[:, -1:].argmax(-1).astype(np.int64)
            got_tokens.append(int(ids[0, 0]))
    finally:
        client.close()
    assert got_tokens == want_tokens


# --------------------------------------------------------------------------- OVMS


@pytest.fixture(scope="module")
def ovms_server(tmp_path_factory):
    """An OpenVINO Model Server config.json naming the GRU as a stateful model."""
    import json

    root = tmp_path_factory.mktemp("ovms")
    (root / "gru" / "1").mkdir(parents=True)
    (root / "gru" / "1" / "model.onnx").write_bytes(ZOO["gru_state_script"].path().read_bytes())
    model = {
        "name": "gru",
        "base_path": "gru",
        "stateful": True,
        "max_sequence_number": 2,
        "low_latency_transformation": True,
        "plugin_config": {"STATE_PAIRS": "h:h_out", "EXECUTION_MODE_HINT": "ACCURACY"},
    }
    (root / "config.json").write_text(json.dumps({"model_config_list": [{"config": model}]}))
    with RunningServer("--model-repository", str(root / "config.json")) as running:
        yield running


def _ovms_infer(client, x, sequence_id=None, control=None):
    tensors = [grpcclient.InferInput("x", list(x.shape), "FP32")]
    tensors[0].set_data_from_numpy(x)
    for name, value, datatype in (
        ("sequence_id", sequence_id, "UINT64"),
        ("sequence_control_input", control, "UINT32"),
    ):
        if value is not None:
            tensor = grpcclient.InferInput(name, [1], datatype)
            tensor.set_data_from_numpy(
                np.array([value], np.uint64 if name == "sequence_id" else np.uint32)
            )
            tensors.append(tensor)
    result = client.infer("gru", tensors)
    return result.as_numpy("y"), int(result.as_numpy("sequence_id")[0])


def test_ovms_stateful_model(ovms_server):
    """OVMS's special inputs: a START without an id gets one (in every answer's sequence_id
    output); the state is the server's; OVMS's refusals, with its status codes."""
    from tritonclient.utils import InferenceServerException

    reference = _session("gru_state_script")
    rng = np.random.default_rng(5)
    client = grpcclient.InferenceServerClient(ovms_server.target)
    try:
        h = np.zeros((1, 2, 16), np.float32)
        ident = None
        for i in range(6):
            x = rng.normal(size=(1, 5, 8)).astype(np.float32)
            want, h = reference.run(None, {"x": x, "h": h})
            control = 1 if i == 0 else 2 if i == 5 else None
            got, ident = _ovms_infer(client, x, ident, control)
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"chunk {i}")
        x = np.zeros((1, 5, 8), np.float32)
        with pytest.raises(InferenceServerException, match="does not exist") as e:
            _ovms_infer(client, x, ident)  # ended
        assert "NOT_FOUND" in str(e.value.status())
        _ovms_infer(client, x, 77, 1)
        with pytest.raises(InferenceServerException, match="already exists") as e:
            _ovms_infer(client, x, 77, 1)
        assert "ALREADY_EXISTS" in str(e.value.status())
        _ovms_infer(client, x, 78, 1)
        with pytest.raises(InferenceServerException, match="max sequence number") as e:
            _ovms_infer(client, x, 79, 1)
        assert "UNAVAILABLE" in str(e.value.status())
        with pytest.raises(InferenceServerException, match="sequence_control_input 3"):
            _ovms_infer(client, x, 77, 3)
        with pytest.raises(InferenceServerException, match="sequence id has not been provided"):
            _ovms_infer(client, x)
    finally:
        client.close()
