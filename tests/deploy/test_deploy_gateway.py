"""The inference gateway overlay, the KServe LLMInferenceService and the KubeRay RayService:
their parts fit one another, the endpoint picker's configuration is one the picker accepts, and
the commands the manifests give plugserve run here.

- The overlay (deploy/k8s/overlays/inference-gateway): the InferencePool selects the server
  pods on their REST port and names the picker's Service and port; the HTTPRoute sends to the
  pool; the picker's Deployment reads the generated ConfigMap at the path its --config-file
  names, watches the pool by name with a Role that allows it; the pods carry the engine label
  the profile is chosen by.
- The picker's configuration (EndpointPickerConfig, the llm-d router v0.9.0) is decoded
  strictly by the picker (unknown fields refused, in the file and in each plugin's
  parameters): checked here against the fields of its Go types (``apix/config/v1alpha1``,
  and the parameters of the plugins it uses), with every pluginRef naming a plugin; KServe's
  inline copy is the same configuration.
- The LLMInferenceService's container script runs for real on the tiny generative test model
  (its /mnt/models a folder here, its ports free ones) and answers its probes' paths and an
  OpenAI completion for spec.model.name.
- The RayService sets Serve's ports (8000 HTTP, 9000 gRPC) explicitly in serveConfigV2 and
  the containers, imports plugserve's own KServe v2 servicer into Serve's gRPC proxy, mounts
  the model repository its application is given, and points GCS fault tolerance at the Redis
  the same file runs, with the password from one Secret.
"""

from __future__ import annotations

import importlib
import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_deploy_k8s import (
    K8S,
    KSERVE,
    ROOT,
    CommandServer,
    _path_env,
    container,
    flags,
    load,
    needs_kubectl,
    one,
    render,
    selects,
)

OVERLAY = K8S / "overlays" / "inference-gateway"
PICKER = OVERLAY / "endpoint-picker.yaml"
RAY = ROOT / "deploy" / "ray" / "rayservice.yaml"

# --------------------------------------------------------------------------- the overlay


@needs_kubectl
def test_pool_route_and_picker_fit_together():
    docs = render(OVERLAY)
    server = one(docs, "Deployment", "plugserve")
    pod = server["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in container(server)["ports"]}
    pool = one(docs, "InferencePool")
    spec = pool["spec"]
    assert selects(spec["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert [p["number"] for p in spec["targetPorts"]] == [ports["http"]], "the OpenAI routes"
    assert spec["endpointPickerRef"]["failureMode"] == "FailClose"

    picker_service = one(docs, "Service", spec["endpointPickerRef"]["name"])
    [ext_proc] = [p for p in picker_service["spec"]["ports"] if p["port"] == 9002]
    assert spec["endpointPickerRef"]["port"]["number"] == ext_proc["port"]
    picker = one(docs, "Deployment", "plugserve-epp")
    epp = container(picker, "epp")
    assert selects(
        picker_service["spec"]["selector"], picker["spec"]["template"]["metadata"]["labels"]
    )
    assert ext_proc["targetPort"] in {p["name"] for p in epp["ports"]}
    args = flags(epp["args"])
    assert args["--pool-name"] == pool["metadata"]["name"]
    assert args["--pool-group"] == pool["apiVersion"].split("/")[0]
    assert args["--grpc-port"] == "9002"
    assert epp["image"] == "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.9.0"
    for probe in ("livenessProbe", "readinessProbe"):
        assert epp[probe]["grpc"]["port"] == int(args["--grpc-health-port"])

    # its configuration: the generated ConfigMap, mounted where --config-file points
    config = Path(args["--config-file"])
    mounts = {m["mountPath"]: m["name"] for m in epp["volumeMounts"]}
    volumes = {v["name"]: v for v in picker["spec"]["template"]["spec"]["volumes"]}
    config_map = volumes[mounts[str(config.parent)]]["configMap"]["name"]
    data = one(docs, "ConfigMap", config_map)["data"]
    assert yaml.safe_load(data[config.name]) == yaml.safe_load(PICKER.read_text())

    # what it may read: the pool and the pods, through its ServiceAccount
    role = one(docs, "Role", "plugserve-epp")
    binding = one(docs, "RoleBinding", "plugserve-epp")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": picker["spec"]["template"]["spec"]["serviceAccountName"]}
    ]
    granted = {
        (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted

    # the gateway's route: the OpenAI paths to the pool
    route = one(docs, "HTTPRoute")
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "plugserve"}
    ]
    assert [m["path"]["value"] for m in rule["matches"]] == ["/v1/"]

    # the engine label picks plugserve's profile; the Deployment's selector is unchanged
    extractor = _plugin(yaml.safe_load(PICKER.read_text()), "core-metrics-extractor")
    labels = pod["metadata"]["labels"]
    key = extractor["parameters"]["engineLabelKey"]
    assert labels[key] == extractor["parameters"]["defaultEngine"] == "plugserve"
    assert labels["inference.networking.k8s.io/engine-type"] == "plugserve"
    assert (
        server["spec"]["selector"]["matchLabels"]
        == one(render(K8S), "Deployment")["spec"]["selector"]["matchLabels"]
    )
    # the scrape: plugserve's metrics port, not the pool's target port
    source = _plugin(yaml.safe_load(PICKER.read_text()), "metrics-data-source")
    assert source["parameters"]["port"] == ports["metrics"] != ports["http"]


# --------------------------------------------------------------------------- EPP config

# The fields of the llm-d router v0.9.0's configuration types (apix/config/v1alpha1), which it
# decodes strictly, and of the parameters of the plugins this configuration uses (each
# plugin's factory decodes them with a strict decoder).
_CONFIG = {
    "apiVersion": str,
    "kind": str,
    "featureGates": list,
    "plugins": [{"name": str, "type": str, "parameters": dict}],
    "schedulingProfiles": [{"name": str, "plugins": [{"pluginRef": str, "weight": float}]}],
    "dataLayer": {
        "injectDefaults": bool,
        "sources": [{"pluginRef": str, "extractors": [{"pluginRef": str}]}],
        "discovery": {"pluginRef": str},
        "peerDiscovery": {"pluginRef": str},
        "crossReplicaSyncerPluginRef": str,
        "crossReplicaSyncInterval": str,
    },
    "flowControl": dict,
    "requestHandler": {"parsers": [{"pluginRef": str}]},
    "saturationDetector": {"pluginRef": str},
    "parser": {"pluginRef": str},
}
_PARAMETERS = {
    "metrics-data-source": {
        "scheme": str, "path": str, "port": int, "insecureSkipVerify": bool,
        "caCertPath": str, "clientCertPath": str, "clientKeyPath": str, "interval": str,
    },
    "core-metrics-extractor": {
        "engineLabelKey": str,
        "defaultEngine": str,
        "engineConfigs": [{
            "name": str, "queuedRequestsSpec": str, "runningRequestsSpec": str,
            "kvUsageSpec": str, "loraSpec": str, "cacheInfoSpec": str,
            "cacheBlockSizeLabelName": str, "cacheNumBlocksLabelName": str,
            "cacheBlockSizeSpec": str, "cacheNumBlocksSpec": str,
            "customMetrics": [{"attributeKey": str, "metricSpec": str}],
        }],
    },
    "session-affinity-filter": {"headerName": str, "profileName": str},
    "queue-scorer": {},
    "kv-cache-utilization-scorer": {},
    "approx-prefix-cache-producer": {
        "autoTune": bool, "blockSizeTokens": int, "maxPrefixBlocksToMatch": int,
        "lruCapacityPerServer": int,
    },
    "prefix-cache-scorer": None,  # takes parameters; we give it none (it reads the producer
    # named approx-prefix-cache-producer, the one above)
}  # fmt: skip


def _strict(value, shape, where: str) -> list[str]:
    """``value`` against ``shape`` (a type, a dict of fields, or a one-item list)."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected an object"]
        errors = [f"{where}.{k}: unknown field" for k in value if k not in shape]
        for key, item in value.items():
            if key in shape:
                errors += _strict(item, shape[key], f"{where}.{key}")
        return errors
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [e for i, item in enumerate(value) for e in _strict(item, shape[0], f"{where}[{i}]")]
    if shape is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif shape is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, shape)
    return [] if ok else [f"{where}: expected {shape.__name__}, got {value!r}"]


def check_picker_config(config: dict) -> list[str]:
    """What the picker's loader would refuse in ``config`` (the parts it checks at decode)."""
    errors = _strict(config, _CONFIG, "config")
    if (
        config.get("apiVersion") != "llm-d.ai/v1alpha1"
        or config.get("kind") != "EndpointPickerConfig"
    ):
        errors.append("config: apiVersion llm-d.ai/v1alpha1, kind EndpointPickerConfig")
    names = set()
    for plugin in config.get("plugins", []):
        kind = plugin["type"]
        names.add(plugin.get("name") or kind)
        if kind not in _PARAMETERS:
            errors.append(f"plugin type {kind!r} is not one this check knows")
        elif _PARAMETERS[kind] is not None:
            errors += _strict(plugin.get("parameters", {}), _PARAMETERS[kind], f"{kind}.parameters")
        elif plugin.get("parameters"):
            errors.append(f"{kind}: parameters given but not checked here")
    refs = [p["pluginRef"] for s in config.get("schedulingProfiles", []) for p in s["plugins"]]
    for source in config.get("dataLayer", {}).get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    errors += [f"pluginRef {r!r} names no plugin" for r in refs if r not in names]
    return errors


def _plugin(config: dict, kind: str) -> dict:
    [plugin] = [p for p in config["plugins"] if p["type"] == kind]
    return plugin


def test_picker_config_is_one_the_picker_accepts():
    config = yaml.safe_load(PICKER.read_text())
    assert check_picker_config(config) == []
    # the metrics source and extractor are the ones it injects by default, named as their
    # types, so it injects no second source scraping the pool's port
    [source] = config["dataLayer"]["sources"]
    assert source["pluginRef"] == "metrics-data-source"
    extractor = _plugin(config, "core-metrics-extractor")["parameters"]
    engines = {e["name"]: e for e in extractor["engineConfigs"]}
    assert list(engines) == ["plugserve", "vllm"] and extractor["defaultEngine"] == "plugserve"
    # the vllm engine names vLLM's series, as the model-server protocol lists them
    assert {k: v for k, v in engines["vllm"].items() if k.endswith(("Spec", "Name"))} == {
        "queuedRequestsSpec": "vllm:num_requests_waiting",
        "runningRequestsSpec": "vllm:num_requests_running",
        "kvUsageSpec": "vllm:kv_cache_usage_perc",
        "cacheInfoSpec": "vllm:cache_config_info",
        "cacheBlockSizeLabelName": "block_size",
        "cacheNumBlocksLabelName": "num_gpu_blocks",
    }
    # prefix affinity: the scorer reads the producer of that name, whose blocks follow the
    # pod's own block size (the cache info the extractor reads)
    producer = _plugin(config, "approx-prefix-cache-producer")
    assert "name" not in producer and producer["parameters"]["autoTune"] is True
    assert producer["parameters"]["blockSizeTokens"] == 16  # plugserve's BLOCK_SIZE default
    # the session pin comes first in the profile: a filter, before the scorers
    [profile] = config["schedulingProfiles"]
    assert profile["plugins"][0] == {"pluginRef": "session-affinity-filter"}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda c: c.update(plugin=[]), "config.plugin: unknown field"),
        (lambda c: _plugin(c, "metrics-data-source")["parameters"].update(prot=8002),
         "prot: unknown field"),
        (lambda c: _plugin(c, "metrics-data-source")["parameters"].update(port="8002"),
         "expected int"),
        (lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "queue"}),
         "pluginRef 'queue' names no plugin"),
        (lambda c: _plugin(c, "core-metrics-extractor")["parameters"]["engineConfigs"][0]
         .update(kvUsage="x"), "kvUsage: unknown field"),
    ],
)  # fmt: skip
def test_picker_config_check_refuses_what_the_picker_refuses(change, words):
    config = yaml.safe_load(PICKER.read_text())
    change(config)
    errors = check_picker_config(config)
    assert any(words in e for e in errors), errors


# --------------------------------------------------------------------------- KServe


def _llmisvc() -> dict:
    [isvc] = load(KSERVE / "llminferenceservice.yaml")
    return isvc


def test_llminferenceservice_carries_the_same_engine_profile():
    isvc = _llmisvc()
    spec = isvc["spec"]
    assert spec["router"]["scheduler"]["config"]["inline"] == yaml.safe_load(PICKER.read_text())
    assert spec["labels"]["llm-d.ai/engine-type"] == "plugserve"
    [main] = spec["template"]["containers"]
    assert main["name"] == "main", "the name KServe merges the preset's container into"
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    # KServe's InferencePool targets 8000; the profile scrapes the metrics port
    assert ports["http"] == 8000
    source = _plugin(spec["router"]["scheduler"]["config"]["inline"], "metrics-data-source")
    assert source["parameters"]["port"] == ports["metrics"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"]["port"] == ports["http"]
        assert main[probe]["httpGet"]["path"].startswith("/v2/health/")


def test_llminferenceservice_container_script_serves_the_model(tmp_path):
    """The container's script, with /mnt/models a folder holding the tiny generative model
    and its ports free ones: plugserve serves it as spec.model.name over the OpenAI routes,
    and its probes' paths answer."""
    llm = pytest.importorskip("llm", reason="tests/support/llm.py makes the generative models")
    try:
        folder = llm.export("tiny-llama", "genai-fp32")
    except llm.Unavailable as exc:
        pytest.skip(f"the tiny generative test model is not prepared: {exc}")
    isvc = _llmisvc()
    [main] = isvc["spec"]["template"]["containers"]
    assert main["command"] == ["/bin/sh", "-c"]
    [script] = main["args"]
    mnt = tmp_path / "mnt" / "models"
    mnt.parent.mkdir()
    mnt.symlink_to(folder, target_is_directory=True)
    for flag in ("--http-port", "--grpc-port", "--metrics-port"):
        script, count = re.subn(rf"{flag}=\d+", f"{flag}=0", script)
        assert count == 1, flag
    script = script.replace("/mnt/models", str(mnt))
    script = script.replace("--exit-timeout=30", "--exit-timeout=30 --host=127.0.0.1")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = _path_env(HOME=str(tmp_path), TMPDIR=str(scratch))
    name = isvc["spec"]["model"]["name"]
    with CommandServer(["/bin/sh", "-c", script], env) as live:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = main[probe]["httpGet"]["path"]
            with urllib.request.urlopen(live.http_url + path, timeout=30) as response:
                assert response.status == 200, path
        body = {"model": name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            live.http_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["model"] == name
        assert answer["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(live.metrics_url, timeout=30) as response:
            assert "plugserve_kv_cache_usage_ratio" in response.read().decode()
        assert live.stop() == 0, live.log
    # the one-model repository it made is in the container's $TMPDIR, not beside the model
    [repo] = [p for p in scratch.iterdir() if (p / name / "1").is_symlink()]
    assert (repo / name / "1").resolve() == folder.resolve()
    assert [p.name for p in mnt.parent.iterdir()] == ["models"]


# --------------------------------------------------------------------------- KubeRay


def _ray() -> tuple[dict, dict, dict[str, dict]]:
    docs = load(RAY)
    [service] = [d for d in docs if d["kind"] == "RayService"]
    others = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs if d is not service}
    return service, yaml.safe_load(service["spec"]["serveConfigV2"]), others


def _ray_containers(service: dict) -> list[tuple[dict, dict]]:
    """``(pod spec, container)`` of the head and of each worker group."""
    config = service["spec"]["rayClusterConfig"]
    specs = [config["headGroupSpec"]["template"]["spec"]]
    specs += [g["template"]["spec"] for g in config["workerGroupSpecs"]]
    return [(s, c) for s in specs for c in s["containers"]]


def test_rayservice_sets_serve_ports_and_plugserve_grpc_servicer():
    service, serve, _others = _ray()
    assert serve["http_options"]["port"] == 8000
    assert serve["grpc_options"]["port"] == 9000
    assert serve["proxy_location"] == "EveryNode"
    [app] = serve["applications"]
    assert app["import_path"] == "plugserve.ray:app"
    # the servicer Serve's gRPC proxy adds: plugserve's own generated KServe v2 service
    for dotted in serve["grpc_options"]["grpc_servicer_functions"]:
        module, _, function = dotted.rpartition(".")
        assert callable(getattr(importlib.import_module(module), function)), dotted
    for pod, c in _ray_containers(service):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (ports["serve"], ports["serve-grpc"]) == (8000, 9000), c["name"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        model_mount = mounts[app["args"]["model_repository"]]
        assert model_mount["readOnly"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[model_mount["name"]]["persistentVolumeClaim"]["readOnly"] is True
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no replica on the head"


def test_rayservice_gcs_fault_tolerance_points_at_its_redis():
    service, _serve, others = _ray()
    ft = service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    host, _, port = ft["redisAddress"].partition(":")
    redis_service = others[f"Service/{host}"]
    assert int(port) in {p["port"] for p in redis_service["spec"]["ports"]}
    deployment = others["Deployment/plugserve-redis"]
    assert selects(
        redis_service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    [redis] = deployment["spec"]["template"]["spec"]["containers"]
    # one Secret gives Ray and Redis the same password; none is written in the manifest
    ray_secret = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    env = {e["name"]: e for e in redis["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ray_secret
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--port") + 1] == port
    data = args[args.index("--dir") + 1]
    [mount] = [m for m in redis["volumeMounts"] if m["mountPath"] == data]
    [volume] = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    assert f"PersistentVolumeClaim/{volume['persistentVolumeClaim']['claimName']}" in others
    assert deployment["spec"]["strategy"]["type"] == "Recreate", "one Redis owns its volume"
    assert not [d for d in others if d.startswith("Secret/")]
