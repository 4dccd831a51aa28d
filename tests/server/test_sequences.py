"""Triton's sequence batcher, driven the way Triton's sequence example clients drive it.

Triton's ``simple_sequence`` and ``simple_dyna_sequence`` models (built node for node in
``tests/support/sequence_models.py``) in a Triton repository, served by a real server; sync,
async, streaming and asyncio tritonclient clients over gRPC and HTTP, with sequences
interleaved and uint64 and string ids, get the answers Triton's examples check for. Then the
refusals, the implicit state (an accumulator, direct and oldest, NUMPY and ORT), and the
limits: idle sequences, --max-sequences, unload.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import urllib.request
import uuid

import grpc
import numpy as np
import pytest
from models import FOREVER, add_constant
from sequence_models import (
    accumulator,
    accumulator_config,
    big_state,
    big_state_config,
    oldest_config,
    picker,
    spinner,
    triton_examples,
    write_model,
)
from serving import RunningServer, wait_for

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[grpc]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

PLAIN = """
name: "plain"
platform: "onnxruntime_onnx"
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
"""

#: sequences whose requests the picker model's ``oldest`` batcher waits to run together
PICKED = 4

#: the values Triton's sequence examples send, after a first 0 (or 100, 20)
VALUES = [11, 7, 5, 3, 2, 0, 1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = triton_examples(tmp_path_factory.mktemp("sequences"))
    write_model(root, "acc_direct", accumulator(), accumulator_config("acc_direct"))
    oldest = "oldest { max_candidate_sequences: 64 max_queue_delay_microseconds: 20000 }"
    write_model(root, "acc_oldest", accumulator(), accumulator_config("acc_oldest", oldest))
    numpy_config = accumulator_config("acc_numpy", oldest).replace(
        'platform: "onnxruntime_onnx"', ""
    )
    write_model(root, "acc_numpy", accumulator(), numpy_config)
    idle = "max_sequence_idle_microseconds: 300000"
    write_model(root, "acc_idle", accumulator(), accumulator_config("acc_idle", extra=idle))
    write_model(root, "plain", add_constant(1.0, [1, 4]), PLAIN)
    capped = "oldest { max_candidate_sequences: 2 }"
    write_model(root, "acc_capped", accumulator(), accumulator_config("acc_capped", capped))
    write_model(root, "picker", picker(), oldest_config("picker", PICKED, "INDEX", "[ 1 ]"))
    write_model(root, "spinner", spinner(), oldest_config("spinner", 2, "M", "[ 4 ]"))
    with RunningServer("--model-repository", str(root), "--max-sequences", "40") as running:
        yield running


def _input(module, value):
    data = np.full((1, 1), value, np.int32)
    tensor = module.InferInput("INPUT", list(data.shape), "INT32")
    tensor.set_data_from_numpy(data)
    return [tensor]


def _expected(first: int, values: list[int], sign: int, start_adds: int, corrid: int = 0):
    """What Triton's examples check: the first answer is ``first`` + START, then each value;
    the dyna model adds the correlation id on the last (END) request."""
    out = [first + start_adds] + [sign * v for v in values]
    if corrid:
        out[-1] += corrid
    return out


def _send_sync(client, module, model, sequence_id, first, values, sign=1):
    answers = []
    sent = [first] + [sign * v for v in values]
    for i, value in enumerate(sent):
        result = client.infer(
            model,
            _input(module, value),
            outputs=[module.InferRequestedOutput("OUTPUT")],
            sequence_id=sequence_id,
            sequence_start=i == 0,
            sequence_end=i == len(sent) - 1,
        )
        answers.append(int(result.as_numpy("OUTPUT")[0][0]))
    return answers


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("dyna", [False, True])
def test_sync_client_as_triton_example(server, protocol, dyna):
    """simple_{grpc,http}_sequence_sync_infer_client.py: two uint64 sequences and a string one
    (with the plain model: the dyna model's CORRID is a uint64), one after another."""
    module = grpcclient if protocol == "grpc" else httpclient
    target = server.target if protocol == "grpc" else server.http_target
    model = "simple_dyna_sequence" if dyna else "simple_sequence"
    client = module.InferenceServerClient(target)
    try:
        first = _send_sync(client, module, model, 1000, 0, VALUES)
        second = _send_sync(client, module, model, 1001, 100, VALUES, -1)
        string_id = str(uuid.uuid4())
        third = _send_sync(client, module, "simple_sequence", string_id, 20, VALUES, -1)
    finally:
        client.close()
    assert first == _expected(0, VALUES, 1, 1, 1000 if dyna else 0)
    assert second == _expected(100, VALUES, -1, 1, 1001 if dyna else 0)
    assert third == _expected(20, VALUES, -1, 1)


@pytest.mark.parametrize("dyna", [False, True])
def test_stream_client_interleaved(server, dyna):
    """simple_grpc_sequence_stream_infer_client.py, with the sequences' requests interleaved
    on the one stream: each sequence's answers come in its own order."""
    model = "simple_dyna_sequence" if dyna else "simple_sequence"
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.target)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    ids = [2000, 2001, 2002]
    firsts = {2000: 0, 2001: 100, 2002: 50}
    try:
        for i in range(len(VALUES) + 1):
            for sequence_id in ids:
                value = (
                    firsts[sequence_id]
                    if i == 0
                    else VALUES[i - 1] * (-1 if sequence_id % 2 else 1)
                )
                client.async_stream_infer(
                    model,
                    _input(grpcclient, value),
                    request_id=f"{sequence_id}_{i}",
                    sequence_id=sequence_id,
                    sequence_start=i == 0,
                    sequence_end=i == len(VALUES),
                )
        got: dict[int, dict[int, int]] = {s: {} for s in ids}
        for _ in range(len(ids) * (len(VALUES) + 1)):
            result, error = answers.get(timeout=30)
            assert error is None, error
            sequence_id, i = map(int, result.get_response().id.split("_"))
            got[sequence_id][i] = int(result.as_numpy("OUTPUT")[0][0])
    finally:
        client.stop_stream()
        client.close()
    for sequence_id in ids:
        sign = -1 if sequence_id % 2 else 1
        want = _expected(firsts[sequence_id], VALUES, sign, 1, sequence_id if dyna else 0)
        assert [got[sequence_id][i] for i in range(len(VALUES) + 1)] == want


def test_async_client_sequences_side_by_side(server):
    """async_infer: three sequences in flight at once, each request sent from its sequence's
    previous answer (unary calls of one client may arrive in any order, as on Triton, so a
    sequence's next waits for its last)."""
    client = grpcclient.InferenceServerClient(server.target)
    steps = 12
    results: dict[int, list] = {31: [], 32: [], 33: []}
    finished = threading.Semaphore(0)

    def send(sequence_id, i):
        x = np.full((1, 4), sequence_id + i, np.float32)
        tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
        tensor.set_data_from_numpy(x)

        def callback(result, error):
            results[sequence_id].append(error if error is not None else result.as_numpy("OUTPUT"))
            if error is None and i + 1 < steps:
                send(sequence_id, i + 1)
            else:
                finished.release()

        client.async_infer(
            "acc_oldest",
            [tensor],
            callback,
            sequence_id=sequence_id,
            sequence_start=i == 0,
            sequence_end=i == steps - 1,
        )

    try:
        for sequence_id in results:
            send(sequence_id, 0)
        for _ in results:
            assert finished.acquire(timeout=30)
    finally:
        client.close()
    for sequence_id, got in results.items():
        assert not any(isinstance(g, Exception) for g in got), got
        sums = np.cumsum([sequence_id + i for i in range(steps)])
        np.testing.assert_array_equal([g[0, 0] for g in got], sums)


def test_stream_runs_a_sequence_in_order(server):
    """A stream's requests of one sequence, sent without waiting, run one at a time in the
    order sent, while those of other sequences on it are batched with them (the running sums
    show any reordering or overlap)."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.target)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    steps, ids = 15, (41, 42, 43, 44)
    try:
        for i in range(steps):
            for sequence_id in ids:
                tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
                tensor.set_data_from_numpy(np.full((1, 4), sequence_id * i, np.float32))
                client.async_stream_infer(
                    "acc_oldest",
                    [tensor],
                    request_id=f"{sequence_id}_{i}",
                    sequence_id=sequence_id,
                    sequence_start=i == 0,
                    sequence_end=i == steps - 1,
                )
        got = {}
        for _ in range(steps * len(ids)):
            result, error = answers.get(timeout=30)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("OUTPUT")[0, 0]
    finally:
        client.stop_stream()
        client.close()
    for sequence_id in ids:
        sums = np.cumsum([sequence_id * i for i in range(steps)])
        np.testing.assert_array_equal([got[f"{sequence_id}_{i}"] for i in range(steps)], sums)


def test_asyncio_stream_client(server):
    """simple_grpc_aio_sequence_stream_infer_client.py: tritonclient.grpc.aio's stream."""
    aio = pytest.importorskip("tritonclient.grpc.aio")

    async def run():
        client = aio.InferenceServerClient(server.target)

        async def requests():
            for sequence_id, first, sign in ((3000, 0, 1), (3001, 100, -1)):
                sent = [first] + [sign * v for v in VALUES]
                for i, value in enumerate(sent):
                    yield {
                        "model_name": "simple_sequence",
                        "inputs": _input(grpcclient, value),
                        "request_id": f"{sequence_id}_{i}",
                        "sequence_id": sequence_id,
                        "sequence_start": i == 0,
                        "sequence_end": i == len(sent) - 1,
                    }

        got: dict[str, int] = {}
        try:
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                got[result.get_response().id] = int(result.as_numpy("OUTPUT")[0][0])
                if len(got) == 2 * (len(VALUES) + 1):
                    break
        finally:
            await client.close()
        return got

    got = asyncio.run(asyncio.wait_for(run(), 60))
    assert [got[f"3000_{i}"] for i in range(8)] == _expected(0, VALUES, 1, 1)
    assert [got[f"3001_{i}"] for i in range(8)] == _expected(100, VALUES, -1, 1)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_refused_as_triton_refuses(server, protocol):
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(
        server.target if protocol == "grpc" else server.http_target
    )
    try:
        with pytest.raises(InferenceServerException, match="must specify the START flag") as e:
            client.infer("simple_sequence", _input(module, 1), sequence_id=4242)
        assert "sequence 4242" in str(e.value)
        with pytest.raises(InferenceServerException, match="non-zero or non-empty correlation"):
            client.infer("simple_sequence", _input(module, 1))
        _send_sync(client, module, "simple_sequence", 4243, 0, [1])  # started and ended
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            client.infer("simple_sequence", _input(module, 1), sequence_id=4243)
        with pytest.raises(InferenceServerException, match=r"data-type is 'BYTES'.*'UINT64'"):
            client.infer(
                "simple_dyna_sequence", _input(module, 1), sequence_id="abc", sequence_start=True
            )
        two = np.ones((2, 1), np.int32)
        tensor = module.InferInput("INPUT", [2, 1], "INT32")
        tensor.set_data_from_numpy(two)
        with pytest.raises(InferenceServerException, match="must specify batch-size 1"):
            client.infer("simple_sequence", [tensor], sequence_id=7, sequence_start=True)
        x = module.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException, match="has no sequence batching"):
            client.infer("plain", [x], sequence_id=9, sequence_start=True)
    finally:
        client.close()


def test_metadata_names_the_clients_inputs_only(server):
    client = grpcclient.InferenceServerClient(server.target)
    try:
        metadata = client.get_model_metadata("simple_dyna_sequence")
        extensions = client.get_server_metadata().extensions
    finally:
        client.close()
    assert {"sequence", "sequence(string_id)"} <= set(extensions)  # Triton's sequence extension
    assert [i.name for i in metadata.inputs] == ["INPUT"]
    assert [o.name for o in metadata.outputs] == ["OUTPUT"]


# --------------------------------------------------------------------------- implicit state


def _acc_step(client, model, sequence_id, x, start=False, end=False):
    tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.asarray(x, np.float32).reshape(1, 4))
    result = client.infer(
        model, [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end
    )
    return result.as_numpy("OUTPUT")


@pytest.mark.parametrize("model", ["acc_direct", "acc_oldest"])
def test_a_start_that_fails_does_not_start_its_sequence(server, model):
    """A red team's START of a wrong shape, refused, still opened its sequence: it held a
    --max-sequences slot until the idle timeout, and the next request of its id, without
    START, ran as if the sequence had started. A START that fails before its sequence ever
    ran leaves no sequence (Triton refuses such a request: no START flag)."""
    client = grpcclient.InferenceServerClient(server.target)
    try:
        wrong = grpcclient.InferInput("INPUT", [1, 5], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 5), np.float32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer(model, [wrong], sequence_id=9100, sequence_start=True)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            _acc_step(client, model, 9100, np.ones(4))
        assert _acc_step(client, model, 9100, np.ones(4), start=True, end=True).tolist() == [
            [1.0] * 4
        ]
    finally:
        client.close()


@pytest.mark.parametrize("model", ["acc_direct", "acc_oldest", "acc_numpy"])
def test_implicit_state_concurrent_sequences(server, model):
    """8 sequences at once, each from its own thread: every answer is its own running sum,
    whatever else ran in the same batch."""
    steps = 10
    rng = np.random.default_rng(0)
    data = rng.normal(size=(8, steps, 4)).astype(np.float32)
    failures: list[BaseException] = []

    def one(k):
        client = grpcclient.InferenceServerClient(server.target)
        try:
            total = np.zeros(4, np.float32)
            for i in range(steps):
                total = total + data[k, i]
                got = _acc_step(client, model, 500 + k, data[k, i], i == 0, i == steps - 1)
                np.testing.assert_allclose(got[0], total, rtol=1e-6, atol=1e-6)
        except BaseException as exc:
            failures.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[0]
    client = grpcclient.InferenceServerClient(server.target)
    try:
        stats = client.get_inference_statistics(model).model_stats[0]
    finally:
        client.close()
    assert stats.inference_count >= 8 * steps
    if model == "acc_direct":  # a sequence's requests run alone
        assert stats.execution_count == stats.inference_count
    else:  # oldest: requests of several sequences share runs
        assert stats.execution_count < stats.inference_count


def _pick_together(server, first_id: int, index: int) -> list:
    """One request of each of PICKED new sequences at once; each one's answer or error."""
    answers: list = [None] * PICKED

    def one(k: int) -> None:
        client = grpcclient.InferenceServerClient(server.target)
        tensor = grpcclient.InferInput("INDEX", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.array([[index]], np.int64))
        try:
            answers[k] = client.infer(
                "picker", [tensor], sequence_id=first_id + k, sequence_start=True
            ).as_numpy("OUTPUT")
        except InferenceServerException as exc:
            answers[k] = exc
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(PICKED)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return answers


def _picker_stats(server):
    client = grpcclient.InferenceServerClient(server.target)
    try:
        stats = client.get_inference_statistics("picker").model_stats[0]
    finally:
        client.close()
    return stats.inference_count, stats.execution_count, stats.inference_stats.fail.count


def test_a_failed_batched_run_fails_each_of_its_requests_in_the_statistics(server):
    """PICKED sequences' requests run as one batch (``oldest`` waits for them): together they
    count as PICKED requests in one execution; when the batch's run fails (an index out of
    bounds), each is run alone, gets its own error and counts as a failure; the failed batch
    counted once more (as its first row, before it was known to fail)."""
    before = _picker_stats(server)
    answers = _pick_together(server, 700, 0)
    assert all(np.array_equal(a, [[0.0]]) for a in answers), answers
    inferences, executions, failures = _picker_stats(server)
    assert inferences - before[0] == PICKED
    assert executions - before[1] < PICKED  # they shared a run
    answers = _pick_together(server, 800, 9)
    assert all(isinstance(a, InferenceServerException) for a in answers), answers
    assert all("Out of range value in index" in a.message() for a in answers), answers
    assert _picker_stats(server)[2] - failures == PICKED + 1


def test_one_sequences_bad_input_fails_only_its_own_request(server):
    """With ``oldest``, requests of several sequences (several tenants', with tokens) share a
    run: one whose index is out of bounds failed every request of the run, each error holding
    that index. Now the failed run's requests run again one by one: the others are answered,
    their states moved on once; the bad one's error is its own, its state unchanged."""
    answers: list = [None] * PICKED

    def one(k: int, index: int, start: bool) -> None:
        client = grpcclient.InferenceServerClient(server.target)
        tensor = grpcclient.InferInput("INDEX", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.array([[index]], np.int64))
        try:
            answers[k] = client.infer(
                "picker",
                [tensor],
                sequence_id=1200 + k,
                sequence_start=start,
                sequence_end=not start,  # (the model's 16 slots are the module's)
            ).as_numpy("OUTPUT")
        except InferenceServerException as exc:
            answers[k] = exc
        finally:
            client.close()

    for step, bad in enumerate([99, 9]):  # the last sequence's index is out of bounds
        threads = [
            threading.Thread(target=one, args=(k, bad if k == PICKED - 1 else k % 4, step == 0))
            for k in range(PICKED)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for k, answer in enumerate(answers[:-1]):
            assert np.array_equal(answer, [[float(step)]]), (k, answer)  # state moved once
        failure = answers[-1]
        assert isinstance(failure, InferenceServerException), failure
        # its START failed: its sequence did not start, and its next request is refused
        words = "Out of range value in index" if step == 0 else "must specify the START flag"
        assert words in failure.message(), failure.message()


def test_one_rows_passed_deadline_does_not_fail_the_batch(server):
    """A request with a server-side timeout (Triton's ``timeout`` parameter) waits in the
    ``oldest`` batcher past it; the batch it lands in runs for the others, and only it gets
    DEADLINE_EXCEEDED."""
    late: list = []

    def waits() -> None:
        client = grpcclient.InferenceServerClient(server.target)
        tensor = grpcclient.InferInput("INDEX", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.array([[0]], np.int64))
        try:
            client.infer("picker", [tensor], sequence_id=950, sequence_start=True, timeout=200_000)
        except InferenceServerException as exc:
            late.append(exc)
        finally:
            client.close()

    def active() -> float:
        return _metric(server, "plugserve_sequences_active", "picker") or 0

    before = active()
    thread = threading.Thread(target=waits)
    thread.start()
    # queued, waiting for the batch of PICKED; then past its 0.2 s
    assert wait_for(lambda: active() > before)
    time.sleep(0.5)
    answers = _pick_together(server, 960, 0)
    thread.join(60)
    assert all(np.array_equal(a, [[0.0]]) for a in answers), [str(a) for a in answers]
    assert len(late) == 1 and late[0].status() == "StatusCode.DEADLINE_EXCEEDED", late
    assert "waited for its turn" in late[0].message()


def _spin_request(sequence_id: int, trips: int) -> bytes:
    from tritonclient.grpc import _utils

    m = grpcclient.InferInput("M", [1, 1], "INT64")
    m.set_data_from_numpy(np.array([[trips]], np.int64))
    return _utils._get_inference_request(
        model_name="spinner",
        inputs=[m],
        model_version="",
        request_id="",
        outputs=None,
        sequence_id=sequence_id,
        sequence_start=True,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=None,
    ).SerializeToString()


def test_a_batch_stops_once_every_client_of_it_has_gone(server):
    """Two sequences' endless requests run as one ``oldest`` batch. One client cancelling
    leaves the run to the other; once both have cancelled, the run stops (its stream is free
    again) and the model answers the next client; a run that nobody stops would hold the
    stream until --max-request-seconds (300 s), far past the next client's 30 s."""
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        runs = [call.future(_spin_request(1000 + k, FOREVER)) for k in range(2)]
        # both rows in one run: the ORT streams busy with it (nothing else runs here now)
        assert wait_for(
            lambda: (_gauge(server, "plugserve_busy_streams", 'device="ORT"') or 0) >= 1
        )
        runs[0].cancel()
        time.sleep(0.3)
        assert not runs[1].done()  # the other client still wants the run
        runs[1].cancel()
        client = grpcclient.InferenceServerClient(server.target)
        try:
            tensor = grpcclient.InferInput("M", [1, 1], "INT64")
            tensor.set_data_from_numpy(np.array([[3]], np.int64))
            result = client.infer(
                "spinner", [tensor], sequence_id=1010, sequence_start=True, client_timeout=30
            )
        finally:
            client.close()
    np.testing.assert_allclose(result.as_numpy("OUTPUT"), np.zeros((1, 4)))


def test_state_outputs_are_the_servers(server):
    client = grpcclient.InferenceServerClient(server.target)
    try:
        tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException, match="state outputs"):
            client.infer(
                "acc_direct",
                [tensor],
                outputs=[grpcclient.InferRequestedOutput("STATE_OUT")],
                sequence_id=77,
                sequence_start=True,
            )
        state = grpcclient.InferInput("STATE_IN", [1, 4], "FP32")
        state.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException, match="sequence batcher's"):
            client.infer("acc_direct", [tensor, state], sequence_id=78, sequence_start=True)
    finally:
        client.close()


# --------------------------------------------------------------------------- limits


def _gauge(server, name: str, label: str) -> float | None:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _metric(server, name, model):
    return _gauge(server, name, f'model="{model}"')


def test_idle_sequence_is_ended_and_freed(server):
    client = grpcclient.InferenceServerClient(server.target)
    try:
        _acc_step(client, "acc_idle", 900, np.ones(4), start=True)
        assert _metric(server, "plugserve_sequences_active", "acc_idle") == 1
        assert _metric(server, "plugserve_sequence_state_bytes", "acc_idle") == 16
        deadline = time.monotonic() + 10
        while _metric(server, "plugserve_sequences_active", "acc_idle") and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert _metric(server, "plugserve_sequences_active", "acc_idle") == 0
        assert _metric(server, "plugserve_sequence_state_bytes", "acc_idle") == 0
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            _acc_step(client, "acc_idle", 900, np.ones(4))
    finally:
        client.close()
    assert "sequence 900 idle" in server.log


def test_sequence_limits(server):
    """The model's max_candidate_sequences, then the server's --max-sequences (40): a new
    sequence beyond is RESOURCE_EXHAUSTED; ending one makes room."""
    client = grpcclient.InferenceServerClient(server.target)
    try:
        _acc_step(client, "acc_capped", 1, np.ones(4), start=True)
        _acc_step(client, "acc_capped", 2, np.ones(4), start=True)
        with pytest.raises(InferenceServerException, match="2 sequence slots") as e:
            _acc_step(client, "acc_capped", 3, np.ones(4), start=True)
        assert "RESOURCE_EXHAUSTED" in str(e.value.status())
        _acc_step(client, "acc_capped", 1, np.ones(4), end=True)
        _acc_step(client, "acc_capped", 3, np.ones(4), start=True, end=True)
        _acc_step(client, "acc_capped", 2, np.ones(4), end=True)
        opened = []
        with pytest.raises(InferenceServerException, match="--max-sequences 40"):
            for k in range(41):
                _acc_step(client, "acc_direct", 10_000 + k, np.ones(4), start=True)
                opened.append(10_000 + k)
        assert 0 < len(opened) <= 40
        for k in opened:
            _acc_step(client, "acc_direct", k, np.ones(4), end=True)
        _acc_step(client, "acc_direct", 20_000, np.ones(4), start=True, end=True)
    finally:
        client.close()


# --------------------------------------------------------------------------- faults


@pytest.fixture
def own_server(tmp_path):
    """A server of the test's own (its sequences end with it)."""
    root = tmp_path / "repo"
    write_model(root, "acc", accumulator(), accumulator_config("acc"))
    write_model(root, "big", big_state(BIG), big_state_config("big", BIG))
    with RunningServer(
        "--model-repository",
        str(root),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        "--max-inflight-bytes",
        str(BUDGET),
    ) as running:
        yield running


#: a big model's state: 64 Ki float32 a sequence (256 KiB); the budget holds three
BIG = 65536
BUDGET = 900_000


def _big_step(client, sequence_id, start=False, end=False):
    tensor = grpcclient.InferInput("INPUT", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
    result = client.infer(
        "big", [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end
    )
    return float(result.as_numpy("OUTPUT")[0, 0])


def test_state_memory_is_charged_before_it_is_held(own_server):
    client = grpcclient.InferenceServerClient(own_server.target)
    try:
        for k in range(3):
            assert _big_step(client, 1 + k, start=True) == BIG
        with pytest.raises(InferenceServerException, match="initial state") as e:
            _big_step(client, 4, start=True)
        assert "--max-inflight-bytes" in str(e.value)
        assert _metric(own_server, "plugserve_sequence_state_bytes", "big") == 3 * BIG * 4
        assert _big_step(client, 1) == 2 * BIG  # the others keep going
        _big_step(client, 1, end=True)
        assert _big_step(client, 4, start=True) == BIG  # its end made room
    finally:
        client.close()


def test_reload_and_unload_end_sequences(own_server):
    """A reload does not carry sequences (as Triton's): the next request of one is refused,
    naming START; after an unload the model is unknown."""
    client = grpcclient.InferenceServerClient(own_server.target)
    try:
        _acc_step(client, "acc", 61, np.ones(4), start=True)
        client.load_model("acc")
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            _acc_step(client, "acc", 61, np.ones(4))
        np.testing.assert_array_equal(
            _acc_step(client, "acc", 61, np.ones(4), start=True)[0], np.ones(4)
        )
        client.unload_model("acc")
        with pytest.raises(InferenceServerException, match="unknown model"):
            _acc_step(client, "acc", 61, np.ones(4))
    finally:
        client.close()
    assert "1 active sequence(s) ended with it" in own_server.log


def test_sigterm_ends_active_sequences(own_server):
    client = grpcclient.InferenceServerClient(own_server.target)
    try:
        _acc_step(client, "acc", 71, np.ones(4), start=True)
        _acc_step(client, "acc", 72, np.ones(4), start=True)
    finally:
        client.close()
    own_server.signal()
    assert own_server.process.wait(30) == 0
    deadline = time.monotonic() + 10
    while "2 active sequence(s) ended" not in own_server.log and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "network acc version 1: 2 active sequence(s) ended with it" in own_server.log


def test_plugserve_protocol_sequences(server):
    """plugserve.v1 Infer with the client's Sequence: the same batcher, the same refusals."""
    from plugserve.client import Client, Sequence

    with Client(server.target, timeout=30) as client:
        total = np.zeros((1, 4), np.float32)
        for i in range(5):
            x = np.full((1, 4), i, np.float32)
            total += x
            out = client.infer(
                "acc_direct", {"INPUT": x}, sequence=Sequence("stream-a", i == 0, i == 4)
            )
            np.testing.assert_array_equal(out["OUTPUT"], total)
        assert list(out) == ["OUTPUT"]  # the state output stays on the server
        with pytest.raises(grpc.RpcError, match="must specify the START flag"):
            client.infer("acc_direct", {"INPUT": x}, sequence=Sequence(5150))
        with pytest.raises(grpc.RpcError, match="non-zero or non-empty correlation"):
            client.infer("acc_direct", {"INPUT": x})


def test_plugserve_repository_config_json(tmp_path):
    """A plugserve repository's config.json takes Triton's sequence_batching in its JSON form
    (no dynamic batching beside it)."""
    import json

    folder = tmp_path / "repo" / "acc" / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(accumulator().SerializeToString())
    (folder.parent / "config.json").write_text(
        json.dumps(
            {
                "device": "NUMPY",
                "max_batch_size": 4,
                "sequence_batching": {
                    "oldest": {"max_candidate_sequences": 8},
                    "state": [
                        {
                            "input_name": "STATE_IN",
                            "output_name": "STATE_OUT",
                            "data_type": "TYPE_FP32",
                            "dims": [4],
                        }
                    ],
                },
            }
        )
    )
    with RunningServer("--model-repository", str(tmp_path / "repo")) as running:
        client = grpcclient.InferenceServerClient(running.target)
        try:
            _acc_step(client, "acc", 5, np.ones(4), start=True)
            np.testing.assert_array_equal(_acc_step(client, "acc", 5, np.ones(4))[0], [2] * 4)
            metadata = client.get_model_metadata("acc")
        finally:
            client.close()
    assert [i.name for i in metadata.inputs] == ["INPUT"]
    assert "ready on NUMPY" in running.log and "BATCH" not in running.log.split("listening")[1]


def test_stream_closed_mid_sequence(server):
    """A client that drops its stream with a sequence's requests still queued: they are
    dropped, nothing fails on the server, and the model serves the next client."""
    client = grpcclient.InferenceServerClient(server.target)
    client.start_stream(callback=lambda result, error: None)
    try:
        for i in range(200):
            tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
            client.async_stream_infer(
                "acc_oldest", [tensor], sequence_id=6060, sequence_start=i == 0
            )
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    client = grpcclient.InferenceServerClient(server.target)
    try:
        got = _acc_step(client, "acc_oldest", 6061, np.ones(4), start=True, end=True)
    finally:
        client.close()
    np.testing.assert_array_equal(got[0], np.ones(4))
    assert "Traceback" not in server.log and "InvalidStateError" not in server.log
