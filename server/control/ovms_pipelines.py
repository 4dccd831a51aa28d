"""OpenVINO Model Server's DAG pipelines (``pipeline_config_list`` in its ``config.json``, see
OVMS's docs/dag_scheduler.md and the schema in its src/schema.cpp) as ensembles: each
pipeline becomes a :class:`~plugserve.server.control.pipelines.Definition` run by the same
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
node ``demultiply_count``                        the nodes after it (up to those that gather
                                                from it) run once per item of its outputs'
                                                first dimension (-1: as many as there are),
                                                each branch on the items' slices (views), at
                                                most ``ensemble.MAX_BRANCHES`` per request:
                                                one :class:`~.pipelines.Fan` step
node ``gather_from_node``                        its inputs from the branches stacked along a
                                                new first dimension; without one, the
                                                pipeline's outputs are (OVMS's response
                                                gathering)
pipeline ``demultiply_count``                   refused: demultiplex in a node
nested demultiplexers (a node in the branches   refused, naming the node: gather first
of another that demultiplexes or gathers)
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
from plugserve.server.control.model_names import check_name
from plugserve.server.control.pipelines import Definition, Fan, Step

__all__ = ["read_pipelines"]

#: The top-level keys of an OVMS config.json this module reads.
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
    demux = {n["name"]: n["demultiply_count"] for n in nodes if "demultiply_count" in n}
    gathers = {n["name"]: n["gather_from_node"] for n in nodes if "gather_from_node" in n}
    outputs = item["outputs"]
    if not isinstance(outputs, list) or not outputs:
        raise InvalidArgument(f"{where}: 'outputs' must be a non-empty list")
    answers: dict[str, str] = {}
    for entry in outputs:
        out, source = _mapping(entry, f"{where}: outputs")
        if out in answers:
            raise InvalidArgument(f"{where}: output {out!r} is named twice")
        answers[out] = _tensor(source, f"{where}: output {out!r}", inputs, aliases)
    if demux or gathers:
        names = [n["name"] for n in nodes]
        steps = _fan_out(where, name, steps, names, demux, gathers, set(answers.values()))
    return Definition(name, steps, list(inputs), answers, kind="pipeline")


def _fan_out(
    where: str,
    name: str,
    steps: list[Step],
    names: list[str],
    demux: dict[str, int],
    gathers: dict[str, str],
    answered: set[str],
) -> list[Step]:
    """``steps`` with the nodes after each demultiplexer (up to the nodes that gather from it,
    else to the pipeline's outputs) made one :class:`Fan` step that runs them per branch."""
    node_of = {names[s.index]: s for s in steps}
    for gather, source in gathers.items():
        if source not in demux:
            raise InvalidArgument(
                f"{where}: node {gather!r}: gather_from_node {source!r} names no node with "
                "demultiply_count"
            )
    for node, count in demux.items():
        if not isinstance(count, int) or isinstance(count, bool) or not -1 <= count <= 10000:
            raise InvalidArgument(
                f"{where}: node {node!r}: demultiply_count must be -1 (as many branches as "
                "the outputs' first dimension) or a number of branches up to 10000"
            )
        if count == 0:
            raise InvalidArgument(f"{where}: node {node!r}: demultiply_count 0 runs nothing")
    fans: list[Step] = []
    inside_any: set[str] = set()
    next_index = len(steps)
    for source, count in demux.items():
        front = set(node_of[source].outputs.values())
        region: list[Step] = []
        grew = True
        while grew:
            grew = False
            for step in steps:
                label = names[step.index]
                if step in region or label == source or gathers.get(label) == source:
                    continue
                if front & set(step.inputs.values()):
                    region.append(step)
                    front |= set(step.outputs.values())
                    grew = True
        if not region:
            raise InvalidArgument(
                f"{where}: node {source!r}: demultiply_count, but no node reads its outputs "
                "(no node would run per branch)"
            )
        for step in region:
            label = names[step.index]
            if label in demux or label in gathers or label in inside_any:
                raise InvalidArgument(
                    f"{where}: {step} runs in the branches of node {source!r} and demultiplexes "
                    "or gathers too: nested demultiplexing is not served; gather first"
                )
        inside_any |= {names[s.index] for s in region}
        region.sort(key=lambda s: s.index)
        written = {t for s in region for t in s.outputs.values()}
        reads: list[str] = []
        for step in region:
            reads += [t for t in step.inputs.values() if t not in written and t not in reads]
        outside = [s for s in steps if s not in region]
        read_outside = {t for s in outside for t in s.inputs.values()} | answered
        gives = [t for s in region for t in s.outputs.values() if t in read_outside]
        if not gives:
            raise InvalidArgument(
                f"{where}: the branches of node {source!r} give nothing a gathering node or "
                "the pipeline's outputs read"
            )
        for gather, of in gathers.items():
            if of == source and not set(node_of[gather].inputs.values()) & set(gives):
                raise InvalidArgument(
                    f"{where}: node {gather!r} gathers from {source!r} but reads nothing of "
                    "its branches"
                )
        own = [
            Step(i, s.model, s.version, s.inputs, s.outputs, label=s.label)
            for i, s in enumerate(region)
        ]
        branch = Definition(name, own, reads, {t: t for t in gives}, kind="branch of pipeline")
        split = [t for t in reads if t in node_of[source].outputs.values()]
        fan = Fan(next_index, f"the branches of node {source!r}", branch, split, count, reads,
                  gives)  # fmt: skip
        next_index += 1
        fans.append(fan)
        steps = outside
    return [*steps, *fans]


def _aliases(node: dict[str, Any], where: str) -> set[str]:
    outputs = node.get("outputs")
    if not isinstance(outputs, list):
        raise InvalidArgument(f"{where}: 'outputs' must be a list of {{data_item, alias}}")
    found: set[str] = set()
    for entry in outputs:
        if not _names_of(entry, {"data_item", "alias"}):
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


def _names_of(entry: Any, keys: set[str]) -> bool:
    """Whether ``entry`` is an object of exactly ``keys``, each a name (a non-empty string)."""
    return (
        isinstance(entry, dict)
        and set(entry) == keys
        and all(isinstance(v, str) and v for v in entry.values())
    )


def _mapping(entry: Any, where: str) -> tuple[str, dict[str, str]]:
    """``{name: {"node_name": ..., "data_item": ...}}`` as its name and source."""
    if not isinstance(entry, dict) or len(entry) != 1:
        raise InvalidArgument(
            f'{where}: each entry must be {{"name": {{"node_name": ..., "data_item": ...}}}}, '
            f"not {entry!r}"
        )
    ((name, source),) = entry.items()
    if not _names_of(source, {"node_name", "data_item"}):
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
