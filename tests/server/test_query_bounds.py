"""QueryNetwork's work, bounded: in time, and taken in turns per tenant.

Any ``infer`` client may send QueryNetwork, and the server reads, checks and transforms the
model it sends (NUMPY: ~0.1 ms of CPU a node here, up to --max-model-nodes, 250,000). The red
team's 80,000-node chain of 1.9 MB took 6.5 s, and a client could send as many at once as the
gRPC pool had threads. Now a query stops at --max-read-seconds (RESOURCE_EXHAUSTED naming it),
and a tenant's queries run one after another while other tenants' go on. Driven with real
gRPC clients against a real server, the chain made by onnx's helper.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from models import chain
from serving import RunningServer, examples_repository
from test_cancel import cpu_seconds

from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto import plugserve_pb2_grpc as pb_grpc
from plugserve.server.control.turns import WAITING

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")

#: nodes of the long chain: its query takes ~9 s here, past the limits below (4 s), while
#: onnx's shape inference of it (which --max-read-seconds bounds too, naming itself) takes
#: ~0.5 s: the stop the tests see is the query's own
LONG = 120_000
TOKENS = {"a": "query-bounds-token-a-0001", "b": "query-bounds-token-b-0002"}


@pytest.fixture(scope="module")
def long_chain() -> bytes:
    return chain([("Relu", {})] * LONG, shape=(1, 4), name="long").SerializeToString()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> bytes:
    repo = examples_repository(tmp_path_factory.mktemp("query-small"))
    return (repo / "add" / "1" / "model.onnx").read_bytes()


def _query(target: str, model: bytes, token: str = "") -> pb.QueryNetworkResponse:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.PlugserveStub(channel)
        return stub.QueryNetwork(
            pb.QueryNetworkRequest(model=pb.ModelSource(onnx=model), device="NUMPY"),
            metadata=metadata,
            timeout=120,
        )


def test_a_query_past_max_read_seconds_is_stopped(tmp_path, long_chain, small):
    repo = examples_repository(tmp_path)
    with RunningServer("--model-repository", str(repo), "--max-read-seconds", "4") as server:
        with pytest.raises(grpc.RpcError) as failed:
            _query(server.target, long_chain)
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, failed.value.details()
        assert "stopped after 4 s" in failed.value.details()
        assert "--max-read-seconds" in failed.value.details()
        # the work stopped with the answer: the server is quiet, and queries are answered
        before = cpu_seconds(server.process.pid)
        time.sleep(1.0)
        assert cpu_seconds(server.process.pid) - before < 0.5
        assert _query(server.target, small).supported


def test_a_tenants_queries_take_turns_while_another_tenants_go_on(tmp_path, long_chain, small):
    """a's long query holds a's turn until --max-read-seconds stops it; a's next WAITING
    queries wait for it, one more is refused at once; b's query does not wait."""
    repo = examples_repository(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} infer\n" for t in TOKENS.values()))
    tokens.chmod(0o600)
    args = ["--model-repository", str(repo), "--auth-tokens", str(tokens)]
    with RunningServer(*args, "--max-read-seconds", "4") as server:
        ended: dict[str, float] = {}
        outcome: dict[str, object] = {}

        def ask(key: str, model: bytes, token: str) -> None:
            try:
                outcome[key] = _query(server.target, model, token)
            except grpc.RpcError as exc:
                outcome[key] = (exc.code(), exc.details())
            ended[key] = time.monotonic()

        big = threading.Thread(target=ask, args=("a-long", long_chain, TOKENS["a"]))
        big.start()
        time.sleep(0.5)  # the long query holds a's turn
        others = [
            threading.Thread(target=ask, args=(f"a-{i}", small, TOKENS["a"]))
            for i in range(WAITING + 1)
        ]
        others.append(threading.Thread(target=ask, args=("b", small, TOKENS["b"])))
        started = time.monotonic()
        for thread in others:
            thread.start()
        for thread in [big, *others]:
            thread.join(120)
    assert outcome["a-long"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome["a-long"]
    # b's query did not wait for a's (which had 3.5 s to run yet)
    assert ended["b"] - started < 1.5 < ended["a-long"] - started, (started, ended)
    assert isinstance(outcome["b"], pb.QueryNetworkResponse) and outcome["b"].supported
    # a's next queries: one refused at once, the others answered once the long one ended (the
    # two answers reach their clients in either order: a quarter second)
    mine = [f"a-{i}" for i in range(WAITING + 1)]
    refused = [k for k in mine if not isinstance(outcome[k], pb.QueryNetworkResponse)]
    assert len(refused) == 1, {k: outcome[k] for k in refused}
    code, details = outcome[refused[0]]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "one at a time per token" in details
    assert ended[refused[0]] - started < 1.5, (started, ended)
    for key in set(mine) - set(refused):
        assert outcome[key].supported, outcome[key]
        assert ended[key] > ended["a-long"] - 0.25, (started, ended)


def test_queries_hold_a_quarter_of_the_grpc_threads_at_most_and_inference_goes_on(
    tmp_path, long_chain, small
):
    """With --grpc-workers 8 the server holds 2 queries at once, whatever their tenants: a's
    and b's long ones run, c's is refused at once (RESOURCE_EXHAUSTED, naming the bound), and
    c's inference is served meanwhile; once they stop, c's query is answered. Before, each of
    a token file's tenants could hold five handler threads (one running, four waiting), and a
    dozen tenants held them all."""
    repo = examples_repository(tmp_path)
    tokens = tmp_path / "tokens"
    names = {**TOKENS, "c": "query-bounds-token-c-0003"}
    tokens.write_text("".join(f"{t} infer\n" for t in names.values()))
    tokens.chmod(0o600)
    args = ["--model-repository", str(repo), "--auth-tokens", str(tokens)]
    with RunningServer(*args, "--max-read-seconds", "3", "--grpc-workers", "8") as server:
        outcome: dict[str, object] = {}

        def ask(key: str, token: str) -> None:
            try:
                outcome[key] = _query(server.target, long_chain, token)
            except grpc.RpcError as exc:
                outcome[key] = (exc.code(), exc.details())

        long = [threading.Thread(target=ask, args=(k, names[k])) for k in ("a", "b")]
        for thread in long:
            thread.start()
        time.sleep(0.5)  # both hold their turns (each runs past 3 s, stopped there)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            _query(server.target, small, names["c"])
        assert time.monotonic() - started < 1.5
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the most it holds at once" in refused.value.details(), refused.value.details()
        kserve = grpcclient.InferenceServerClient(server.target)
        given = []
        for name in ("a", "b"):
            given.append(grpcclient.InferInput(name, [3], "FP32"))
            given[-1].set_data_from_numpy(np.ones(3, np.float32))
        headers = {"authorization": f"Bearer {names['c']}"}
        answer = kserve.infer("add", given, headers=headers, client_timeout=5)
        kserve.close()
        assert answer.as_numpy("sum").tolist() == [2.0, 2.0, 2.0]
        for thread in long:
            thread.join(60)
        assert all(outcome[k][0] == grpc.StatusCode.RESOURCE_EXHAUSTED for k in "ab"), outcome
        assert _query(server.target, small, names["c"]).supported
