"""deploy/prometheus and deploy/grafana against promtool, a live Prometheus and a live server.

promtool checks the shipped config and rules and runs the rule unit tests. A real Prometheus
(Debian's ``prometheus``) on 127.0.0.1 scrapes a real plugserve with a config derived from
deploy/prometheus/prometheus.yml (and loads deploy/prometheus/rules.yml); the request counts it
reports per device must equal the inferences sent. Every PromQL expression of the dashboard and
the rules must parse (Prometheus evaluates it) and query only names the server exports (or that
a recording rule defines).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from models import mlp
from prometheus_client.parser import text_string_to_metric_families
from serving import RunningServer, examples_repository, wait_for

from plugserve.client import Client

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "plugserve.json"

# what the live test sends: successes per (device, model), and invalid requests to "add"
SENT = {("NUMPY", "add"): 11, ("BATCH:NUMPY(8)", "mlp"): 5, ("NUMPY", "perf_mlp"): 2}
INVALID = 3


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian package 'prometheus'); .ci/run installs it")
    return path


def run(command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


# --- promtool on what we ship -----------------------------------------------------------------


def test_promtool_check_config():
    result = run([tool("promtool"), "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_promtool_check_rules():
    result = run([tool("promtool"), "check", "rules", str(PROMETHEUS_DIR / "rules.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules():
    result = run([tool("promtool"), "test", "rules", "rules_test.yml"], cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_unit_test():
    rules = (PROMETHEUS_DIR / "rules.yml").read_text()
    tests = (PROMETHEUS_DIR / "rules_test.yml").read_text()
    alerts = set(re.findall(r"^\s*- alert: (\w+)", rules, re.M))
    tested = set(re.findall(r"^\s*alertname: (\w+)", tests, re.M))
    assert alerts == tested
    assert {
        "PlugserveTargetDown",
        "PlugserveHighErrorRatio",
        "PlugserveHighP99Latency",
        "PlugserveQueueSaturated",
        "PlugserveDeviceUnavailable",
        "PlugserveNoLoadedNetworks",
    } <= alerts


# --- PromQL: the metric names an expression selects --------------------------------------------

_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """Names of the vector selectors in a PromQL expression (Grafana variables allowed)."""
    text = re.sub(r"\$__\w+", "1m", expr)  # $__rate_interval, $__interval, ...
    text = re.sub(r"\$\{?\w+\}?", "x", text)  # dashboard variables
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', text)  # strings
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if not call and name not in _KEYWORDS:
            names.add(name)
    return names


def test_metric_names_parser():
    assert metric_names(
        'histogram_quantile(0.99, sum by (device, le) (rate(a_bucket{x=~"$i", y="b c"}'
        "[$__rate_interval]))) / on (device) group_left () b:rec offset 5m > bool 1e3"
    ) == {"a_bucket", "b:rec"}
    assert metric_names("sum without (le) (x) and up == 0 unless absent(y)") == {"x", "up", "y"}


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the dashboard, template variables included."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            assert inner, query
            exprs.append((f"variable {variable['name']}", inner.group(1)))
    return exprs


def test_dashboard_has_the_panels():
    titles = {title for title, _ in dashboard_exprs()}
    for wanted in ("Throughput", "p50 / p90 / p99", "Queue depth", "Busy streams", "Errors"):
        assert any(wanted in t for t in titles), wanted
    exprs = " ".join(e for _, e in dashboard_exprs())
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, " in exprs
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert (provisioning / "dashboards" / "plugserve.yml").is_file()
    assert "http://prometheus:9090" in (provisioning / "datasources" / "prometheus.yml").read_text()


# --- a live Prometheus scraping a live plugserve ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_config(metrics_port: int) -> str:
    """deploy/prometheus/prometheus.yml, pointed at the test server, scraping every second."""
    text = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    replacements = [
        ('"plugserve:8002"', f'"127.0.0.1:{metrics_port}"'),
        ("scrape_interval: 15s", "scrape_interval: 1s"),
        ("evaluation_interval: 15s", "evaluation_interval: 1s"),
        ("- rules.yml", f"- {PROMETHEUS_DIR / 'rules.yml'}"),
    ]
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:  # 400 bad_data: the body says why
            return json.load(error)

    def query(self, expr: str) -> list[dict]:
        answer = self.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus_bin = tool("prometheus")
    tool("promtool")
    tmp = tmp_path_factory.mktemp("prometheus")
    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    with RunningServer("--model-repository", str(repo)) as server:
        config = tmp / "prometheus.yml"
        config.write_text(scrape_config(server.metrics_port))
        checked = run([shutil.which("promtool"), "check", "config", str(config)])
        assert checked.returncode == 0, checked.stdout + checked.stderr
        port = free_port()
        log = (tmp / "prometheus.log").open("w")
        process = subprocess.Popen(
            [
                prometheus_bin,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        prometheus = Prometheus(f"http://127.0.0.1:{port}")

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=5) as r:
                    return r.status == 200
            except OSError:
                return process.poll() is not None  # died: stop waiting

        try:
            assert wait_for(ready, timeout=60, interval=0.2) and process.poll() is None, (
                tmp / "prometheus.log"
            ).read_text()
            yield server, prometheus
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
            log.close()


@pytest.fixture(scope="module")
def traffic(stack):
    server, _ = stack
    rng = np.random.default_rng(1)
    with Client(server.target, timeout=60) as client:
        for _ in range(SENT["NUMPY", "add"]):
            a, b = rng.normal(size=4).astype(np.float32), rng.normal(size=4).astype(np.float32)
            np.testing.assert_array_equal(client.infer("add", {"a": a, "b": b})["sum"], a + b)
        for _ in range(SENT["BATCH:NUMPY(8)", "mlp"]):
            x = rng.normal(size=(2, 16)).astype(np.float32)
            assert client.infer("mlp", {"input": x})["probabilities"].shape == (2, 4)
        # a network with per-layer counters, so that plugserve_layer_seconds_total is exported
        client.load("perf_mlp", mlp().SerializeToString(), config={"PERF_COUNT": "YES"})
        for _ in range(SENT["NUMPY", "perf_mlp"]):
            client.infer("perf_mlp", {"x": np.ones((1, 32), np.float32)})
        for _ in range(INVALID):
            with pytest.raises(Exception, match="INVALID_ARGUMENT"):
                client.infer("add", {"b": np.zeros(2, np.float32)})
    return SENT


def wait_until(prometheus: Prometheus, expr: str, predicate, timeout: float = 90) -> list[dict]:
    """Query ``expr`` until ``predicate(result)`` holds or ``timeout`` passes; the last result."""
    result: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = prometheus.query(expr)
        if predicate(result):
            break
        time.sleep(0.5)
    return result


def test_prometheus_scrapes_the_server(stack):
    server, prometheus = stack
    result = wait_until(prometheus, 'up{job="plugserve"}', lambda r: r and r[0]["value"][1] == "1")
    assert [(r["metric"]["instance"], r["value"][1]) for r in result] == [
        (f"127.0.0.1:{server.metrics_port}", "1")
    ]
    targets = prometheus.get("/api/v1/targets")["data"]["activeTargets"]
    assert [t["health"] for t in targets] == ["up"]


def test_request_counts_per_device_equal_what_was_sent(stack, traffic):
    _, prometheus = stack
    per_device: dict[str, int] = {}
    for (device, _), count in traffic.items():
        per_device[device] = per_device.get(device, 0) + count
    expr = 'sum by (device) (plugserve_inference_requests_total{status="success"})'

    def counts(result: list[dict]) -> dict[str, float]:
        return {r["metric"]["device"]: float(r["value"][1]) for r in result}

    result = wait_until(prometheus, expr, lambda r: counts(r) == per_device)
    assert counts(result) == per_device
    # and per device, model and status, straight from the scraped series
    result = prometheus.query("plugserve_inference_requests_total")
    series = {
        (r["metric"]["device"], r["metric"]["model"], r["metric"]["status"]): float(r["value"][1])
        for r in result
    }
    expected = {(d, m, "success"): n for (d, m), n in traffic.items()}
    expected["NUMPY", "add", "invalid"] = INVALID
    assert {key: n for key, n in series.items() if n} == expected
    # a loaded network's success counter exists from its load on, 0 until it serves
    # (so rate() and absent() work before its first request)
    assert series["NUMPY", "cnn", "success"] == series["NUMPY", "echo", "success"] == 0


def test_rules_load_and_evaluate_on_live_data(stack, traffic):
    _, prometheus = stack
    groups = prometheus.get("/api/v1/rules")["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r["type"] for r in rules} == {"recording", "alerting"}
    assert all(r["health"] != "err" for r in rules), [r for r in rules if r["health"] == "err"]
    # the request rate of each (device, model) that served requests is recorded (as 0 when all
    # of its requests came before the first scrape that saw the series)
    result = wait_until(
        prometheus,
        "device_model:plugserve_inference_requests:rate5m >= 0",
        lambda r: {(x["metric"]["device"], x["metric"]["model"]) for x in r} >= set(traffic),
    )
    assert {(x["metric"]["device"], x["metric"]["model"]) for x in result} >= set(traffic)
    # nothing is wrong with a healthy server
    firing = [a for a in prometheus.get("/api/v1/alerts")["data"]["alerts"]]
    assert not [a for a in firing if a["state"] == "firing"], firing


def exported_names(server) -> set[str]:
    """Every sample name on the live /metrics (histograms give _bucket, _sum, _count)."""
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        text = response.read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_queried_metric_is_exported(stack, traffic):
    server, prometheus = stack
    exported = exported_names(server)
    assert {
        "plugserve_inference_requests_total",
        "plugserve_compute_seconds_bucket",
        "plugserve_queue_wait_seconds_bucket",
        "plugserve_queue_depth",
        "plugserve_busy_streams",
        "plugserve_streams",
        "plugserve_loaded_networks",
        "plugserve_build_info",
    } <= exported
    groups = prometheus.get("/api/v1/rules")["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    recorded = {r["name"] for r in rules if r["type"] == "recording"}
    exprs = [(f"rule {r['name']}", r["query"]) for r in rules] + dashboard_exprs()
    queried: set[str] = set()
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, (where, expr)
        unknown = names - exported - recorded - {"up"}
        assert not unknown, f"{where} queries {sorted(unknown)}, not exported: {expr}"
        queried |= names
    assert "plugserve_compute_seconds_bucket" in queried


def test_dashboard_queries_evaluate(stack, traffic):
    _, prometheus = stack
    wait_until(  # two scrapes after the traffic, so that rate() has something to say
        prometheus,
        "count_over_time(plugserve_build_info[1m])",
        lambda r: r and float(r[0]["value"][1]) >= 3,
    )
    must_have_data = (
        "Throughput", "Compute latency", "Queue wait", "Queue depth", "Busy streams", "Errors",
        "Loaded networks", "Layer time", "Build", "variable",
    )  # fmt: skip
    for title, expr in dashboard_exprs():
        concrete = expr.replace("$__rate_interval", "1m")
        concrete = re.sub(r"\$\{?(instance|device)\}?", ".*", concrete)
        assert "$" not in concrete, concrete
        result = prometheus.query(concrete)  # asserts Prometheus parsed and evaluated it
        if title.startswith(must_have_data):
            assert result, (title, concrete)
