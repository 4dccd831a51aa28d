"""The shape of the code itself (issues 25 and 43), read with ``ast`` so it cannot drift back.

- ``server/`` is laid out by its layers, and the arrows between its folders run one way:
  ``process`` (the server process) above ``protocols`` (adapters and their plumbing), above
  ``apps`` (generation, Python models, ensembles), above ``control`` (what is loaded), above
  ``plane`` (the request path); a folder imports only its own modules and those of folders
  below it (so no circle can join two folders), and no protocol adapter (``kserve``,
  ``openai``, ``v1``) imports another: what they share (the gRPC and HTTP plumbing, the status
  mapping, auth) is its own module.
- Type-only imports (under ``if TYPE_CHECKING:``, dotted names in string annotations) obey the
  same floors, and no plugin imports the server in any way (issue 60, point 4); the shared
  plumbing of ``server/protocols/`` (``http/``, ``grpc/``, ``status``, ``auth``) imports no
  adapter. Each rule starts from a list of today's exceptions that can only shrink: a new break
  fails, and so does a listed one that no longer occurs. The rest of the house rules (the top
  level, the server reaching a device's face only, sizes) are ``tests/test_house.py``'s.
- No import circle between plugserve's modules: every ``import``, at module level or inside a
  function, is an edge (``if TYPE_CHECKING:`` blocks are not, nor are the optional backends a
  plugin imports when it is asked for: onnxruntime, openvino).
- No module of ``plugins/`` imports plugserve inside a function.
- No module imports another's private name.
- No hook is probed: no ``getattr`` / ``hasattr`` on a plugin, network or request (or on
  ``self`` in their classes); every hook has a declared default on its base
  (``plugins/base.py``) instead.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from code_graph import MODULES, ROOT, exceptions_kept, imports, tree


def _imports(name: str, path: Path) -> Iterator[tuple[str, int, bool]]:
    """``(plugserve module imported, line, inside a function)`` for each import that runs
    (those under ``if TYPE_CHECKING:`` and in string annotations never do)."""
    for found in imports(name, path):
        if found.target is not None and not found.type_only:
            yield found.target, found.line, found.in_function


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    """The import graph: the imports that run, and with ``type_only`` those under
    ``if TYPE_CHECKING:`` and in string annotations too."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for found in imports(name, path):
            counted = type_only or not found.type_only
            if counted and found.target is not None and found.target != name:
                graph[name].add(found.target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_circle() -> None:
    assert _cycles(_graph()) == []


#: ``server/`` folders from the top down: each may import its own and those after it.
SERVER_LAYERS = ("process", "protocols", "apps", "control", "plane")
#: the protocol adapters under ``server/protocols/``, which never import each other
ADAPTERS = ("kserve", "openai", "v1")


def _room(module: str) -> str | None:
    """The ``server/`` folder a module lives in (``protocols.kserve`` for an adapter's, the
    folder for the rest), None outside ``server/`` and for its package facade."""
    parts = module.split(".")
    if parts[1] != "server" or len(parts) < 4:
        return None
    if parts[2] == "protocols" and parts[3] in ADAPTERS:
        return f"protocols.{parts[3]}"
    return parts[2]


def _crossings(graph: dict[str, set[str]], rooms: bool = True) -> list[str]:
    """Every import from a ``server/`` folder to one above it, or between two adapters (with
    the folder of each side unless ``rooms`` is false)."""
    rank = {layer: i for i, layer in enumerate(SERVER_LAYERS)}
    found = []
    for source, targets in sorted(graph.items()):
        a = _room(source)
        if a is None:
            continue
        for target in sorted(targets):
            b = _room(target)
            if b is None or a == b:
                continue
            up = rank[b.split(".")[0]] < rank[a.split(".")[0]]
            across = a.startswith("protocols.") and b.startswith("protocols.")
            if up or across:
                found.append(
                    f"{source} ({a}) -> {target} ({b})" if rooms else f"{source} -> {target}"
                )
    return found


def test_server_folders_import_downwards_only() -> None:
    rooms = {p.name for p in (ROOT / "server").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(SERVER_LAYERS), "a server/ folder the layering does not place"
    assert _crossings(_graph()) == []


def test_the_layering_check_sees_an_upward_import_and_an_adapter_crossing() -> None:
    graph = {
        "plugserve.server.plane.dataplane": {"plugserve.server.control.model_control"},
        "plugserve.server.protocols.openai.serving": {"plugserve.server.protocols.kserve.rest"},
        "plugserve.server.protocols.kserve.rest": {"plugserve.server.protocols.http.sse"},
    }
    assert _crossings(graph) == [
        "plugserve.server.plane.dataplane (plane) -> plugserve.server.control.model_control "
        "(control)",
        "plugserve.server.protocols.openai.serving (protocols.openai) -> "
        "plugserve.server.protocols.kserve.rest (protocols.kserve)",
    ]


#: Today's type-only imports that point up a floor (issue 60, point 4): each names in its
#: types a module of a folder above it. The list only shrinks: move the type the import names
#: down (into the lower folder, or a ``Protocol`` there the upper one fills), then drop the line.
TYPE_ONLY_UPWARDS = {
    # the relay type an ensemble hands the networks table (apps -> plane)
    "plugserve.server.plane.networks -> plugserve.server.apps.pipelines.ensemble",
    # the OpenAI request the embeddings application reads (protocols -> apps)
    "plugserve.server.apps.generate.embeddings -> plugserve.server.protocols.openai.protocol",
    # the process's Settings the HTTP plumbing is built from (process -> protocols)
    "plugserve.server.protocols.http.app -> plugserve.server.process.settings",
}


def _floor_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Every edge that points up a floor: a ``server/`` folder to one above it, an adapter to
    another adapter, a plugin to the server."""
    found = _crossings(graph, rooms=False)
    found += [
        f"{source} -> {target}"
        for source, targets in sorted(graph.items())
        if source.startswith("plugserve.plugins.")
        for target in sorted(targets)
        if target.startswith("plugserve.server")
    ]
    return found


def test_type_only_imports_obey_the_floors() -> None:
    """A module depends on what it names in its types as on what it runs: the floors (protocols
    -> plane -> plugins, control and apps on the plane, no adapter on another, plugins never on
    the server) hold for type-only imports too, but for today's listed ones."""
    problems = exceptions_kept(
        _floor_breaks(_graph(type_only=True)),
        TYPE_ONLY_UPWARDS,
        rule="an import points up a floor",
        fix="move the import (or the type it names) down to the importer's floor or below; "
        "a lower floor declares a hook or a Protocol the higher one fills",
        where="TYPE_ONLY_UPWARDS in tests/plugins/test_layering.py",
    )
    assert not problems, "\n".join(problems)


#: Today's imports from the shared plumbing (``server/protocols/`` outside an adapter's folder:
#: ``http/``, ``grpc/``, ``status``, ``auth``) of an adapter. The list only shrinks.
PLUMBING_TO_ADAPTER: set[str] = set()


def _plumbing_to_adapters(graph: dict[str, set[str]]) -> list[str]:
    """Every import, type-only ones too, from the shared plumbing of an adapter."""
    return [
        f"{source} -> {target}"
        for source, targets in sorted(graph.items())
        if _room(source) == "protocols"
        for target in sorted(targets)
        if (_room(target) or "").startswith("protocols.")
    ]


def test_plumbing_imports_no_adapter() -> None:
    """What the adapters share (the HTTP server and router, the gRPC handlers, the status
    mapping, auth) knows none of them: an adapter registers its routes with it, never the other
    way round, so a face can be added or removed without touching the plumbing."""
    problems = exceptions_kept(
        _plumbing_to_adapters(_graph(type_only=True)),
        PLUMBING_TO_ADAPTER,
        rule="the protocols' plumbing imports an adapter",
        fix="let the adapter hand the plumbing what it needs (a callable, a route table) "
        "instead of the plumbing importing it",
        where="PLUMBING_TO_ADAPTER in tests/plugins/test_layering.py",
    )
    assert not problems, "\n".join(problems)


def test_the_floor_checks_see_type_only_imports_and_plumbing_pointing_at_an_adapter(
    tmp_path: Path,
) -> None:
    """The reader sees a ``TYPE_CHECKING`` import and a dotted string annotation, and each
    check reports a new break and a listed one that no longer occurs."""
    source = tmp_path / "sample.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from plugserve.server.control.core import Core\n"
        "def f(x: 'plugserve.server.apps.generate.engine.engine.Engine') -> None:\n"
        "    import plugserve.server.plane.request\n"
    )
    found = [(i.target, i.type_only, i.in_function)
             for i in imports("plugserve.server.plane.sample", source) if i.target]  # fmt: skip
    assert found == [
        ("plugserve.server.control.core", True, False),
        ("plugserve.server.apps.generate.engine.engine", True, False),
        ("plugserve.server.plane.request", False, True),
    ]
    graph = {
        "plugserve.server.plane.sample": {t for t, _, _ in found},
        "plugserve.plugins.numpy.plugin": {"plugserve.server.plane.request"},
        "plugserve.server.protocols.grpc.handlers": {"plugserve.server.protocols.v1.service"},
    }
    assert _floor_breaks(graph) == [
        "plugserve.server.plane.sample -> plugserve.server.apps.generate.engine.engine",
        "plugserve.server.plane.sample -> plugserve.server.control.core",
        "plugserve.plugins.numpy.plugin -> plugserve.server.plane.request",
    ]
    assert _plumbing_to_adapters(graph) == [
        "plugserve.server.protocols.grpc.handlers -> plugserve.server.protocols.v1.service"
    ]
    problems = exceptions_kept(
        ["a -> b", "c -> d"], ["c -> d", "e -> f"], rule="R", fix="F", where="W"
    )
    assert problems == [
        "R: a -> b\n    -> F",
        "R: e -> f is listed as an exception but no longer occurs\n"
        "    -> remove it from W (the list only shrinks)",
    ]


def test_plugins_import_plugserve_at_module_level_only() -> None:
    late = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in MODULES.items()
        if name.startswith("plugserve.plugins.")
        for _target, line, in_function in _imports(name, path)
        if in_function
    ]
    assert late == []


#: Names that hold a plugin, a compiled network, an infer request or the Core's devices.
_HOOK_OWNERS = {"plugin", "network", "net", "compiled", "request", "req", "child", "devices"}
#: Base classes whose instances are plugins, networks or requests (``self`` in their methods).
_HOOK_CLASSES = ("Plugin", "CompiledNetwork", "Network", "InferRequest", "Request", "OneNetwork")


def _owner(node: ast.expr) -> str | None:
    """The last name of ``node`` (``step.network`` -> ``network``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _owner(node.func)
    return None


def _hook_class(node: ast.ClassDef) -> bool:
    return any(
        (_owner(base) or "").endswith(_HOOK_CLASSES) for base in node.bases
    ) or node.name.endswith(_HOOK_CLASSES)


def _probes(tree: ast.AST) -> Iterator[ast.Call]:
    """``getattr`` / ``hasattr`` calls on a plugin, network or request."""

    def visit(node: ast.AST, in_hook_class: bool) -> Iterator[ast.Call]:
        for child in ast.iter_child_nodes(node):
            inner = _hook_class(child) if isinstance(child, ast.ClassDef) else in_hook_class
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id in ("getattr", "hasattr")
                and child.args
            ):
                owner = (_owner(child.args[0]) or "").lower()
                probed = owner == "self" and in_hook_class
                if probed or owner in _HOOK_OWNERS or owner.rstrip("s") in _HOOK_OWNERS:
                    yield child
            yield from visit(child, inner)

    yield from visit(tree, False)


def test_no_hook_is_probed() -> None:
    probes = [
        f"{path.relative_to(ROOT)}:{call.lineno} {ast.unparse(call)}"
        for path in MODULES.values()
        for call in _probes(tree(path))
    ]
    assert probes == []


def test_no_private_name_is_imported_across_modules() -> None:
    """A name one module imports from another is that module's public name."""
    private = [
        f"{path.relative_to(ROOT)}:{node.lineno} {alias.name} from {node.module}"
        for path in MODULES.values()
        for node in ast.walk(tree(path))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plugserve")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []
