"""``/v1/embeddings`` runs as its caller's tenant (docs/security.md, *Tenants*): a real server
with an ``--auth-tokens`` file of two ``infer`` tokens, a tiny BERT encoder on NUMPY with one
stream and a queue of 8, the official ``openai`` client with ``api_key=TOKEN``.

Tenant a sends 24 embeddings requests at once: the encoder's queue takes its share of them
(seven eighths alone: 7) and the rest are refused naming a's own count; tenant b's request, sent
meanwhile, is served. Before, an embeddings run was the server's own (no tenant): it jumped
every tenant's queued requests and no tenant's share bounded it.
"""

from __future__ import annotations

import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, serving  # noqa: E402

MODEL = "bert"
TOKENS = {"a": "embed-tenant-a-0123456789", "b": "embed-tenant-b-0123456789"}
QUEUE = 8
#: a long input, so that each request's run takes a while on one stream
TEXT = "the quick brown fox jumps over the lazy dog " * 5


@pytest.fixture(scope="module")
def server(encoder_folder, tmp_path_factory):
    path = tmp_path_factory.mktemp("embed-tenants") / "tokens"
    path.write_text("".join(f"{token} infer tenant={who}\n" for who, token in TOKENS.items()))
    path.chmod(0o600)
    args = ("--auth-tokens", str(path), "--queue-size", str(QUEUE))
    entries = {MODEL: (encoder_folder("tiny-bert-mean"), "NUMPY", {"NUM_STREAMS": "1"})}
    with serving(entries, *args) as running:
        yield running


def test_a_tenants_embeddings_hold_its_share_of_the_queue_and_the_other_is_served(server):
    api = {who: client(server, api_key=token) for who, token in TOKENS.items()}
    api["a"].embeddings.create(model=MODEL, input=[TEXT])  # loaded and warm
    outcomes: list = []
    lock = threading.Lock()

    def flood() -> None:
        try:
            api["a"].embeddings.create(model=MODEL, input=[TEXT] * 16)
            outcome: object = "served"
        except openai.APIStatusError as exc:
            outcome = exc
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=flood) for _ in range(24)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # a's requests wait in the encoder's queue
    answer = api["b"].embeddings.create(model=MODEL, input=["hello"])
    for thread in threads:
        thread.join(120)
    assert len(answer.data) == 1 and len(answer.data[0].embedding) > 0
    refused = [o for o in outcomes if o != "served"]
    assert refused, "every one of a's 24 requests waited: no tenant's share bounded them"
    for exc in refused:
        assert exc.status_code in (429, 503), exc
        assert "this tenant's" in exc.message and "share of the queue" in exc.message, exc.message
    assert outcomes.count("served") >= 7, outcomes
