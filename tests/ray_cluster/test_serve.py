"""``serve run plugserve.ray:app`` on a real three-node Ray cluster (issue 44, items 1 and 4).

One cluster for the module (tests/support/ray_cluster.py): a head that runs no replica (0 CPUs)
and two workers, each in its own network namespace, the GCS backed by Redis so the head can be
killed and started again. Three applications of plugserve.ray:app run on it:

* ``plugserve``: the example repository (and a tiny generative model when one is ready), two
  replicas, at most one per node, so each worker holds one;
* ``scaling``: autoscaling on ongoing requests, 1 to 2 replicas;
* ``multiplexed``: one replica holding at most 2 of 3 models (``serve.multiplexed``);
* ``routed`` (when the tiny generative model is made): prefix routing (``prefix_routing=true``),
  two replicas of the chat model, one per worker, behind plugserve's ingress.

Clients are the real ones, unchanged: tritonclient over gRPC (Serve's proxy, port 9000, with
the ``application`` metadata Serve routes by when it serves several applications) and over
HTTP (port 8000), the openai client. Answers are compared with a local ``plugserve serve`` of
the same repository. Ray's processes are ended by PID with their namespaces at the end.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray_cluster
from conftest import make_cluster
from serving import wait_for

pytestmark = pytest.mark.slow

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

APP = {"application": "plugserve"}
CHAT_MODEL = "tiny-chat"


def _llm_folder() -> Path | None:
    try:
        import llm

        return llm.export("tiny-llama", "optimum-onnx")
    except Exception:  # not made on this machine (yet): that part is skipped
        return None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from plugserve.server.control.examples import build_examples

    root = tmp_path_factory.mktemp("ray-serve")
    repository = build_examples(root / "models")
    chat = _llm_folder()
    if chat is not None:
        (repository / CHAT_MODEL).mkdir()
        (repository / CHAT_MODEL / "1").symlink_to(chat, target_is_directory=True)
        (repository / CHAT_MODEL / "config.json").write_text(json.dumps({"device": "ORT"}))
    small = root / "small"
    for name in ("add", "mlp", "echo"):
        shutil.copytree(repository / name, small / name)
    cluster = make_cluster(worker_cpus=4, fault_tolerant=True)
    try:
        apps = [
            {
                "name": "plugserve",
                "route_prefix": "/",
                "import_path": "plugserve.ray:app",
                "args": {
                    "model_repository": str(repository),
                    "num_replicas": 2,
                    "max_replicas_per_node": 1,
                },
            },
            {
                "name": "scaling",
                "route_prefix": "/scaling",
                "import_path": "plugserve.ray:app",
                "args": {
                    "name": "scaling",
                    "model_repository": str(small),
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 1,
                    "upscale_delay_s": 1,
                    "downscale_delay_s": 3,
                    "num_cpus": 0.5,
                },
            },
            {
                "name": "multiplexed",
                "route_prefix": "/multiplexed",
                "import_path": "plugserve.ray:app",
                "args": {
                    "name": "multiplexed",
                    "model_repository": str(small),
                    "models_per_replica": 2,
                    "num_cpus": 0.5,
                },
            },
        ]
        head = f"http://{cluster.head.ip}:{ray_cluster.HTTP_PORT}"
        ready = [
            f"{head}/v2/health/ready",
            f"{head}/scaling/v2/health/ready",
            f"{head}/multiplexed/v2/health/ready",
        ]
        if chat is not None:
            routed = root / "routed"
            routed.mkdir()
            (routed / CHAT_MODEL).symlink_to(repository / CHAT_MODEL, target_is_directory=True)
            args = {"model_repository": str(routed), "num_replicas": 2, "num_cpus": 0.5}
            args.update(name="routed", max_replicas_per_node=1, prefix_routing="true")
            apps.append(
                {"name": "routed", "route_prefix": "/routed", "import_path": "plugserve.ray:app",
                 "args": args}
            )  # fmt: skip
            ready.append(f"{head}/routed/v2/health/ready")
        cluster.serve_run(apps, ready)
        # both replicas of plugserve running (the proxy answers once one is)
        assert wait_for(
            lambda: cluster.replicas("plugserve:plugserve") == {"head": 0, "w1": 1, "w2": 1},
            120,
            1,
        ), cluster.replicas("plugserve:plugserve")
        yield cluster, repository, chat is not None
    finally:
        cluster.close()


def _inputs(module, model: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = {
        "add": {"a": rng.random(4, np.float32), "b": rng.random(4, np.float32)},
        "mlp": {"input": rng.random((2, 16), np.float32)},
    }[model]
    made = []
    for name, array in arrays.items():
        item = module.InferInput(name, list(array.shape), "FP32")
        item.set_data_from_numpy(array)
        made.append(item)
    return made


def _local_answers(repository: Path) -> dict[str, dict[str, np.ndarray]]:
    from serving import RunningServer

    with RunningServer("--model-repository", str(repository)) as server:
        client = grpcclient.InferenceServerClient(server.target)
        return {
            model: {o: client.infer(model, _inputs(grpcclient, model)).as_numpy(o) for o in outs}
            for model, outs in (("add", ["sum"]), ("mlp", ["probabilities"]))
        }


def test_kserve_grpc_rest_and_streams_answer_as_a_local_server(setup):
    cluster, repository, _ = setup
    local = _local_answers(repository)
    grpc_url = f"{cluster.head.ip}:{ray_cluster.GRPC_PORT}"
    via_grpc = grpcclient.InferenceServerClient(grpc_url)
    via_http = httpclient.InferenceServerClient(f"{cluster.head.ip}:{ray_cluster.HTTP_PORT}")
    assert via_grpc.is_server_ready(headers=APP) and via_http.is_server_ready()
    for model, outputs in local.items():
        for _ in range(4):  # Serve's router spreads them over both replicas
            answer = via_grpc.infer(model, _inputs(grpcclient, model), headers=APP)
            rest = via_http.infer(model, _inputs(httpclient, model))
            for name, expected in outputs.items():
                np.testing.assert_array_equal(answer.as_numpy(name), expected)
                np.testing.assert_array_equal(rest.as_numpy(name), expected)
    metadata = via_grpc.get_model_metadata("add", headers=APP, as_json=True)
    assert [i["name"] for i in metadata["inputs"]] == ["a", "b"]
    # a typed error keeps its status through the proxy
    with pytest.raises(InferenceServerException) as refused:
        via_grpc.infer("no_such_model", _inputs(grpcclient, "add"), headers=APP)
    assert refused.value.status() == "StatusCode.NOT_FOUND", refused.value
    # ModelStreamInfer through Serve's bidirectional gRPC proxy
    results: list = []
    done = threading.Event()

    def collect(result, error):
        results.append((result, error))
        if len(results) == 8:
            done.set()

    via_grpc.start_stream(collect, headers=APP)
    try:
        for i in range(8):
            via_grpc.async_stream_infer("add", _inputs(grpcclient, "add"), request_id=str(i))
        assert done.wait(60), results
    finally:
        via_grpc.stop_stream()
    assert all(error is None for _, error in results), results
    assert sorted(r.get_response().id for r, _ in results) == [str(i) for i in range(8)]
    for result, _ in results:
        np.testing.assert_array_equal(result.as_numpy("sum"), local["add"]["sum"])


def test_openai_routes_and_server_sent_events(setup):
    cluster, repository, has_chat = setup
    if not has_chat:
        pytest.skip(
            "the tiny generative model is not made yet: python tests/support/llm.py prepare"
        )
    import openai
    from serving import RunningServer

    messages = [{"role": "user", "content": "Hello there"}]
    ask = {"model": CHAT_MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    with RunningServer("--model-repository", str(repository)) as server:
        local = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="x", max_retries=0)
        expected = local.chat.completions.create(**ask).choices[0].message.content
    remote = openai.OpenAI(
        base_url=f"http://{cluster.head.ip}:{ray_cluster.HTTP_PORT}/v1", api_key="x", max_retries=0
    )
    assert remote.chat.completions.create(**ask).choices[0].message.content == expected
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in remote.chat.completions.create(**ask, stream=True)
        if chunk.choices
    ]
    assert len(pieces) > 1 and "".join(pieces) == expected


def _conversations(base_url: str, rounds: int, max_tokens: int = 4) -> list[tuple[int, int]]:
    """Four chat conversations interleaved, ``rounds`` turns each (a round's four turns sent
    at once, in a shuffled order), each with a system prompt of its own (~150 tokens); for
    every turn after the first: (its cached tokens, the previous turn's prompt tokens)."""
    import openai

    api = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
    words = ["router", "replica", "prefix", "cache", "block", "token", "tenant", "conversation"]
    talks = [
        [{"role": "system", "content": f"You are assistant {c}. " + " ".join(
            words[(c * 7 + i * i) % len(words)] for i in range(40))}]
        for c in range(4)
    ]  # fmt: skip
    previous = [0] * 4
    seen: list[tuple[int, int]] = []

    errors: list = []

    def turn(c: int, r: int) -> None:
        talks[c].append({"role": "user", "content": f"Question {r} of talk {c}?"})
        try:
            answer = api.chat.completions.create(
                model=CHAT_MODEL, messages=talks[c], max_tokens=max_tokens, temperature=0
            )
        except Exception as exc:  # reported below
            errors.append(repr(exc))
            return
        talks[c].append({"role": "assistant", "content": answer.choices[0].message.content})
        usage = answer.usage
        if r:
            seen.append((usage.prompt_tokens_details.cached_tokens, previous[c]))
        previous[c] = usage.prompt_tokens

    for r in range(rounds):
        order = random.Random(r).sample(range(4), 4)
        threads = [threading.Thread(target=turn, args=(c, r)) for c in order]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
    assert not errors, errors
    return seen


def test_prefix_routing_sends_a_conversation_to_its_prefix_and_loses_no_request(setup):
    """Two replicas behind the prefix-routed ingress: each later turn lands on the replica
    that served the turn before, shown by its cached tokens covering that turn's whole prompt
    (less a partial block). The same conversations through Serve's own routing (the
    ``plugserve`` application, two replicas too) are the control: it keeps a conversation on
    its replica about half the time, so 14 or more of 16 happens by chance with probability
    0.2% (binomial, p = 1/2). The rounds are sent in a shuffled order because in a fixed one
    Serve's routing is sticky by accident (13 of 16 in a first run: a tie goes to the replica
    whose queue-length probe answers first, so the n-th request of a round kept its replica).
    Then one replica's process is killed under 12 clients' load, once it computes: the
    requests it held are sent again by the ingress (its log says so), and none is lost."""
    cluster, _, has_chat = setup
    if not has_chat:
        pytest.skip(
            "the tiny generative model is not made yet: python tests/support/llm.py prepare"
        )
    head = f"http://{cluster.head.ip}:{ray_cluster.HTTP_PORT}"
    block = 16  # the prefix cache's block size (the engine's default)

    def whole(seen):
        return sum(cached >= before - block for cached, before in seen)

    routed = _conversations(f"{head}/routed/v1", 5)
    plain = _conversations(f"{head}/v1", 5)
    assert len(routed) == len(plain) == 16
    assert whole(routed) >= 14, (whole(routed), routed, whole(plain), plain)
    assert whole(routed) > whole(plain), (routed, plain)

    import openai

    api = openai.OpenAI(base_url=f"{head}/routed/v1", api_key="x", max_retries=0, timeout=120)

    def call():  # 256 tokens: a replica holds each request long enough to be killed with it
        # each call's own leading text: no prefix to follow, so the calls spread over both
        # replicas (one shared prompt sent them all to its replica, and the killed one once
        # held none; with 6 clients of 64 tokens, a CI run's killed replica held none too)
        messages = [{"role": "user", "content": f"{uuid.uuid4().hex} Count to ten."}]
        api.chat.completions.create(
            model=CHAT_MODEL, messages=messages, max_tokens=256, extra_body={"ignore_eos": True}
        )

    stop = threading.Event()
    outcome: list = []
    worker = threading.Thread(
        target=lambda: outcome.append(ray_cluster.load(12, 60, call, stop)), daemon=True
    )
    pids = [p for node in cluster.nodes for p in cluster.replica_pids("routed:routed", node)]
    assert len(pids) == 2, pids
    worker.start()
    # the replica killed is one that computes (requests in hand) 3 s or more into the load,
    # not the one on w2 at 4 s: a loaded CI host once had that one idle then, and nothing to
    # send again; killed as the load began, a computing replica once had nothing sent again
    # (not found why; perhaps requests Serve was still placing, which it retries itself)
    seen: dict[int, float] = {}

    def computing() -> bool:
        for pid in pids:
            seen[pid] = _cpu_in(pid, 0.5)
            if seen[pid] >= 0.1:
                os.kill(pid, signal.SIGKILL)
                return True
        return False

    def resent() -> bool:  # the ingress's warning, in its log under the cluster's folder
        found = subprocess.run(["grep", "-rqF", "sent again (", str(cluster.root)])
        return found.returncode == 0

    time.sleep(3)
    killed = wait_for(computing, 40, 0.1)
    if killed and not wait_for(resent, 8):
        # a replica killed while it used CPU held no request to send again (CI, 538352c;
        # Serve may re-place what it had not handed over itself): one more kill, of a replica
        # computing now, while the load goes on; a resend that never works fails both
        pids = [p for node in cluster.nodes for p in cluster.replica_pids("routed:routed", node)]
        killed = wait_for(computing, 40, 0.1)
    time.sleep(11)  # the load goes on while the ingress sends the lost requests again
    stop.set()
    worker.join(200)
    calls, errors = outcome[0]
    assert calls > 20 and errors == [], f"{len(errors)} of {calls} lost: {errors[:5]}"
    assert killed, f"neither replica computed under the load (CPU s in 0.5 s: {seen})"
    assert wait_for(resent, 30), "the killed replica held no request: nothing was sent again"


def _cpu_in(pid: int, seconds: float) -> float:
    """CPU seconds process ``pid`` spends in the next ``seconds`` (0 once it is gone)."""

    def spent() -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = spent()
    time.sleep(seconds)
    return spent() - before


def test_multiplexed_models_load_on_demand_within_the_bound(setup):
    cluster, _, _ = setup
    base = f"http://{cluster.head.ip}:{ray_cluster.HTTP_PORT}/multiplexed"
    for model in ("add", "mlp", "echo", "add", "mlp"):
        inputs = {
            "add": [{"name": "a", "shape": [2], "datatype": "FP32", "data": [1, 2]},
                    {"name": "b", "shape": [2], "datatype": "FP32", "data": [3, 4]}],
            "mlp": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [1] * 16}],
            "echo": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}],
        }[model]  # fmt: skip
        request = urllib.request.Request(
            f"{base}/v2/models/{model}/infer",
            data=json.dumps({"inputs": inputs}).encode(),
            headers={"serve_multiplexed_model_id": model, "content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            body = json.loads(answer.read())
        assert body["model_name"] == model
        if model == "add":
            assert body["outputs"][0]["data"] == [4, 6]
        if model == "echo":
            assert body["outputs"][0]["data"] == ["hi"]
    index = urllib.request.Request(f"{base}/v2/repository/index", data=b'{"ready": true}')
    with urllib.request.urlopen(index, timeout=30) as answer:
        loaded = [m["name"] for m in json.loads(answer.read())]
    assert len(loaded) <= 2 and "mlp" in loaded, loaded  # the least recently used went


def _grpc_load(
    url: str,
    clients: int,
    seconds: float,
    app: str = "plugserve",
    stop=None,
    retried: list | None = None,
):
    """Closed-loop tritonclient requests to ``url`` from ``clients`` threads. With ``retried``
    (a list), a request Serve answers because its replica died is sent once more, as Ray's
    docs tell clients to (Serve retries a request it could not place, never one a replica
    had), and each such first failure is appended there."""
    channels = [grpcclient.InferenceServerClient(url) for _ in range(clients)]
    inputs = _inputs(grpcclient, "add")
    lock = threading.Lock()
    index = [0]

    def call():
        with lock:
            client = channels[index[0] % clients]
            index[0] += 1
        try:
            client.infer("add", inputs, headers={"application": app}, client_timeout=30)
        except InferenceServerException as exc:
            if retried is None or "actor" not in str(exc):
                raise
            retried.append((time.monotonic(), str(exc)))
            client.infer("add", inputs, headers={"application": app}, client_timeout=30)

    return ray_cluster.load(clients, seconds, call, stop)


def test_autoscaling_goes_up_under_load_and_back_down(setup):
    cluster, _, _ = setup
    url = f"{cluster.head.ip}:{ray_cluster.GRPC_PORT}"
    assert sum(cluster.replicas("scaling:scaling").values()) == 1
    stop = threading.Event()
    outcome: list = []
    worker = threading.Thread(
        target=lambda: outcome.append(_grpc_load(url, 8, 120, "scaling", stop)), daemon=True
    )
    worker.start()
    try:
        up = wait_for(lambda: sum(cluster.replicas("scaling:scaling").values()) == 2, 90, 1)
    finally:
        stop.set()
        worker.join(150)
    assert up, "no second replica under load"
    calls, errors = outcome[0]
    assert calls > 0 and errors == [], errors[:5]
    down = wait_for(lambda: sum(cluster.replicas("scaling:scaling").values()) == 1, 90, 1)
    assert down, cluster.replicas("scaling:scaling")


def _proxy_ready(cluster, node: str) -> bool:
    url = f"http://{cluster.nodes[node].ip}:{ray_cluster.HTTP_PORT}/v2/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=3) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_a_worker_node_killed_under_load_loses_no_request(setup):
    """A worker node killed under load loses no request of a client that retries once what
    Serve answers for a dead replica (Ray's advice to clients): Serve's router retries a
    request it could not place, never one already sent to a replica, so the requests the
    killed node was running when it died are answered at once with that error (Serve's proxy:
    INTERNAL, "the actor ... is unavailable"), at most one per client, and their retry is
    answered by the replica on the other node, as is every request after."""
    cluster, _, _ = setup
    url = f"{cluster.head.ip}:{ray_cluster.GRPC_PORT}"  # the head's proxy outlives w2
    clients = 4
    stop = threading.Event()
    outcome: list = []
    retried: list = []
    worker = threading.Thread(
        target=lambda: outcome.append(_grpc_load(url, clients, 20, stop=stop, retried=retried)),
        daemon=True,
    )
    worker.start()
    time.sleep(4)
    killed_at = time.monotonic()
    killed = cluster.kill_node("w2")
    worker.join(200)
    calls, errors = outcome[0]
    assert killed > 0 and calls > 100
    assert errors == [], f"{len(errors)} of {calls} lost: {errors[:5]}"
    assert len(retried) <= clients, f"{len(retried)} of {calls} retried: {retried[:5]}"
    for when, why in retried:
        assert when - killed_at < 5 and "actor" in why, (when - killed_at, why)
    # w2 back, with its replica again, for the tests after
    cluster.restart_node("w2")
    assert wait_for(
        lambda: cluster.replicas("plugserve:plugserve") == {"head": 0, "w1": 1, "w2": 1}, 180, 1
    ), cluster.replicas("plugserve:plugserve")


def test_the_head_killed_and_restarted_with_redis_ft_loses_no_request(setup):
    """With the GCS in Redis, a worker's proxy and replica serve on while the head is down
    and after it comes back: not one request fails."""
    cluster, _, _ = setup
    assert wait_for(lambda: _proxy_ready(cluster, "w1"), 120, 1)
    url = f"{cluster.nodes['w1'].ip}:{ray_cluster.GRPC_PORT}"  # a worker's proxy
    stop = threading.Event()
    outcome: list = []
    worker = threading.Thread(
        target=lambda: outcome.append(_grpc_load(url, 4, 30, stop=stop)), daemon=True
    )
    worker.start()
    time.sleep(4)
    killed = cluster.kill_node("head")
    time.sleep(5)  # the cluster runs without its GCS meanwhile
    cluster.restart_node("head")
    cluster.wait_nodes(["head", "w1", "w2"], 120)
    worker.join(200)
    calls, errors = outcome[0]
    assert killed > 0 and calls > 100
    assert errors == [], f"{len(errors)} of {calls} lost: {errors[:5]}"
