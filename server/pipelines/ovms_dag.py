"""OpenVINO Model Server's DAG pipelines (``pipeline_config_list`` in its ``config.json``, see
OVMS's docs/dag_scheduler.md and the schema in its src/schema.cpp) as ensembles: each
pipeline becomes a :class:`~plugserve.server.pipelines.ensemble.Definition` run by the same
scheduler as Triton's ensembles (``ensemble.py``).

OVMS -> plugserve, field by field:

==============================================  ============================================
pipeline ``name``                               the ensemble's name (a model name; it must
                                                not be a model's too); served as version 1
                                                (OVMS pipelines are not versioned)
pipeline ``inputs``                             the tensors a request brings; each one's type
                                                and shape are those of the node inputs that
                                                read it (OVMS's metadata does the same)
pipeline ``outputs``                            ``{name: {node_name, data_item}}``: the
                                                answer's tensors, of the writing node's
                                                model output's type and shape
node ``type: "DL model"``, ``model_name``,      one step: that model (of
``version``                                     ``model_config_list``; another pipeline is
                                                refused, as OVMS does) at that version
                                                (none: its latest)
node ``inputs``                                 ``{model input: {node_name, data_item}}``:
                                                ``node_name: "request"`` reads a pipeline
                                                input, else a node's output by its alias
node ``outputs``                                ``{data_item: model output, alias}``: what
                                                other nodes and the pipeline outputs call it
node ``type: "custom"``, ``library_name``,      refused, naming the node: custom nodes are
``params``, ``custom_node_library_config_list``  C++ libraries; write the node as a Triton
                                                Python model in a Triton ensemble instead
``demultiply_count``, ``gather_from_node``      refused, naming the node (not served yet)
==============================================  ============================================

Each pipeline is read on its own: one that is wrong is reported (file, pipeline, node and
what is wrong) and the others still load, as OVMS's models do. What does not connect (a cycle,
a node reading what nothing writes) is refused by the scheduler's own checks at load.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from plugserve.plugins.api import InvalidArgument
from plugserve.server.pipelines.ensemble import Definition, Step

__all__ = ["PIPELINE_KEYS", "read_pipelines"]

#: The top-level keys of an OVMS config.json this module reads.
PIPELINE_KEYS = ("pipeline_config_list", "custom_node_library_config_list")
_REQUEST = "request"
_PIPELINE_KEYS = {"name", "inputs", "outputs", "nodes", "demultiply_count"}
_NODE_KEYS = {
    "name", "model_name", "library_name", "type", "version", "inputs", "outputs", "params",
    "demultiply_count", "gather_from_node",
}  # fmt: skip
_CUSTOM = (
    "custom nodes are C++ libraries (custom_node_library_config_list), which plugserve does "
    'not load; write the node as a Triton Python model (backend: "python") and the pipeline '
    "as a Triton ensemble (docs/ensembles.md)"
)


def read_pipelines(
    raw: dict[str, Any], path: Path, models: Collection[str]
) -> tuple[list[Definition], list[str]]:
    """The pipelines of an OVMS ``config.json`` (``raw``, read from ``path``) whose nodes run
    ``models`` (its model_config_list's names), and one message per pipeline refused."""
    items = raw.get("pipeline_config_list", [])
    if not isinstance(items, list):
        return [], [f"{path}: 'pipeline_config_list' must be a list of pipelines"]
    found: list[Definition] = []
    problems: list[str] = []
    names: set[str] = set()
    for index, item in enumerate(items):
        where = f"{path}: pipeline_config_list[{index}]"
        try:
            name = item.get("name") if isinstance(item, dict) else None
            if isinstance(name, str):
                where = f"{path}: pipeline {name!r}"
            definition = _pipeline(item, where, models)
            if definition.name in names:
                raise InvalidArgument(f"{where}: a pipeline of that name comes earlier")
            if definition.name in models:
                raise InvalidArgument(
                    f"{where}: model_config_list has a model of that name; rename one"
                )
        except InvalidArgument as exc:
            problems.append(str(exc))
            continue
        names.add(definition.name)
        found.append(definition)
    return found, problems


def _pipeline(item: Any, where: str, models: Collection[str]) -> Definition:
    if not isinstance(item, dict):
        raise InvalidArgument(f"{where}: expected an object with name, inputs, nodes, outputs")
    unknown = sorted(set(item) - _PIPELINE_KEYS)
    if unknown:
        raise InvalidArgument(f"{where}: unknown key(s) {unknown}")
    for key in ("name", "inputs", "nodes", "outputs"):
        if key not in item:
            raise InvalidArgument(f"{where}: '{key}' is required")
    name = item["name"]
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}: 'name' must be a non-empty string")
    from plugserve.server.repository import check_name

    check_name(name)
    if "demultiply_count" in item:
        raise InvalidArgument(
            f"{where}: demultiply_count (splitting the request's inputs into branches) is not "
            "served here; send one item per request, or batch in the models"
        )
    inputs = item["inputs"]
    if not isinstance(inputs, list) or not all(isinstance(i, str) and i for i in inputs):
        raise InvalidArgument(f"{where}: 'inputs' must be a list of input names")
    if len(set(inputs)) != len(inputs):
        raise InvalidArgument(f"{where}: 'inputs' names an input twice")
    nodes = item["nodes"]
    if not isinstance(nodes, list) or not nodes:
        raise InvalidArgument(f"{where}: 'nodes' must be a non-empty list of nodes")
    aliases: dict[str, set[str]] = {}  # node name -> its output aliases
    for index, node in enumerate(nodes):
        node_name = node.get("name") if isinstance(node, dict) else None
        if not isinstance(node_name, str) or not node_name:
            raise InvalidArgument(f"{where}: nodes[{index}] needs a 'name'")
        if node_name in (_REQUEST, "response") or node_name in aliases:
            raise InvalidArgument(
                f"{where}: node name {node_name!r} is "
                + ("reserved" if node_name in (_REQUEST, "response") else "used twice")
            )
        aliases[node_name] = _aliases(node, f"{where}: node {node_name!r}")
    steps = [
        _step(i, node, f"{where}: node {node['name']!r}", models, inputs, aliases)
        for i, node in enumerate(nodes)
    ]
    outputs = item["outputs"]
    if not isinstance(outputs, list) or not outputs:
        raise InvalidArgument(f"{where}: 'outputs' must be a non-empty list")
    answers: dict[str, str] = {}
    for entry in outputs:
        out, source = _mapping(entry, f"{where}: outputs")
        if out in answers:
            raise InvalidArgument(f"{where}: output {out!r} is named twice")
        answers[out] = _tensor(source, f"{where}: output {out!r}", inputs, aliases)
    return Definition(name, steps, list(inputs), answers, kind="pipeline")


def _aliases(node: dict[str, Any], where: str) -> set[str]:
    outputs = node.get("outputs")
    if not isinstance(outputs, list):
        raise InvalidArgument(f"{where}: 'outputs' must be a list of {{data_item, alias}}")
    found: set[str] = set()
    for entry in outputs:
        if (
            not isinstance(entry, dict)
            or set(entry) != {"data_item", "alias"}
            or not all(isinstance(v, str) and v for v in entry.values())
        ):
            raise InvalidArgument(
                f"{where}: each of 'outputs' must be {{\"data_item\": model output, "
                f'"alias": name}}, not {entry!r}'
            )
        if entry["alias"] in found:
            raise InvalidArgument(f"{where}: output alias {entry['alias']!r} is used twice")
        found.add(entry["alias"])
    return found


def _step(
    index: int,
    node: dict[str, Any],
    where: str,
    models: Collection[str],
    inputs: list[str],
    aliases: dict[str, set[str]],
) -> Step:
    unknown = sorted(set(node) - _NODE_KEYS)
    if unknown:
        raise InvalidArgument(f"{where}: unknown key(s) {unknown}")
    kind = node.get("type")
    if kind == "custom":
        raise InvalidArgument(f"{where}: type 'custom': {_CUSTOM}")
    if kind != "DL model":
        raise InvalidArgument(f"{where}: type {kind!r}: expected 'DL model' (or 'custom')")
    for key in ("demultiply_count", "gather_from_node"):
        if key in node:
            raise InvalidArgument(
                f"{where}: {key} (branching a pipeline per item of a batch) is not served "
                "here; have the node's model take the whole batch instead"
            )
    if "library_name" in node or "params" in node:
        raise InvalidArgument(f"{where}: library_name and params belong to custom nodes")
    model = node.get("model_name")
    if not isinstance(model, str) or not model:
        raise InvalidArgument(f"{where}: a 'DL model' node needs 'model_name'")
    if model not in models:
        raise InvalidArgument(
            f"{where}: model_name {model!r} is not a model of model_config_list (a node runs "
            f"one of {', '.join(sorted(models)) or 'none'})"
        )
    version = node.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise InvalidArgument(f"{where}: 'version' must be a version number >= 1")
    mapped: dict[str, str] = {}
    raw_inputs = node.get("inputs")
    if not isinstance(raw_inputs, list):
        raise InvalidArgument(f"{where}: 'inputs' must be a list")
    for entry in raw_inputs:
        model_input, source = _mapping(entry, f"{where}: inputs")
        if model_input in mapped:
            raise InvalidArgument(f"{where}: model input {model_input!r} is mapped twice")
        mapped[model_input] = _tensor(source, f"{where}: input {model_input!r}", inputs, aliases)
    name = node["name"]
    outputs = {o["data_item"]: f"{name}/{o['alias']}" for o in node["outputs"]}
    return Step(index, model, version, mapped, outputs, label=f"node {name!r}")


def _mapping(entry: Any, where: str) -> tuple[str, dict[str, str]]:
    """``{name: {"node_name": ..., "data_item": ...}}`` as its name and source."""
    if not isinstance(entry, dict) or len(entry) != 1:
        raise InvalidArgument(
            f'{where}: each entry must be {{"name": {{"node_name": ..., "data_item": ...}}}}, '
            f"not {entry!r}"
        )
    ((name, source),) = entry.items()
    if (
        not isinstance(source, dict)
        or set(source) != {"node_name", "data_item"}
        or not all(isinstance(v, str) and v for v in source.values())
    ):
        raise InvalidArgument(
            f'{where}: {name!r} must map to {{"node_name": ..., "data_item": ...}}, not {source!r}'
        )
    return name, source


def _tensor(
    source: dict[str, str], where: str, inputs: list[str], aliases: dict[str, set[str]]
) -> str:
    """The ensemble tensor a ``{node_name, data_item}`` source names."""
    node, item = source["node_name"], source["data_item"]
    if node == _REQUEST:
        if item not in inputs:
            raise InvalidArgument(
                f"{where}: reads request data_item {item!r}, which is not one of the "
                f"pipeline's inputs ({', '.join(inputs) or 'none'})"
            )
        return item
    if node not in aliases:
        raise InvalidArgument(
            f"{where}: reads node {node!r}, which the pipeline does not have (its nodes: "
            f"{', '.join(aliases)}; 'request' for its inputs)"
        )
    if item not in aliases[node]:
        raise InvalidArgument(
            f"{where}: reads data_item {item!r} of node {node!r}, which it does not output "
            f"(its output aliases: {', '.join(sorted(aliases[node])) or 'none'})"
        )
    return f"{node}/{item}"
