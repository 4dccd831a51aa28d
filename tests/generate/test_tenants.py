"""Tenants are isolated (security issue 58, point 4; docs/security.md, *Tenants*): a real server
with an ``--auth-tokens`` file of four ``infer`` tokens (A and B each their own tenant, C and D
sharing ``tenant=team``), tiny-llama's safetensors folder on TORCH, the official ``openai``
client with ``api_key=TOKEN``.

* the prefix cache: A's repeat of its prompt is cached (``cached_tokens`` > 0), B's first send
  of the same prompt is not (0): what measured a PIN out of another token's system prompt in
  ~900 requests on main; C and D share theirs; a ``cache_salt`` splits one tenant's cache;
  without tokens a repeat is cached as before, and a salt still splits it; the KServe faces
  (REST generate, gRPC ModelStreamInfer with tritonclient) carry the tenant too;
* the Responses store: B sending more responses than a tenant's share evicts B's own only, A's
  ``previous_response_id`` turn still runs, and B's GET, DELETE and continuation of A's id are
  404, as for an id never made.
"""

from __future__ import annotations

import time
import uuid

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, metric, serving  # noqa: E402

MODEL = "llama"
TOKENS = {
    "A": "tenant-a-0123456789abcdef",
    "B": "tenant-b-0123456789abcdef",
    "C": "tenant-c-0123456789abcdef",
    "D": "tenant-d-0123456789abcdef",
}
#: the store's entries; three tenants (A, B, team) share it: 4 responses each
ENTRIES = 12
SHARE = ENTRIES // 3
DEVICE = {"INFERENCE_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(hf_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tokens"
    path.write_text(
        "# TOKEN ROLE [tenant=NAME]\n"
        f"{TOKENS['A']} infer\n{TOKENS['B']} infer\n"
        f"{TOKENS['C']} infer tenant=team\n{TOKENS['D']} infer tenant=team\n"
    )
    path.chmod(0o600)
    args = ("--auth-tokens", str(path), "--responses-store-entries", str(ENTRIES))
    with serving({MODEL: (hf_llama, "TORCH", DEVICE)}, *args) as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    return {name: client(server, api_key=token) for name, token in TOKENS.items()}


def _prompt() -> str:
    """A prompt of several cache blocks (16 tokens each) no other test has sent."""
    secret = uuid.uuid4().hex[:8]
    return f"System: the account PIN is {secret}. Never tell it. " * 6 + "User: hello"


def _cached(api, prompt: str, **extra) -> int:
    answer = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra or None
    )
    assert answer.usage.prompt_tokens > 48
    return answer.usage.prompt_tokens_details.cached_tokens


def _chat_cached(api, prompt: str) -> int:
    answer = api.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": prompt}], max_tokens=1
    )
    return answer.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_never_hits_another_tenants_prefix_cache(api):
    prompt = _prompt()
    assert _cached(api["A"], prompt) == 0
    assert _cached(api["A"], prompt) > 0  # A's own repeat is served from the cache
    assert _cached(api["B"], prompt) == 0  # the same prompt, another tenant: nothing cached
    assert _cached(api["B"], prompt) > 0  # B's own now
    assert _cached(api["C"], prompt) == 0
    assert _cached(api["D"], prompt) > 0  # C and D are one tenant (tenant=team)
    chat = _prompt()  # the chat route, as the measured attack used
    assert _chat_cached(api["A"], chat) == 0
    assert _chat_cached(api["B"], chat) == 0
    assert _chat_cached(api["A"], chat) > 0


def test_cache_salt_partitions_one_tenants_cache(api):
    prompt = _prompt()
    assert _cached(api["A"], prompt, cache_salt="alpha") == 0
    assert _cached(api["A"], prompt, cache_salt="alpha") > 0
    assert _cached(api["A"], prompt, cache_salt="beta") == 0
    assert _cached(api["A"], prompt) == 0  # no salt is a partition of its own
    assert _cached(api["B"], prompt, cache_salt="alpha") == 0  # a salt never crosses tenants
    responses = api["A"].responses.create(
        model=MODEL, input=prompt, max_output_tokens=1, store=False,
        extra_body={"cache_salt": "alpha"},
    )  # fmt: skip
    assert responses.usage.input_tokens_details.cached_tokens == 0  # a chat prompt: new blocks
    for bad in (7, "", "s" * 257):
        with pytest.raises(openai.BadRequestError) as error:
            _cached(api["A"], prompt, cache_salt=bad)
        assert error.value.body["param"] == "cache_salt"


def test_a_tenant_flooding_the_store_evicts_its_own_responses_only(api):
    a, b = api["A"], api["B"]
    kept = a.responses.create(model=MODEL, input="Remember 42.", max_output_tokens=2)
    flood = [
        b.responses.create(model=MODEL, input="Spam.", max_output_tokens=1).id
        for _ in range(2 * SHARE + 1)  # more than the store holds for a tenant
    ]
    # B's oldest are gone (its share is SHARE), its newest kept
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(flood[0])
    assert b.responses.retrieve(flood[-1]).id == flood[-1]
    # A's response survived the flood: retrieved and continued
    assert a.responses.retrieve(kept.id).id == kept.id
    follow = a.responses.create(
        model=MODEL, input="What number?", previous_response_id=kept.id, max_output_tokens=2
    )
    assert follow.previous_response_id == kept.id
    # B cannot read, list, continue or delete A's response: 404s, as for an id never made
    never = "resp_" + uuid.uuid4().hex
    for rid in (kept.id, never):
        with pytest.raises(openai.NotFoundError) as missing:
            b.responses.retrieve(rid)
        assert rid in missing.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            b.responses.input_items.list(rid)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(
                model=MODEL, input="And?", previous_response_id=rid, max_output_tokens=1
            )
    # neither can C, nor D of the same tenant as C
    with pytest.raises(openai.NotFoundError):
        api["D"].responses.retrieve(kept.id)
    made = api["C"].responses.create(model=MODEL, input="Team note.", max_output_tokens=1)
    assert api["D"].responses.retrieve(made.id).id == made.id  # one tenant: one shelf
    assert a.responses.retrieve(kept.id).id == kept.id  # B's delete did not remove it
    a.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(kept.id)


def test_the_kserve_faces_carry_the_tenant(server):
    """REST ``generate`` and gRPC ``ModelStreamInfer`` find their own tenant's blocks, and only
    theirs (the prefix-cache counter of /metrics says what was cached): a request on either
    face hits what the same tenant sent on the other."""
    import json
    import queue
    import urllib.request

    import numpy as np

    grpcclient = pytest.importorskip("tritonclient.grpc")
    prompt = _prompt()
    params = {"max_tokens": 1, "temperature": 0}

    def cached() -> float:
        return metric(server, "plugserve_generate_prompt_tokens_cached_total", MODEL)

    def rest(who: str) -> None:
        request = urllib.request.Request(
            f"{server.http_url}/v2/models/{MODEL}/generate",
            json.dumps({"text_input": prompt, "parameters": params}).encode(),
            {"content-type": "application/json", "authorization": f"Bearer {TOKENS[who]}"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200

    def grpc(who: str) -> None:
        inputs = [
            grpcclient.InferInput("text_input", [1], "BYTES"),
            grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
        ]
        inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
        inputs[1].set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
        answers: queue.Queue = queue.Queue()
        stream = grpcclient.InferenceServerClient(server.target)
        headers = {"authorization": f"Bearer {TOKENS[who]}"}
        stream.start_stream(callback=lambda result, error: answers.put(error), headers=headers)
        try:
            stream.async_stream_infer(MODEL, inputs, request_id=who)
            assert answers.get(timeout=60) is None
        finally:
            stream.stop_stream()
            stream.close()

    rest("A")
    before = cached()
    grpc("B")  # another tenant: nothing of A's
    assert cached() == before
    grpc("A")  # A on gRPC finds what A sent on REST
    assert cached() > before
    before = cached()
    rest("B")  # and B on REST what B sent on gRPC
    assert cached() > before


def test_without_tokens_the_server_is_one_tenant(hf_llama):
    with serving({MODEL: (hf_llama, "TORCH", DEVICE)}) as running:
        first, second = client(running), client(running)
        prompt = _prompt()
        assert _cached(first, prompt) == 0
        assert _cached(second, prompt) > 0  # as before: one cache for every client
        assert _cached(second, prompt, cache_salt="mine") == 0  # a salt still partitions
        assert _cached(first, prompt, cache_salt="mine") > 0
        made = first.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        assert second.responses.retrieve(made.id).id == made.id


def test_the_token_file_names_tenants_compatibly(tmp_path):
    """``TOKEN ROLE`` lines as before, ``tenant=NAME`` as a third field; anything else in it
    stops startup naming the line, never the token."""
    from plugserve.server.protocols.auth import load_tokens

    path = tmp_path / "tokens"
    path.write_text(
        f"{TOKENS['A']} infer\n{TOKENS['B']} admin tenant=ops\n{TOKENS['C']} infer tenant=ops\n"
    )
    path.chmod(0o600)
    tokens = load_tokens(str(path))
    assert tokens.tenants == 2
    role_a, tenant_a = tokens.identify(TOKENS["A"])
    assert (role_a, tokens.identify(TOKENS["B"])) == ("infer", ("admin", "ops"))
    assert tokens.identify(TOKENS["C"]) == ("infer", "ops") and tenant_a not in ("", "ops")
    assert tokens.identify("nobody-0123456789abcdef") == (None, "")
    for third in ("team", "tenant=", "tenant=a/b", "owner=x", "tenant=x extra"):
        path.write_text(f"{TOKENS['A']} infer {third}\n")
        with pytest.raises(SystemExit) as stopped:
            load_tokens(str(path))
        assert "line 1" in str(stopped.value) and TOKENS["A"] not in str(stopped.value)


def test_the_store_evicts_within_a_tenant_even_when_the_budget_is_full():
    """The store against the server's real budget object: each tenant's share is the store's
    bounds over the tenants; a full memory budget makes a tenant evict its own oldest, and a
    tenant holding nothing there keeps nothing rather than evicting another's."""
    from plugserve.server.plane.budget import MemoryBudget
    from plugserve.server.protocols.openai.responses_store import ResponseStore

    budget = MemoryBudget(1 << 20)
    store = ResponseStore(budget, max_entries=6, max_bytes=1 << 20, max_age_s=0, tenants=2)
    assert (store.tenant_entries, store.tenant_bytes) == (3, 1 << 19)
    body = {"output": "x" * 1000}
    for i in range(2):
        assert store.put(f"a{i}", body, [], tenant="A")
    for i in range(10):  # B's flood: B's own oldest go
        assert store.put(f"b{i}", body, [], tenant="B")
    assert store.held("A") == 2 and store.held("B") == 3
    assert store.get("a0", "A") and store.get("a0", "B") is None and not store.delete("a0", "B")
    other = budget.charge(budget.limit - budget.used, "another request")  # the budget is full
    assert store.put("b10", body, [], tenant="B")  # B made room of its own
    assert store.held("A") == 2 and store.held("B") == 3
    assert not store.put("c0", body, [], tenant="C")  # C holds nothing to evict: not kept
    assert store.held("A") == 2 and store.get("a1", "A")
    other.release()
    store.clear()
    assert budget.used == 0 and store.nbytes == 0 and len(store) == 0


def test_one_tenant_may_hold_seven_eighths_of_the_queue(hf_llama, tmp_path):
    """A model's queue holds MAX_WAITING requests (8 here); one tenant may have 7 of them
    waiting (``Engine.add``'s share), so another tenant always finds room: while A's long
    request holds the one slot, A's eighth waiting request is refused 429 naming its share,
    and B's is taken (the queue then full). Without the share A's eighth was taken and B's
    refused."""
    path = tmp_path / "tokens"
    path.write_text(f"{TOKENS['A']} infer\n{TOKENS['B']} infer\n")
    path.chmod(0o600)
    config = {**DEVICE, "MAX_WAITING": "8", "MAX_NUM_SEQS": "1"}
    with serving({MODEL: (hf_llama, "TORCH", config)}, "--auth-tokens", str(path)) as running:
        a, b = client(running, api_key=TOKENS["A"]), client(running, api_key=TOKENS["B"])
        for _ in range(3):  # the long request may end first on a slow machine: again
            outcome = _fill_the_queue(running, a, b)
            if outcome is not None:
                break
        assert outcome is not None, "the long request ended before the queue filled, 3 times"
        refusals, finished = outcome
        assert len(refusals) == 1 and "share of the queue" in str(refusals[0]), refusals
        assert isinstance(refusals[0], openai.RateLimitError)
        assert sorted(finished) == ["A"] * 7 + ["B"]


def _fill_the_queue(running, a, b) -> tuple[list, list] | None:
    """A's long request in the slot, eight more of A's, then B's: the refusals and who was
    served, or None when the long request ended before the queue was full."""
    import threading

    refusals: list[Exception] = []
    finished: list[str] = []

    def ask(api, who: str) -> None:
        try:
            api.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
            finished.append(who)
        except openai.APIStatusError as exc:
            refusals.append(exc)

    def waiting() -> float:
        return metric(running, "vllm:num_requests_waiting", "", model_name=MODEL)

    def until(done) -> bool:
        deadline = time.monotonic() + 30
        while not done() and time.monotonic() < deadline:
            time.sleep(0.02)
        return done()

    long = a.completions.create(
        model=MODEL, prompt="Once", max_tokens=500, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(long))  # it holds the one slot
    threads = [threading.Thread(target=ask, args=(a, "A")) for _ in range(8)]
    for thread in threads:
        thread.start()
    full = until(lambda: waiting() + len(refusals) + len(finished) >= 8)
    threads.append(threading.Thread(target=ask, args=(b, "B")))
    threads[-1].start()
    full = full and until(lambda: waiting() + len(finished) >= 8) and not finished
    long.close()  # the slot frees: the queue runs
    for thread in threads:
        thread.join(timeout=120)
    return (refusals, finished) if full else None
