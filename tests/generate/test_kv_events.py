"""vLLM's KV events and metric names, read from a real server as vLLM's own consumers read them
(issue 61, items 3 and 4).

Events: the server runs with vLLM's ``--kv-events-config`` JSON (a PUB endpoint, a replay
endpoint, a topic) and two cache slots; the test subscribes with pyzmq and decodes every batch
with the msgspec types of vLLM's example subscriber (``examples/features/kv_events/
kv_events_subscriber.py`` of vLLM 0.33.0's sdist on PyPI, ``tests/support/vllm_sdist.py``,
which .ci/run fetches; loaded as a module, unchanged; its ``process_event`` prints each
batch). What runs of it unchanged: its module code (the msgspec structs ``KVEventBatch``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) and ``process_event``; its ``main()``
is not run (an endless loop on fixed localhost ports), the test's own sockets do what it does
(SUB on the topic, an 8-byte replay request). When the file imports vLLM itself for the
``ExternalBlockHash`` alias, that one module is stood in for (vLLM's definition, ``bytes |
int``) before loading; a file needing more of vLLM skips, saying so. Checked: a sleep is
``AllBlocksCleared``; a prompt's ``BlockStored`` token ids are its tokens in blocks of
``block_size``, chained by parent hash, medium "GPU" (the engine's own cache); a third prompt
against two slots evicts the first's blocks (``BlockRemoved``, exactly its hashes); a replay
from 0 returns every batch, byte for byte what the PUB socket sent. The publisher's bound: a
full queue drops its oldest batches, counts them, and their ``seq`` never comes.

Metrics: the ``vllm:*`` families (``server/plane/vllm_metrics.py``) move with the requests the
official openai client sends, and promtool reads the exposition (its only complaints are the
colons vLLM's names carry by design).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request

import pytest
from conftest import exported

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
zmq = pytest.importorskip("zmq", reason="pip install pyzmq (the generate extra)")
msgspec = pytest.importorskip("msgspec", reason="pip install msgspec (the generate extra)")

from openai_serving import client, serving  # noqa: E402

MODEL = "tiny"
BLOCK = 16
SUBSCRIBER = "examples/features/kv_events/kv_events_subscriber.py"
#: three prompts of token ids, two whole blocks each, sharing no block
PROMPTS = [list(range(base, base + 2 * BLOCK + 8)) for base in (100, 200, 300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _subscriber_module():
    """vLLM's example subscriber as a module (the test skips when its sdist could not be
    fetched from PyPI)."""
    import vllm_sdist

    try:
        path = vllm_sdist.fetch() / SUBSCRIBER
    except Exception as exc:  # no registry here: the reason, as the other fetched files skip
        pytest.skip(f"vLLM {vllm_sdist.VERSION}'s sdist could not be fetched from PyPI: {exc}")
    if "import vllm" in path.read_text() or "from vllm" in path.read_text():
        # its only vLLM import is the block hash alias; vLLM's own definition stands in
        for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = bytes | int
    spec = importlib.util.spec_from_file_location("kv_events_subscriber", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # more of vLLM than the alias: not runnable without vLLM
        if "vllm" not in str(exc):
            raise
        pytest.skip(f"{SUBSCRIBER} needs vLLM itself: {exc}")
    return module


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return _free_port(), _free_port()


@pytest.fixture(scope="module")
def server(ports):
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports[0]}",
        "replay_endpoint": f"tcp://*:{ports[1]}",
        "topic": "kv-events",
        "buffer_steps": 1000,
    }
    folder = exported("tiny-llama", "genai-fp32")
    keys = {"MAX_NUM_SEQS": "2", "BLOCK_SIZE": str(BLOCK)}
    with serving(
        {MODEL: (folder, "NUMPY", keys)}, "--kv-events-config", json.dumps(config)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    return client(server, timeout=120)


def _scrape(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        return response.read().decode()


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _vllm(samples: dict, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    found = [
        v for (n, lab), v in samples.items() if n == name and want.items() <= dict(lab).items()
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_vllm_metric_names_move_under_load(server, api):
    before = _samples(_scrape(server))
    prompt = PROMPTS[0]
    for _ in range(2):  # the second finds the first's two blocks in the prefix cache
        api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    # four long answers at once against two slots: two run, two wait
    streams = [
        threading.Thread(
            target=api.completions.create, daemon=True,
            kwargs={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 470, "temperature": 0,
                    "extra_body": {"ignore_eos": True}},
        )
        for _ in range(4)
    ]  # fmt: skip
    for thread in streams:
        thread.start()
    running = waiting = usage = 0.0
    while any(t.is_alive() for t in streams):
        during = _samples(_scrape(server))
        running = max(running, _vllm(during, "vllm:num_requests_running"))
        waiting = max(waiting, _vllm(during, "vllm:num_requests_waiting"))
        usage = max(usage, _vllm(during, "vllm:kv_cache_usage_perc"))
    for thread in streams:
        thread.join()
    after = _samples(_scrape(server))

    def moved(name: str, **labels: str) -> float:
        return _vllm(after, name, **labels) - _vllm(before, name, **labels)

    assert running == 2 and waiting >= 1 and usage == 1
    assert _vllm(after, "vllm:num_requests_running") == 0
    assert _vllm(after, "vllm:num_requests_waiting") == 0
    assert _vllm(after, "vllm:kv_cache_usage_perc") == 0
    assert moved("vllm:prompt_tokens_total") == 6 * len(prompt)
    assert moved("vllm:prefix_cache_queries_total") == 6 * len(prompt)
    # the second prompt's two blocks, and at least the two long ones that waited for a slot
    assert moved("vllm:prefix_cache_hits_total") >= 2 * BLOCK + 2 * 2 * BLOCK
    assert moved("vllm:generation_tokens_total") == 2 * 4 + 4 * 470
    assert moved("vllm:request_success_total", finished_reason="length") == 6
    assert moved("vllm:time_to_first_token_seconds_count") == 6
    assert moved("vllm:e2e_request_latency_seconds_count") == 6
    assert moved("vllm:inter_token_latency_seconds_count") == 2 * 3 + 4 * 469
    # vLLM's bucket bounds, not ours
    assert _vllm(after, "vllm:time_to_first_token_seconds_bucket", le="2560.0") == _vllm(
        after, "vllm:time_to_first_token_seconds_count"
    )
    assert _vllm(after, "vllm:cache_config_info", block_size=str(BLOCK)) == 1


def test_promtool_reads_the_vllm_families(server, api):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); .ci/run installs it")
    api.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2, temperature=0)
    text = _scrape(server)
    assert "vllm:e2e_request_latency_seconds_bucket" in text
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    complaints = (result.stdout + result.stderr).strip().splitlines()
    # promtool's linter asks for names without ':' (kept for recording rules); vLLM's have one
    others = [c for c in complaints if not c.endswith("metric names should not contain ':'")]
    assert result.returncode in (0, 3) and not others, result.stdout + result.stderr
    assert all(c.startswith("vllm:") for c in complaints), complaints


class Events:
    """A SUB socket on the server's events: every message, raw."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        self.messages: list[tuple[int, bytes]] = []

    def read(self, until, timeout: float = 60) -> None:
        """Messages until ``until(decoded batches)`` holds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == b"kv-events" and len(seq) == 8
                self.messages.append((int.from_bytes(seq, "big"), payload))
            elif until():
                return
        raise AssertionError(f"events did not come: {len(self.messages)} messages")

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


def _replay(port: int, start: int) -> list[tuple[int, bytes]]:
    """Every kept batch from ``start``, then the end marker: the ROUTER's whole answer, read
    on a DEALER socket (the example subscriber's REQ socket reads the first message of it:
    :func:`_replay_first`)."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while dealer.poll(10_000):
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                return got
            got.append((int.from_bytes(seq, "big"), payload))
        raise AssertionError("the replay did not end")
    finally:
        dealer.close(linger=0)
        context.term()


def _replay_first(port: int, start: int) -> tuple[int, bytes]:
    """What the example subscriber's replay reads: one reply to its REQ request."""
    context = zmq.Context()
    req = context.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{port}")
    try:
        req.send(start.to_bytes(8, "big"))
        assert req.poll(10_000), "no replay"
        seq, payload = req.recv_multipart()
        return int.from_bytes(seq, "big"), payload
    finally:
        req.close(linger=0)
        context.term()


def test_vllms_subscriber_decodes_stored_removed_cleared_and_replayed(server, api, ports, capsys):
    vllm = _subscriber_module()
    decode = msgspec.msgpack.Decoder(type=vllm.KVEventBatch).decode  # as its main() decodes
    events = Events(ports[0])
    time.sleep(0.5)  # a SUB socket's subscription reaches the PUB socket after its connect
    seen = len(_replay(ports[1], 0))  # what the earlier tests' requests announced

    def batches(since: int = 0) -> list:
        """The batches of this test's requests (from the ``since``-th message it read)."""
        return [decode(payload) for seq, payload in events.messages[since:] if seq >= seen]

    def stored(prompt: list[int]) -> list:
        """The BlockStored events of the blocks ``prompt`` begins with, in order."""
        found = [
            e for b in batches() for e in b.events
            if isinstance(e, vllm.BlockStored) and e.token_ids[:BLOCK] in _blocks(prompt)
        ]  # fmt: skip
        return found

    try:
        # a sleep drops the whole cache (and leaves both slots empty for what follows)
        for route in ("/sleep?level=1", "/wake_up"):
            post = urllib.request.Request(server.http_url + route, method="POST")
            urllib.request.urlopen(post, timeout=120).read()
        events.read(
            lambda: any(isinstance(e, vllm.AllBlocksCleared) for b in batches() for e in b.events)
        )
        fresh = [list(range(base, base + 2 * BLOCK + 8)) for base in (1000, 1100, 1200)]
        for prompt in fresh[:2]:
            api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        events.read(
            lambda: all(_tokens(stored(p))[: 2 * BLOCK] == p[: 2 * BLOCK] for p in fresh[:2])
        )
        first = stored(fresh[0])
        assert first[0].parent_block_hash is None
        assert all(e.block_size == BLOCK and e.medium == "GPU" for e in first)
        assert _chained(first)
        # two slots, both holding two blocks: the third prompt takes the least recently freed
        # one, the first prompt's, and its blocks leave the cache
        mark = len(events.messages)
        api.completions.create(model=MODEL, prompt=fresh[2], max_tokens=4, temperature=0)
        first_hashes = {h for e in first for h in e.block_hashes}

        def removed() -> set:
            return {
                h for b in batches(mark) for e in b.events if isinstance(e, vllm.BlockRemoved)
                for h in e.block_hashes
            }  # fmt: skip

        events.read(lambda: removed() >= first_hashes and stored(fresh[2]))
        assert removed() == first_hashes
        second_hashes = {h for e in stored(fresh[1]) for h in e.block_hashes}
        assert not removed() & second_hashes
        for batch in batches():
            vllm.process_event(batch)  # the example's own handler, unchanged
        assert "BlockStored(" in capsys.readouterr().out
    finally:
        events.close()
    # a replay from 0: every batch, byte for byte what the PUB socket sent
    replayed = _replay(ports[1], 0)
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    sent = dict(events.messages)
    assert sent and all(replayed[seq][1] == payload for seq, payload in sent.items())
    last = max(sent)
    assert _replay_first(ports[1], last) == (last, sent[last])


def _blocks(prompt: list[int]) -> list[list[int]]:
    return [prompt[i : i + BLOCK] for i in range(0, len(prompt) - BLOCK + 1, BLOCK)]


def _tokens(stored: list) -> list[int]:
    return [t for e in stored for t in e.token_ids]


def _chained(stored: list) -> bool:
    """Each event's parent is the hash of the block before its first."""
    hashes = [None, *(h for e in stored for h in e.block_hashes)]
    at = 0
    for e in stored:
        if e.parent_block_hash != hashes[at] or len(e.token_ids) != BLOCK * len(e.block_hashes):
            return False
        at += len(e.block_hashes)
    return True


def test_a_full_queue_drops_its_oldest_batches_and_counts_them(tmp_path):
    """The publisher never makes its caller wait: past ``max_queue_size`` batches waiting for
    its thread, the oldest is dropped and counted, and its ``seq`` is never sent (a subscriber
    sees the gap; a replay cannot fill it)."""
    from plugserve.server.apps.generate.engine.kvevents import BlockEvents, Config, Publisher

    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    config = Config.parse(
        json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
                    "max_queue_size": 1, "buffer_steps": 100_000})
    )  # fmt: skip
    publisher = Publisher(config)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    time.sleep(0.5)
    events = BlockEvents(publisher, BLOCK, "CPU")
    total = 20_000
    try:
        for i in range(total):  # faster than the thread sends: the queue overflows
            events.stored([i], None, list(range(BLOCK)))
            events.flush()
        publisher.close()
        got = []
        while sub.poll(1000):
            _topic, seq, _payload = sub.recv_multipart()
            got.append(int.from_bytes(seq, "big"))
    finally:
        sub.close(linger=0)
        context.term()
    published, dropped = publisher.counts()
    assert dropped > 0 and published + dropped == total
    assert got == sorted(got) and len(got) == published and got[-1] == total - 1
    assert len(set(range(total)) - set(got)) == dropped  # each drop a gap


def test_the_host_tier_announces_its_blocks_as_cpu():
    """With the host tier (``KV_OFFLOADING_SIZE``), blocks evicted from a slot are kept in host
    memory and announced as vLLM's offloading announces them: ``BlockStored`` with medium
    ``"CPU"`` (before the slot's ``BlockRemoved`` ``"GPU"``), so a router still counts the
    prefix as this replica's; decoded with vLLM's example subscriber's types."""
    vllm = _subscriber_module()
    decode = msgspec.msgpack.Decoder(type=vllm.KVEventBatch).decode
    port = _free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv-events"}
    keys = {"MAX_NUM_SEQS": "2", "BLOCK_SIZE": str(BLOCK), "KV_OFFLOADING_SIZE": "0.01"}
    folder = exported("tiny-llama", "genai-fp32")
    with serving(
        {MODEL: (folder, "NUMPY", keys)}, "--kv-events-config", json.dumps(config)
    ) as running:
        api = client(running, timeout=120)
        events = Events(port)
        time.sleep(0.5)  # the subscription reaches the publisher

        def seen(kind: type, medium: str) -> list[tuple[int, int]]:
            return _seen(events, decode, kind, medium)

        try:
            for prompt in PROMPTS:  # two slots: the third evicts the first's blocks
                api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            events.read(lambda: seen(vllm.BlockStored, "CPU") and seen(vllm.BlockRemoved, "GPU"))
            kept = dict((h, seq) for seq, h in seen(vllm.BlockStored, "CPU"))
            gone = dict((h, seq) for seq, h in seen(vllm.BlockRemoved, "GPU"))
            first = {h for seq, h in seen(vllm.BlockStored, "GPU")[:2]}
            assert first <= set(kept) and first <= set(gone), (first, kept, gone)
            assert all(kept[h] <= gone[h] for h in first)
        finally:
            events.close()


def test_the_disk_tier_announces_its_blocks_as_disk(tmp_path):
    """With the disk tier under a host tier of two blocks (``KV_DISK_PATH``), the blocks the
    host tier drops are written to files and announced ``BlockStored`` with medium ``"DISK"``
    (LMCache's and vLLM's name), after their ``BlockRemoved`` ``"CPU"``: the first prompt's
    blocks, evicted from its slot, then from host memory by the next evictions."""
    vllm = _subscriber_module()
    decode = msgspec.msgpack.Decoder(type=vllm.KVEventBatch).decode
    port = _free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv-events"}
    two_blocks = 2 * (2 * 2 * 2 * BLOCK * 16 * 4) / 2**30  # tiny-llama's block: 8 KiB
    keys = {"MAX_NUM_SEQS": "2", "BLOCK_SIZE": str(BLOCK), "KV_OFFLOADING_SIZE": repr(two_blocks)}
    keys |= {"KV_DISK_PATH": str(tmp_path), "KV_DISK_SIZE": "0.01"}
    folder = exported("tiny-llama", "genai-fp32")
    with serving(
        {MODEL: (folder, "NUMPY", keys)}, "--kv-events-config", json.dumps(config)
    ) as running:
        api = client(running, timeout=120)
        events = Events(port)
        time.sleep(0.5)  # the subscription reaches the publisher

        def seen(kind: type, medium: str) -> list[tuple[int, int]]:
            return _seen(events, decode, kind, medium)

        try:
            for prompt in [*PROMPTS, list(range(400, 440))]:  # the fourth pushes the first out
                api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            first = {h for seq, h in seen(vllm.BlockStored, "GPU")[:2]}
            events.read(lambda: first <= {h for _s, h in seen(vllm.BlockStored, "DISK")})
            on_disk = dict((h, seq) for seq, h in seen(vllm.BlockStored, "DISK"))
            left_host = dict((h, seq) for seq, h in seen(vllm.BlockRemoved, "CPU"))
            assert first <= set(left_host), (first, left_host)
            assert all(left_host[h] <= on_disk[h] for h in first)
            assert len(list(tmp_path.rglob("*.kvb"))) >= 2
        finally:
            events.close()


def _seen(events, decode, kind: type, medium: str) -> list[tuple[int, int]]:
    """(seq, hash) of every ``kind`` event in ``medium`` that ``events`` received."""
    return [
        (seq, h) for seq, payload in events.messages for e in decode(payload).events
        if isinstance(e, kind) and e.medium == medium for h in e.block_hashes
    ]  # fmt: skip
