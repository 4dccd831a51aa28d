"""The inference gateway's endpoint picker reads plugserve as we ship it to: its extraction rules
applied to the engine profile in deploy/k8s/overlays/inference-gateway/endpoint-picker.yaml,
over the /metrics of a real server under generation load.

The picker's rules (the llm-d router v0.9.0, ``pkg/epp/framework/plugins/datalayer``: the
metrics data source and ``extractor/metrics/spec.go``, ``extractor.go``; the same as the
Gateway API inference extension's own picker up to v1.5), ported here line for line:

- it GETs ``scheme://pod:port/path`` with no Accept header and parses the Prometheus text
  format with legacy (not UTF-8) name validation;
- a spec is ``name{label=value,...}`` (values quoted or not), the name a legacy metric name;
- of the family ``name``, the series whose labels include the spec's are candidates, and it
  takes the one with the latest timestamp, the first on a tie (an exposition has none): it
  never sums, so a second matching series is silently ignored;
- queued and running requests are read as ``int(value)``, the KV-cache use as the value (a
  fraction, as vLLM's ``kv_cache_usage_perc``), the cache info's block size and blocks from
  its labels (named by ``cacheBlockSizeLabelName`` / ``cacheNumBlocksLabelName``), each as an
  integer.

The server serves two generative models (the tiny test decoder twice, two sequences each, block
sizes 16 and 32), eight streaming completions at once: each spec must match exactly one series
(the per-model gauges match two here, which is why the profile does not name them), waiting > 0
while saturated, the KV ratio in [0, 1], and all back to 0 when the load is done.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from serving import RunningServer, wait_for

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "deploy" / "k8s" / "overlays" / "inference-gateway" / "endpoint-picker.yaml"
DEPLOYMENT = ROOT / "deploy" / "k8s" / "base" / "deployment.yaml"

# spec.go
_SPEC = re.compile(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$")
_PAIR = re.compile(r'^\s*(\S+?)\s*=\s*"([^"]*)"\s*$')
_QUOTES = re.compile(r'(\w+)\s*=\s*([^",}\s]+)')
# prometheus/common model.LegacyValidation
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def parse_spec(text: str) -> tuple[str, dict[str, str]]:
    """``parseStringToSpec``: a metric spec as the picker reads it."""
    quoted = _QUOTES.sub(r'\1="\2"', text)
    match = _SPEC.match(quoted)
    assert match and _METRIC_NAME.fullmatch(match.group(1)), f"invalid spec {text!r}"
    labels = {}
    block = (match.group(2) or "").strip()
    for pair in block.split(",") if block else []:
        found = _PAIR.match(pair)
        assert found and _LABEL_NAME.fullmatch(found.group(1)), f"invalid label in {text!r}"
        labels[found.group(1)] = found.group(2)
    return match.group(1), labels


def candidates(families: dict, spec: str) -> list:
    """The series ``getLatestMetric`` chooses among (it takes the first of them)."""
    name, labels = parse_spec(spec)
    family = families.get(name)
    assert family is not None, f"metric family {name!r} not found"
    return [
        s
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def engine() -> dict:
    """The engine profile the shipped picker configuration gives plugserve's pods."""
    config = yaml.safe_load(PROFILE.read_text())
    [extractor] = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    [profile] = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    return profile


def scrape(url: str) -> dict:
    """``url`` as the picker fetches and parses it: a plain GET, the text format."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(urllib.request.Request(url), timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    for name in re.findall(r"^# TYPE (\S+) ", text, re.M):
        assert _METRIC_NAME.fullmatch(name), f"{name} is not a legacy metric name"
    return {f.name: f for f in text_string_to_metric_families(text)}


def read(families: dict, profile: dict) -> dict:
    """What the picker stores for the pod, each spec matching exactly one series."""
    out = {}
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        found = candidates(families, profile[key])
        assert len(found) == 1, f"{profile[key]}: {len(found)} series; the picker reads one"
        out[key] = found[0]
    info = out.pop("cacheInfoSpec").labels
    return {
        "waiting": int(out["queuedRequestsSpec"].value),
        "running": int(out["runningRequestsSpec"].value),
        "kv": out["kvUsageSpec"].value,
        "block_size": int(info[profile["cacheBlockSizeLabelName"]]),
        "blocks": int(info[profile["cacheNumBlocksLabelName"]]),
    }


def test_the_profile_names_metrics_the_picker_can_parse():
    profile = engine()
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        name, labels = parse_spec(profile[key])
        assert name.startswith("plugserve_") and not labels, "one unlabelled series per pod"
    config = yaml.safe_load(PROFILE.read_text())
    [source] = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    deployment = yaml.safe_load(DEPLOYMENT.read_text())
    [server] = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert source["parameters"]["port"] == ports["metrics"]
    assert source["parameters"]["path"] == "/metrics"


def _completion(port: int, model: str, tokens: int, errors: list) -> None:
    body = {
        "model": model,
        "prompt": "The gateway reads",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        data = response.read().decode()
        conn.close()
        if response.status != 200 or "data: [DONE]" not in data:
            errors.append((response.status, data[:300]))
    except Exception as exc:  # reported by the test
        errors.append(repr(exc))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = pytest.importorskip("llm", reason="tests/support/llm.py makes the generative models")
    try:
        folder = llm.export("tiny-llama", "genai-fp32")
    except llm.Unavailable as exc:
        pytest.skip(f"the tiny generative test model is not prepared: {exc}")
    root = tmp_path_factory.mktemp("gateway")
    for name, block in (("llm-a", 16), ("llm-b", 32)):
        (root / name).mkdir()
        (root / name / "1").symlink_to(folder, target_is_directory=True)
        config = {"MAX_NUM_SEQS": "2", "BLOCK_SIZE": str(block), "MAX_MODEL_LEN": "512"}
        (root / name / "config.json").write_text(json.dumps({"device": "ORT", "config": config}))
    args = ["--model-repository", str(root), "--grpc-port", "0", "--http-port", "0"]
    with RunningServer(*args, "--metrics-port", "0") as live:
        yield live


def test_the_picker_reads_one_series_per_metric_under_generation_load(server):
    profile = engine()
    idle = read(scrape(server.metrics_url), profile)
    assert (idle["waiting"], idle["running"], idle["kv"]) == (0, 0, 0.0), idle
    # the cache info: block sizes 16 and 32 counted in 16s, each model slots x context / size
    loaded = re.findall(
        r"generative model .* on ORT: .*?context (\d+), (\d+) sequences", server.log
    )
    assert loaded == [("512", "2")] * 2, server.log  # each: 2 slots of 512 tokens
    assert idle["block_size"] == 16
    assert idle["blocks"] == 2 * 512 // 16 + (2 * 512 // 32) * 2 == 128

    # 16 completions of 480 tokens, 8 per model: 4 waves of 2 per model; the scrapes start
    # before the load and go on until it ends, so a slow scrape cannot miss it
    errors: list = []
    threads = [
        threading.Thread(target=_completion, args=(server.http_port, model, 480, errors))
        for model in ("llm-a", "llm-b") * 8
    ]
    reads: list = []

    def watch() -> None:
        while any(t.is_alive() for t in threads) or not reads:
            families = scrape(server.metrics_url)
            reads.append((read(families, profile), families))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    for thread in threads:
        thread.start()
    watcher.start()
    for thread in threads:
        thread.join(timeout=300)
    watcher.join(timeout=60)
    for seen, _families in reads:
        assert 0.0 <= seen["kv"] <= 1.0, seen
    saturated = [(s, f) for s, f in reads if s["waiting"] > 0 and s["running"] > 0]
    assert not errors, errors
    assert saturated, f"no scrape of {len(reads)} showed waiting and running requests"
    seen, families = saturated[0]
    # 4 sequences run (2 per model) and the other requests wait; the KV ratio is the share of
    # the four slots held, by bytes
    assert 1 <= seen["running"] <= 4 and 1 <= seen["waiting"] <= 14, seen
    assert 0.0 < seen["kv"] <= 1.0, seen
    # what the profile does not name: the per-model gauge has a series per model, and the
    # picker would read the first model's alone
    ambiguous = families["plugserve_generate_requests_waiting"].samples
    assert sorted(s.labels["model"] for s in ambiguous) == ["llm-a", "llm-b"]

    assert wait_for(lambda: read(scrape(server.metrics_url), profile)["running"] == 0, 60)
    done = read(scrape(server.metrics_url), profile)
    assert (done["waiting"], done["running"], done["kv"]) == (0, 0, 0.0), done
