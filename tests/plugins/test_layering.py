"""The shape of the code itself (issues 25 and 43), read with ``ast`` so it cannot drift back.

- ``server/`` is laid out by its layers, and the arrows between its folders run one way:
  ``process`` (the server process) above ``protocols`` (adapters and their plumbing), above
  ``apps`` (generation, Python models, ensembles), above ``control`` (what is loaded), above
  ``plane`` (the request path); a folder imports only its own modules and those of folders
  below it (so no circle can join two folders), and no protocol adapter (``kserve``,
  ``openai``, ``v1``) imports another: what they share (the gRPC and HTTP plumbing, the status
  mapping, auth) is its own module.
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

ROOT = Path(__file__).resolve().parents[2]
#: The folders mapped into the ``plugserve`` namespace (pyproject's ``package-dir``), by the
#: package each is (``rayserve/`` is ``plugserve.ray``: a folder named ``ray`` at the top of a
#: checkout would be imported as Ray itself by whatever runs there).
FOLDERS = {
    "plugins": "plugins",
    "server": "server",
    "client": "client",
    "conformance": "conformance",
    "rayserve": "ray",
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(["plugserve", package, *parts])] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node outside ``if TYPE_CHECKING:`` blocks, with whether it is inside a function."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    yield from visit(other, in_function)
                continue
            inner = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            yield child, inner
            yield from visit(child, inner)

    yield from visit(tree, False)


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: Path) -> Iterator[tuple[str, int, bool]]:
    """``(plugserve module imported, line, inside a function)`` for each import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    for node, in_function in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("plugserve"):
                    yield _resolve(alias.name), node.lineno, in_function
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package(name, path).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith("plugserve"):
                continue
            for alias in node.names:
                yield _resolve(f"{base}.{alias.name}", base), node.lineno, in_function


def _resolve(dotted: str, fallback: str | None = None) -> str:
    """The module ``dotted`` names, or (for ``from m import name``) ``m`` itself."""
    if dotted in MODULES:
        return dotted
    return fallback if fallback is not None else dotted


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _line, _in_function in _imports(name, path):
            if target in MODULES and target != name:
                graph[name].add(target)
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


def _crossings(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a ``server/`` folder to one above it, or between two adapters."""
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
                found.append(f"{source} ({a}) -> {target} ({b})")
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
        for call in _probes(ast.parse(path.read_text(), str(path)))
    ]
    assert probes == []


def test_no_private_name_is_imported_across_modules() -> None:
    """A name one module imports from another is that module's public name."""
    private = [
        f"{path.relative_to(ROOT)}:{node.lineno} {alias.name} from {node.module}"
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plugserve")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []
