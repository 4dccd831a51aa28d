"""The KV host tier served (issue 61 items 1 and 2; server/apps/generate/engine/kv_host_tier.py):
a real server with two ``--auth-tokens`` tenants, tiny-llama three times over (two cache slots
each: ``MAX_NUM_SEQS`` 2) on each cache layout the tier copies: optimum's ONNX export on ORT and
on OPENVINO (the dense slot cache), the safetensors folder on TORCH (the torch decoder's
tensors) and optimum-intel's IR on OPENVINO (the paged cache, f32: blocks of 32 positions
against the engine's 16; and u8, openvino's default on most CPUs, its scales and zero points
per block: copied whole, the engine's blocks then 32 positions); the official ``openai``
client:

* ``tier`` keeps evicted blocks in a host tier (``KV_OFFLOADING_SIZE``), ``plain`` has none:
  four conversations interleaved turn by turn on two slots, so each turn finds its slot taken
  by another conversation; the tier's later turns are served from the host
  (``cached_tokens`` > 0, the restored-tokens metric moves), the plain model's compute their
  whole history (0), and both answer token for token the same (greedy);
* one tenant never gets another's blocks back from the host tier (B's first send of A's
  evicted prompt: 0 cached; A's own: restored);
* ``small``'s tier holds six blocks: its bytes (the metric) never exceed the bound.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, metric, serving  # noqa: E402

TOKENS = {"A": "kvtier-a-0123456789abcdef", "B": "kvtier-b-0123456789abcdef"}
#: tiny-llama's block: 2 layers x key and value x 2 KV heads x 16 positions x 16 dims x 4 bytes
BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4
SMALL_GIB = 6 * BLOCK_BYTES / 2**30
SLOTS = {"MAX_NUM_SEQS": "2"}
TOPICS = ["rivers", "mountains", "bridges", "gardens"]


#: each case's folder (a kind of llm_folder's), device and device config
CASES = {
    "ORT": ("optimum-onnx", "ORT", {}),
    "OPENVINO": ("optimum-onnx", "OPENVINO", {}),  # an ONNX graph: the dense slot cache
    "TORCH": ("hf", "TORCH", {"INFERENCE_NUM_THREADS": "1"}),
    "OPENVINO-IR": ("openvino", "OPENVINO", {"EXECUTION_MODE_HINT": "ACCURACY"}),  # f32 paged
    # openvino's default: a u8 paged cache (scales per block of 32: copied whole)
    "OPENVINO-IR-u8": ("openvino", "OPENVINO", {"KV_CACHE_PRECISION": "u8"}),
}


@pytest.fixture(scope="module", params=list(CASES))
def server(request, core, llm_folder, tmp_path_factory):
    kind, device, config = CASES[request.param]
    if device not in core.available_devices:
        pytest.skip(f"{device} is not available here")
    folder = llm_folder("tiny-llama", kind)
    path = tmp_path_factory.mktemp("kvtier") / "tokens"
    path.write_text(f"{TOKENS['A']} infer\n{TOKENS['B']} infer\n")
    path.chmod(0o600)
    slots = {**SLOTS, **config}
    models = {
        "tier": (folder, device, {**slots, "KV_OFFLOADING_SIZE": "0.01"}),
        "plain": (folder, device, slots),
        "small": (folder, device, {**slots, "KV_OFFLOADING_SIZE": repr(SMALL_GIB)}),
    }
    with serving(models, "--auth-tokens", str(path)) as running:
        running.case = request.param
        yield running


@pytest.fixture(scope="module")
def api(server):
    return {name: client(server, api_key=token) for name, token in TOKENS.items()}


def _complete(api, model: str, prompt: str) -> tuple[str, int]:
    answer = api.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens


def _conversations(api, model: str, turns: int = 3) -> list[list[tuple[str, int]]]:
    """Four conversations interleaved, turn by turn: each turn's prompt is the history so far
    (its own text, the answers, a new question); each turn's answer and cached tokens."""
    history = [f"A long talk about {topic}. " * 6 + f"Tell me about {topic}." for topic in TOPICS]
    seen: list[list[tuple[str, int]]] = [[] for _ in TOPICS]
    for turn in range(turns):
        for i, topic in enumerate(TOPICS):
            text, cached = _complete(api, model, history[i])
            seen[i].append((text, cached))
            history[i] += f"{text} And what about {topic} number {turn}?"
    return seen


def test_later_turns_come_from_the_host_tier_with_the_same_answers(server, api):
    a = api["A"]
    tier = _conversations(a, "tier")
    plain = _conversations(a, "plain")
    assert [[t for t, _c in c] for c in tier] == [[t for t, _c in c] for c in plain]
    assert all(cached == 0 for c in plain for _t, cached in c[1:])  # recomputed every turn
    assert all(cached >= 32 for c in tier for _t, cached in c[1:])  # restored history
    assert metric(server, "plugserve_generate_kv_offload_restored_tokens_total", "tier") >= 32 * 8
    assert metric(server, "plugserve_generate_kv_offload_restored_tokens_total", "plain") == 0
    assert metric(server, "plugserve_generate_kv_offload_bytes", "tier") > 0
    # a u8 cache's blocks (scales and zero points per block of 32) are copied whole: the
    # engine's blocks are 32 positions there, not 16, where the tier is on
    whole = "model tier: block_size 16 -> 32" in server.log
    assert whole == server.case.endswith("-u8"), server.log
    assert "model plain: block_size" not in server.log
    assert "is ignored" not in server.log


def test_a_tenant_never_restores_another_tenants_blocks(api):
    a, b = api["A"], api["B"]
    secret = "The vault code is 7341, never tell it to anyone at all. " * 4
    _complete(a, "tier", secret)
    _complete(a, "tier", "Filler one about the weather today and tomorrow. " * 4)
    _complete(a, "tier", "Filler two about the sea and its tides all year. " * 4)
    # A's secret is in the host tier now (its slot was taken); B sends it as its own
    assert _complete(b, "tier", secret + "Go on.")[1] == 0
    assert _complete(a, "tier", secret + "Go on.")[1] >= 32


def test_the_host_tier_never_holds_more_than_its_bound(server, api):
    bound = int(SMALL_GIB * 2**30)
    for _ in range(2):
        _conversations(api["A"], "small", turns=2)  # 8 chains of 4 to 6 blocks evicted
        held = metric(server, "plugserve_generate_kv_offload_bytes", "small")
        assert 0 < held <= bound
