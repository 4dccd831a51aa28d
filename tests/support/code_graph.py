"""plugserve's own source read with ``ast``: its modules, every import in them, and the lists of
today's exceptions to a house rule (``tests/plugins/test_layering.py``, ``tests/test_house.py``).

An import is read wherever it is written: at module level, inside a function, under
``if TYPE_CHECKING:`` (a *type-only* import) or as a dotted ``plugserve.`` name in a string
annotation (type-only too). Each rule picks what it counts: a circle needs runtime edges, a
floor counts type-only ones as well (what a module names in its types is what it depends on).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The folders mapped into the ``plugserve`` namespace (pyproject's ``package-dir``), by the
#: package each is (``rayserve/`` is ``plugserve.ray``: a folder named ``ray`` at the top of a
#: checkout would be imported as Ray itself by whatever runs there). ``proto/`` is generated.
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


#: ``{dotted module name: its file}`` for every module of the folders above
MODULES = _modules()


@dataclass(frozen=True)
class Import:
    """One import in a module."""

    #: the absolute dotted name as written (a relative import resolved; for
    #: ``from m import n`` it is ``m.n`` where that is a module, else ``m``)
    module: str
    #: the plugserve module it reaches (the longest known prefix), None for another package's
    target: str | None
    line: int
    #: written inside a function (runs when the function is called)
    in_function: bool
    #: under ``if TYPE_CHECKING:`` or in a string annotation (never runs)
    type_only: bool


def rel(path: Path) -> str:
    """``path`` as the checkout names it (``server/plane/request.py``)."""
    return path.relative_to(ROOT).as_posix()


@cache
def tree(path: Path) -> ast.Module:
    """The parsed file (read once per run: the house tests share it)."""
    return ast.parse(path.read_text(), str(path))


def known(dotted: str) -> str | None:
    """The plugserve module ``dotted`` names or lies in (its longest known prefix)."""
    while dotted:
        if dotted in MODULES:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _annotations(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.arg | ast.AnnAssign):
        return [node.annotation] if node.annotation is not None else []
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return [node.returns] if node.returns is not None else []
    return []


_DOTTED = re.compile(r"\bplugserve(?:\.[A-Za-z_]\w*)+")


def _walk(root: ast.AST) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node with whether it is inside a function and whether it is type-only."""

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> Iterator:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for inner in child.body:
                    yield inner, in_function, True
                    yield from visit(inner, in_function, True)
                for other in child.orelse:
                    yield other, in_function, type_only
                    yield from visit(other, in_function, type_only)
                continue
            inner_function = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            yield child, inner_function, type_only
            yield from visit(child, inner_function, type_only)

    yield from visit(root, False, False)


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


@cache
def imports(name: str, path: Path) -> tuple[Import, ...]:
    """Every import in module ``name`` (file ``path``), type-only ones included (read once)."""
    return tuple(_imports(name, path))


def _imports(name: str, path: Path) -> Iterator[Import]:
    for node, in_function, type_only in _walk(tree(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, known(alias.name), node.lineno, in_function, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package(name, path).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                module = full if full in MODULES else base
                yield Import(module, known(module), node.lineno, in_function, type_only)
        for annotation in _annotations(node):
            for text in ast.walk(annotation):
                if isinstance(text, ast.Constant) and isinstance(text.value, str):
                    for dotted in _DOTTED.findall(text.value):
                        line = getattr(text, "lineno", node.lineno)
                        # never evaluated: no more "in a function" than at module level
                        yield Import(dotted, known(dotted), line, False, True)


def exceptions_kept(
    found: Iterable[str], listed: Iterable[str], *, rule: str, fix: str, where: str
) -> list[str]:
    """What breaks a rule whose today's exceptions are ``listed``: each finding not on the list
    (a new violation: ``fix`` says how to mend it) and each listed exception no longer found
    (it was fixed: the list shrinks with the code, so a later change cannot bring it back)."""
    found, listed = set(found), set(listed)
    problems = [f"{rule}: {item}\n    -> {fix}" for item in sorted(found - listed)]
    problems += [
        f"{rule}: {item} is listed as an exception but no longer occurs\n"
        f"    -> remove it from {where} (the list only shrinks)"
        for item in sorted(listed - found)
    ]
    return problems
