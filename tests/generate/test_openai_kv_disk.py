"""The KV disk tier served (issue 61 item 2; server/apps/generate/engine/kv_disk_tier.py): a
real server, tiny-llama's optimum export on ORT with two cache slots (``MAX_NUM_SEQS`` 2), a
host tier of six blocks (``KV_OFFLOADING_SIZE``) and a disk tier under a temporary directory
(``KV_DISK_PATH``, ``KV_DISK_SIZE``), the official ``openai`` client:

* four conversations interleaved turn by turn hold more than the slots and the host tier: the
  blocks the host tier drops go to disk, and later turns restore them from there
  (``cached_tokens`` > 0, the disk's restored-tokens metric moves);
* the server stopped and started again on the same directory (its slots and host tier empty):
  the first repeated prompt gets its cached tokens from disk, and answers as before (greedy);
* a disk that does not answer (each block file replaced by a FIFO nobody writes: a read of it
  waits, as on a hung or very slow disk) stalls nobody: the prompt whose blocks are there is
  answered as before, computed, once its wait for the reader is over
  (``kv_disk_tier.STAGE_WAIT_S``), and another request sent while it waits is answered too;
  the reader was in the file the whole time. Before, the engine's loop read the files itself
  at admission: every stream of the model waited on the disk.
"""

from __future__ import annotations

import os
import threading

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, metric, serving  # noqa: E402
from test_openai_kv_offload import SLOTS, SMALL_GIB, _complete, _conversations  # noqa: E402

RESTORED = "plugserve_generate_kv_disk_restored_tokens_total"
FILLERS = [f"Something else entirely, number {i}, about the weather. " * 5 for i in range(4)]


def _models(folder, directory) -> dict:
    keys = {**SLOTS, "KV_OFFLOADING_SIZE": repr(SMALL_GIB)}
    return {
        "disk": (folder, "ORT", {**keys, "KV_DISK_PATH": str(directory), "KV_DISK_SIZE": "0.01"})
    }


def test_blocks_come_back_from_disk_and_after_a_restart(core, llm_folder, tmp_path):
    if "ORT" not in core.available_devices:
        pytest.skip("ORT is not available here")
    folder = llm_folder("tiny-llama", "optimum-onnx")  # an ONNX graph: the dense slot cache
    directory = tmp_path / "kv"
    with serving(_models(folder, directory)) as running:
        api = client(running)
        seen = _conversations(api, "disk")
        assert all(cached >= 32 for c in seen for _t, cached in c[1:])
        assert metric(running, RESTORED, "disk") > 0  # some of it came from disk
        assert metric(running, "plugserve_generate_kv_disk_bytes", "disk") > 0
        first = "A long talk about rivers. " * 6 + "Tell me about rivers."
        before = _complete(api, "disk", first)
        for filler in FILLERS:  # every block of ``first`` through the host tier to disk
            _complete(api, "disk", filler)
    assert any(directory.rglob("*.kvb"))
    with serving(_models(folder, directory)) as running:
        api = client(running)
        assert metric(running, RESTORED, "disk") == 0
        again = _complete(api, "disk", first)
        assert again[1] >= 32  # its blocks read back from the files the first server wrote
        assert metric(running, RESTORED, "disk") == again[1]
        assert again[0] == before[0]


def _release(fifos: list) -> int:
    """Each FIFO a reader holds open given an end of file (a writer opens and closes it); how
    many had a reader."""
    held = 0
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: nobody reads it
            continue
        held += 1
    return held


def test_a_disk_that_does_not_answer_stalls_no_request(core, llm_folder, tmp_path):
    if "ORT" not in core.available_devices:
        pytest.skip("ORT is not available here")
    folder = llm_folder("tiny-llama", "optimum-onnx")
    directory = tmp_path / "kv"
    with serving(_models(folder, directory)) as running:
        api = client(running, timeout=60)  # a stalled loop fails the test, not hangs it
        first = "A long talk about rivers. " * 6 + "Tell me about rivers."
        before = _complete(api, "disk", first)
        for i in range(8):  # every block of ``first`` out of the slots and the host tier
            _complete(api, "disk", f"Something else, number {i}, about the weather. " * 5)
        files = sorted(directory.rglob("*.kvb"))
        assert files
        for path in files:  # still in the tier's index; a read now waits for a writer
            path.unlink()
            os.mkfifo(path)
        answers: dict[str, tuple[str, int]] = {}
        waiting = threading.Thread(
            target=lambda: answers.update(first=_complete(api, "disk", first))
        )
        waiting.start()
        try:
            other = _complete(api, "disk", "Tell me about deserts, briefly.")
            waiting.join(timeout=60)
            assert not waiting.is_alive(), "the prompt whose blocks are on disk was not answered"
            assert answers["first"][0] == before[0]  # computed: the same greedy answer
            assert other[0]
            held = _release(files)
        finally:
            _release(files)
            waiting.join(timeout=60)
        assert held >= 1  # the reader was still in a file when both had been answered


def test_a_revoked_tokens_blocks_go_to_no_other_token_after_a_restart(core, llm_folder, tmp_path):
    """With tokens, the blocks on disk are salted with their tenant. A token without a
    ``tenant=`` name was named by its line's place in the file: revoking the first line and
    restarting made the second token ``#1``, and it read the revoked token's blocks off the
    disk (``cached_tokens`` of a prompt only that token had sent). Now a token is known by a
    digest of itself: its own blocks come back after the restart, the revoked one's do not."""
    if "ORT" not in core.available_devices:
        pytest.skip("ORT is not available here")
    folder = llm_folder("tiny-llama", "optimum-onnx")
    directory = tmp_path / "kv"
    tokens = tmp_path / "tokens"
    tokens.write_text("revoked-token-0001 infer\nkept-token-0002 infer\n")
    tokens.chmod(0o600)
    secret = "The vault code is 4821. " * 6 + "Tell me about vaults."
    mine = "A long talk about rivers. " * 6 + "Tell me about rivers."
    with serving(_models(folder, directory), "--auth-tokens", str(tokens)) as running:
        _complete(client(running, api_key="revoked-token-0001"), "disk", secret)
        kept = client(running, api_key="kept-token-0002")
        _complete(kept, "disk", mine)
        for filler in FILLERS:  # every block of both through the host tier to disk
            _complete(kept, "disk", filler)
    tokens.write_text("kept-token-0002 infer\n")  # the first line revoked
    with serving(_models(folder, directory), "--auth-tokens", str(tokens)) as running:
        kept = client(running, api_key="kept-token-0002")
        assert _complete(kept, "disk", mine)[1] >= 32  # its own blocks, from disk
        assert _complete(kept, "disk", secret)[1] == 0  # never the revoked token's
