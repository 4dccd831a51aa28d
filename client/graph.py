"""Draw a model colored by device, with HETERO's subgraph boundaries, through graphviz.

The client reads the model file it sent (node names and edges come from the ONNX graph) and the
server's QueryNetwork answer (which device runs each node, and the subgraphs), writes DOT, and
lets graphviz's ``dot`` render it: ``.svg``, ``.png`` or ``.pdf`` by the file's extension, or the
DOT text itself for ``.dot``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx

__all__ = ["copies", "render", "to_dot"]

_PALETTE = ("#8ecae6", "#ffb703", "#90be6d", "#f28482", "#cdb4db", "#f6bd60", "#84a59d")
_UNSUPPORTED = "#d9d9d9"


def _node_names(graph: onnx.GraphProto) -> list[str]:
    """Names as the server reports them (unnamed nodes are OpType_index)."""
    names, seen = [], set()
    for index, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{index}"
        if name in seen:
            name = f"{name}_{index}"
        seen.add(name)
        names.append(name)
    return names


def _quote(text: str) -> str:
    """A DOT string: backslashes, quotes and newlines escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def copies(
    model: onnx.ModelProto, subgraphs: Sequence[tuple[str, Sequence[str]]]
) -> list[tuple[str, int, int]]:
    """The values a split copies: ``(value, producing subgraph, reading subgraph)``, once per
    reading subgraph, in the model's order (what HETERO hands from one device to another at
    each run; a graph input or an output is not counted)."""
    graph = model.graph
    names = _node_names(graph)
    member = {n: k for k, (_device, nodes) in enumerate(subgraphs) for n in nodes}
    made_in = {o: member.get(names[i]) for i, n in enumerate(graph.node) for o in n.output if o}
    found: dict[tuple[str, int], int] = {}
    for index, node in enumerate(graph.node):
        reader = member.get(names[index])
        for value in node.input:
            source = made_in.get(value)
            if source is not None and reader is not None and source != reader:
                found.setdefault((value, reader), source)
    return [(value, source, reader) for (value, reader), source in found.items()]


def to_dot(
    model: onnx.ModelProto,
    placement: Mapping[str, str],
    subgraphs: Sequence[tuple[str, Sequence[str]]] = (),
) -> str:
    graph = model.graph
    names = _node_names(graph)
    devices = sorted(set(placement.values()))
    colors = {d: _PALETTE[i % len(_PALETTE)] for i, d in enumerate(devices)}
    lines = [
        f"digraph {_quote(graph.name or 'model')} {{",
        "  rankdir=TB;",
        '  graph [fontname="Helvetica"];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
    ]
    initializers = {t.name for t in graph.initializer}
    for value in graph.input:
        if value.name not in initializers:
            lines.append(
                f"  {_quote('in:' + value.name)} [label={_quote(value.name)}, "
                "shape=ellipse, fillcolor=white];"
            )
    for value in graph.output:
        lines.append(
            f"  {_quote('out:' + value.name)} [label={_quote(value.name)}, "
            "shape=ellipse, fillcolor=white];"
        )

    def node_line(index: int) -> str:
        name = names[index]
        device = placement.get(name)
        label = f"{name}\n{graph.node[index].op_type}\n{device or '(no device)'}"
        color = colors.get(device, _UNSUPPORTED) if device else _UNSUPPORTED
        return f"  {_quote(name)} [label={_quote(label)}, fillcolor={_quote(color)}];"

    placed: set[str] = set()
    index_of = {n: i for i, n in enumerate(names)}
    for k, (device, members) in enumerate(subgraphs):
        lines.append(f"  subgraph cluster_{k} {{")
        lines.append(f"    label={_quote(f'subgraph {k}: {device}')}; style=dashed; color=gray40;")
        for member in members:
            if member in index_of:
                lines.append("  " + node_line(index_of[member]))
                placed.add(member)
        lines.append("  }")
    for index, name in enumerate(names):
        if name not in placed:
            lines.append(node_line(index))
    producers = {o: names[i] for i, n in enumerate(graph.node) for o in n.output if o}
    graph_inputs = {v.name for v in graph.input} - initializers
    crossing = copies(model, subgraphs)
    copied = {(value, reader) for value, _source, reader in crossing}
    member = {n: k for k, (_device, nodes) in enumerate(subgraphs) for n in nodes}
    if crossing:
        lines.append(
            f"  label={_quote(f'{len(crossing)} copies between subgraphs (red edges)')}; "
            "labelloc=b;"
        )
    for index, node in enumerate(graph.node):
        for value in node.input:
            if value in producers:
                cut = (value, member.get(names[index])) in copied
                style = f" [color=red, penwidth=2, label={_quote('copy ' + value)}]" if cut else ""
                lines.append(f"  {_quote(producers[value])} -> {_quote(names[index])}{style};")
            elif value in graph_inputs:
                lines.append(f"  {_quote('in:' + value)} -> {_quote(names[index])};")
    for value in graph.output:
        if value.name in producers:
            lines.append(f"  {_quote(producers[value.name])} -> {_quote('out:' + value.name)};")
    for device in devices:
        lines.append(
            f"  {_quote('legend:' + device)} [label={_quote(device)}, "
            f"fillcolor={_quote(colors[device])}, shape=note];"
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(dot: str, path: str | Path) -> Path:
    """Write ``dot`` to ``path``, rendered by graphviz unless the extension is ``.dot``."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower()
    if fmt in ("dot", "gv"):
        path.write_text(dot)
        return path
    if fmt not in ("svg", "png", "pdf"):
        raise ValueError(f"{path}: use .svg, .png, .pdf or .dot")
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError(
            "graphviz's 'dot' is not installed (e.g. apt-get install graphviz); "
            f"or save the graph as {path.with_suffix('.dot')}"
        )
    subprocess.run(
        [exe, f"-T{fmt}", "-o", str(path)],
        input=dot.encode(),
        check=True,
        capture_output=True,
        timeout=120,
    )
    return path
