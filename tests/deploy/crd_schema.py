"""Custom resources checked against the projects' own CRDs (vendored in deploy/crds/), as a
Kubernetes API server would check them on ``kubectl apply``, without a cluster.

What the API server does with a custom resource, and what is done here the same way:

1. its ``apiVersion`` must be a version the CRD serves, and its ``kind`` the CRD's;
2. ``metadata`` is an ObjectMeta: a name (a DNS-1123 subdomain, at most 253 characters),
   labels with valid keys and values (63 characters, alphanumerics at both ends), string
   annotations;
3. defaults of the structural schema are filled in (``default``), then the object is checked
   against the version's ``openAPIV3Schema``: types, enums, patterns, bounds, ``required``,
   ``nullable``, ``x-kubernetes-int-or-string``; and an unknown field is an error, as
   ``kubectl apply``'s default server-side field validation (Strict) makes it, except where
   the schema keeps unknown fields (``x-kubernetes-preserve-unknown-fields``);
4. every ``x-kubernetes-validations`` rule (CEL) on a node present in the object is evaluated
   with ``self`` bound to that node (cel-python: the CEL standard library and macros). Rules
   on ``oldSelf`` (transition rules: only an update has them) are not; nor rules calling one of
   Kubernetes' own CEL libraries cel-python lacks (``isURL``, ``quantity``, ...): those are
   reported in :attr:`Report.skipped`, so a caller can insist there are none.

What is not done: admission webhooks (KServe's and KubeRay's own checks of meaning run in
their controllers), and nothing can tell whether a controller acts on the object as meant;
docs/scale-out.md lists what stays untested without a cluster.

jsonschema's Draft 4 validator reads OpenAPI 3.0's schema dialect (boolean
``exclusiveMinimum``); a schema is converted once per CRD version and cached.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "deploy" / "crds"

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
#: libyaml's loader where PyYAML has it: the vendored CRDs are 4.7 MB of YAML (12 s in Python)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SKIPPED_KEYS = {"description", "default", "format", "nullable", "example", "externalDocs"}


@dataclasses.dataclass
class Report:
    """One object's check: its errors (empty: valid), the CEL rules evaluated, and the rules
    not evaluated with why."""

    errors: list[str] = dataclasses.field(default_factory=list)
    rules: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@functools.cache
def crds(folder: Path = CRDS) -> dict[tuple[str, str], dict]:
    """``(group, kind)`` -> the CRD, for every CRD file under ``folder``."""
    found: dict[tuple[str, str], dict] = {}
    for path in sorted(folder.glob("*/*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=_LOADER):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                spec = doc["spec"]
                found[spec["group"], spec["names"]["kind"]] = doc
    return found


def kinds(folder: Path = CRDS) -> set[str]:
    return {kind for _group, kind in crds(folder)}


def _convert(schema: dict) -> dict:
    """A structural schema as JSON Schema (Draft 4), unknown fields refused."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: _convert(s) for name, s in value.items()}
        elif key == "items":
            out[key] = _convert(value)
        elif key == "additionalProperties":
            out[key] = _convert(value) if isinstance(value, dict) else value
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [_convert(s) for s in value]
        elif key == "not":
            out[key] = _convert(value)
        elif key.startswith("x-kubernetes-") or key in _SKIPPED_KEYS:
            continue
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for name in ("apiVersion", "kind"):
            props.setdefault(name, {"type": "string"})
        props.setdefault("metadata", {"type": "object", "additionalProperties": True})
    if (
        out.get("type") == "object"
        and "additionalProperties" not in out
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        # an object schema without properties keeps none of them: the API server prunes
        # them (an embedded ObjectMeta declared as a bare object loses its labels so)
        out["additionalProperties"] = False
    if schema.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _version(group: str, kind: str, version: str) -> tuple[dict, Any] | str:
    """The served version's schema and its Draft 4 validator, or why there is none."""
    import jsonschema

    crd = crds().get((group, kind))
    if crd is None:
        known = ", ".join(sorted(k for _g, k in crds()))
        return f"no vendored CRD for {kind} in group {group!r} (deploy/crds has: {known})"
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    entry = versions.get(version)
    if entry is None or not entry.get("served", False):
        served = ", ".join(n for n, v in versions.items() if v.get("served"))
        return f"{group}/{version} {kind} is not served by the CRD (served: {served})"
    schema = entry["schema"]["openAPIV3Schema"]
    converted = _convert(schema)
    # the API server checks ObjectMeta itself (see _metadata)
    converted.get("properties", {}).pop("metadata", None)
    return schema, jsonschema.Draft4Validator(converted)


def _metadata(meta: Any) -> Iterator[str]:
    if not isinstance(meta, dict):
        yield "metadata: must be an object"
        return
    name = meta.get("name")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        yield f"metadata.name: {name!r} is not a DNS-1123 subdomain (lowercase, at most 253)"
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)) or not (
            len(label) <= 63 and _LABEL_NAME.fullmatch(label)
        ):
            yield f"metadata.labels: invalid key {key!r}"
        if (
            not isinstance(value, str)
            or len(value) > 63
            or (value and not _LABEL_NAME.fullmatch(value))
        ):
            yield f"metadata.labels[{key}]: invalid value {value!r}"
    for key, value in (meta.get("annotations") or {}).items():
        if not isinstance(value, str):
            yield f"metadata.annotations[{key}]: must be a string, got {value!r}"
    unknown = set(meta) - {"name", "namespace", "labels", "annotations", "generateName"}
    if unknown:
        yield f"metadata: fields a manifest does not set: {', '.join(sorted(unknown))}"


def _defaults(schema: dict, value: Any) -> Any:
    """``value`` with the schema's defaults filled in where a field is absent (as the API
    server does before it validates)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value.keys() - props.keys():
                value[name] = _defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_defaults(schema["items"], v) for v in value]
    return value


def _nodes(schema: dict, value: Any, path: str) -> Iterator[tuple[str, dict, Any]]:
    """Every ``(path, schema, value)`` of the object where the schema has CEL rules."""
    if schema.get("x-kubernetes-validations"):
        yield path, schema, value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            sub = props.get(name, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _nodes(sub, item, f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _nodes(schema["items"], item, f"{path}[{i}]")


@functools.cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _rules(schema: dict, obj: dict, report: Report) -> None:
    import celpy

    for path, node_schema, value in _nodes(schema, obj, ""):
        for rule in node_schema["x-kubernetes-validations"]:
            text = rule["rule"]
            where = path or "<root>"
            if "oldSelf" in text:
                report.skipped.append(f"{where}: transition rule (an update's): {text}")
                continue
            try:
                result = _program(text).evaluate({"self": celpy.json_to_cel(value)})
            except Exception as exc:  # celpy: CELEvalError, or a parse error of its own
                missing = re.search(r"undeclared reference to '(\w+)'", str(exc))
                if missing and missing.group(1) != "self":
                    report.skipped.append(
                        f"{where}: uses {missing.group(1)}(), a Kubernetes CEL library "
                        f"function cel-python lacks: {text}"
                    )
                else:
                    report.errors.append(f"{where}: rule {text!r} failed to evaluate: {exc}")
                continue
            report.rules += 1
            if isinstance(result, Exception) or not bool(result):
                message = rule.get("message") or f"failed rule: {text}"
                report.errors.append(f"{where}: {message}")


def validate(doc: dict) -> Report:
    """``doc`` (one custom resource) checked as described in the module docstring."""
    report = Report()
    api, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    group, _, version = api.rpartition("/")
    found = _version(group, kind, version)
    if isinstance(found, str):
        report.errors.append(found)
        return report
    schema, validator = found
    report.errors.extend(_metadata(doc.get("metadata")))
    obj = _defaults(schema, copy.deepcopy(doc))
    body = {k: v for k, v in obj.items() if k != "metadata"}
    for error in sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in error.absolute_path) or "<root>"
        report.errors.append(f"{where}: {error.message}")
    _rules(schema, obj, report)
    return report
