"""The house rules beyond the server's arrows (issue 60, point 4), read with ``ast``.

``tests/plugins/test_layering.py`` holds the arrows (the server's floors, type-only imports
included, and the plumbing that imports no adapter); this file holds the rest:

- The top level of the checkout holds the design card's folders and the project's few files.
- The server imports a device's face only: no module of ``server/`` imports torch, nor a module
  inside a device package (``plugins/<device>/``) other than its face: the package itself
  (``__init__``) and its ``serving.py``, what the device offers the server.
- No module over 1,000 lines, no function over 100 (generated ``_pb2`` code and NUMPY's kernels
  aside).
- A module that makes a logger (``log = logging.getLogger(__name__)``) logs with it: five
  modules once carried one they never used.

Each rule starts from a list of today's exceptions that can only shrink: a new break fails, and
so does a listed one that no longer occurs (drop it from the list as the code is fixed, so it
cannot come back). A listed module or function may not grow either: one past the bound is split
in the change that grows it (DESIGN.md, "The next step of the house").
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from code_graph import FOLDERS, MODULES, ROOT, exceptions_kept, imports, rel, tree

# -- the top level ---------------------------------------------------------------------------

#: The design card's layout: the packaging, the generated protocol, the packages and the rest
#: of its table (DESIGN.md, "Layout"); the folders pyproject's ``package-dir`` maps into
#: ``plugserve`` (``code_graph.FOLDERS``: conformance, rayserve) join them.
CARD = {"pyproject.toml", "proto", "plugins", "server", "client", "deploy", "tests"}
#: What the project keeps beside them, each for a reason.
BESIDE = {
    "README.md": "the front page",
    "BENCHMARKS.md": "the measured figures (DESIGN.md: speed is shown by benchmarks)",
    ".gitignore": "what a run leaves that git must not see",
    "docs": "the user's and operator's documentation",
    "benchmarks": "recorded benchmark runs, whole, that BENCHMARKS.md cites",
    ".ci": "the CI's scripts",
}


def _top_level() -> set[str]:
    """The checkout's top-level names as a clone has them (tracked files, and new ones git does
    not ignore: a folder made but not yet added counts)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (git ls-files names what a clone has)")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    return {name.split("/")[0] for name in listed if name and (ROOT / name).exists()}


def test_the_top_level_holds_the_design_cards_folders_only() -> None:
    problems = exceptions_kept(
        _top_level(),
        CARD | set(FOLDERS) | set(BESIDE),
        rule="a top-level entry the design card does not name",
        fix="put it under the folder whose job it is (tests/support, deploy, docs, a package); "
        "a new package folder is mapped in pyproject's package-dir, code_graph.FOLDERS and "
        "DESIGN.md's layout",
        where="CARD or BESIDE in tests/test_house.py",
    )
    assert not problems, "\n".join(problems)


# -- the server imports a device's face only -------------------------------------------------

#: Packages of ``plugins/`` that are no device: the transformation passes every device runs.
NOT_DEVICES = {"passes"}
#: A device package's modules the server may import: the package and its face for the server.
FACE = ("", "serving")

#: Today's modules of ``server/`` that import torch (none: the safetensors decoder, its model
#: and sampler are the torch device's, ``plugins/torch/decoder.py``, reached through the
#: Plugin API's decoder and ``Plugin.load_decoder``; the engine's pipelined step asks the
#: decoder, issue 60).
TORCH_IN_SERVER: set[str] = set()
#: Today's imports of a device's inside from ``server/`` (none: CUDA shared memory asks
#: ``plugins/cuda.py``).
DEVICE_INSIDES: set[str] = set()


def _devices() -> set[str]:
    return {p.parent.name for p in (ROOT / "plugins").glob("*/__init__.py")} - NOT_DEVICES


def _inside(target: str, devices: set[str]) -> bool:
    """Whether ``target`` is a module inside a device package other than its face."""
    parts = target.split(".")
    if parts[:2] != ["plugserve", "plugins"] or len(parts) < 4 or parts[2] not in devices:
        return False
    return ".".join(parts[3:]) not in FACE


def _reach(name: str, path: Path, devices: set[str]) -> Iterator[str]:
    """``torch`` and each device inside module ``name`` imports, every import counted: at
    module level, in a function, type-only."""
    for found in imports(name, path):
        if found.module == "torch" or found.module.startswith("torch."):
            yield "torch"
        if found.target is not None and _inside(found.target, devices):
            yield found.target


def _server_reach(devices: set[str]) -> tuple[set[str], set[str]]:
    """``(files of server/ importing torch, "file -> device module" for each inside import)``"""
    torch, insides = set(), set()
    for name, path in MODULES.items():
        if name.startswith("plugserve.server."):
            for target in _reach(name, path, devices):
                if target == "torch":
                    torch.add(rel(path))
                else:
                    insides.add(f"{rel(path)} -> {target}")
    return torch, insides


def test_the_server_imports_a_devices_face_only() -> None:
    torch, insides = _server_reach(_devices())
    problems = exceptions_kept(
        torch,
        TORCH_IN_SERVER,
        rule="a server module imports torch",
        fix="torch belongs to its device: move the code to plugins/torch/ and call it through "
        "the Plugin API or plugins/torch/serving.py",
        where="TORCH_IN_SERVER in tests/test_house.py",
    )
    problems += exceptions_kept(
        insides,
        DEVICE_INSIDES,
        rule="a server module imports a device's inside",
        fix="import the device package itself or its serving.py (its face for the server); "
        "add what the server needs there",
        where="DEVICE_INSIDES in tests/test_house.py",
    )
    assert not problems, "\n".join(problems)


# -- sizes -------------------------------------------------------------------------------------

MODULE_LINES = 1000
FUNCTION_LINES = 100
#: Today's modules over 1,000 lines, each with its length today: the ceiling it may not pass.
LONG_MODULES: dict[str, int] = {}
#: Today's functions over 100 lines (``file::qualified name``), each with its length today.
LONG_FUNCTIONS: dict[str, int] = {}


def _sized() -> Iterator[Path]:
    """The modules the size rules read: all but generated code and NUMPY's kernels (written
    out whole, one loop nest per op, where splitting would hide the arithmetic)."""
    for path in MODULES.values():
        name = rel(path)
        if not name.endswith(("_pb2.py", "_pb2_grpc.py")) and "/numpy/kernels/" not in name:
            yield path


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """``(qualified name, lines)`` for every function in ``node``, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child.end_lineno - child.lineno + 1
            yield from _functions(child, f"{name}.")
        else:
            yield from _functions(child, prefix)


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    modules, functions = {}, {}
    for path in _sized():
        lines = path.read_text().count("\n")
        if lines > MODULE_LINES:
            modules[rel(path)] = lines
        for name, length in _functions(tree(path)):
            if length > FUNCTION_LINES:
                functions[f"{rel(path)}::{name}"] = length
    return modules, functions


def _over(found: dict[str, int], ceilings: dict[str, int], what: str, fix: str) -> list[str]:
    """The listed ones grown past their ceiling."""
    return [
        f"{name} grew from {ceilings[name]} to {found[name]} lines, past the {what} bound\n"
        f"    -> {fix}"
        for name in sorted(found.keys() & ceilings.keys())
        if found[name] > ceilings[name]
    ]


def test_no_module_over_1000_lines_and_no_function_over_100() -> None:
    modules, functions = _sizes()
    where = "in tests/test_house.py"
    problems = exceptions_kept(
        modules,
        LONG_MODULES,
        rule=f"a module over {MODULE_LINES:,} lines",
        fix="split it by job into modules of its folder (one job per module)",
        where=f"LONG_MODULES {where}",
    )
    problems += _over(modules, LONG_MODULES, "module", "split it in the change that grows it")
    problems += exceptions_kept(
        functions,
        LONG_FUNCTIONS,
        rule=f"a function over {FUNCTION_LINES} lines",
        fix="split it into named steps (small functions, a table of them)",
        where=f"LONG_FUNCTIONS {where}",
    )
    problems += _over(functions, LONG_FUNCTIONS, "function", "split it in the change that grows it")
    # a listed one that shrank but is still over the bound: lower its ceiling to hold the gain
    problems += [
        f"{name} is {found[name]} lines, its ceiling {ceilings[name]}\n"
        f"    -> lower its ceiling to {found[name]} in {label} {where}"
        for found, ceilings, label in (
            (modules, LONG_MODULES, "LONG_MODULES"),
            (functions, LONG_FUNCTIONS, "LONG_FUNCTIONS"),
        )
        for name in sorted(found.keys() & ceilings.keys())
        if found[name] < ceilings[name]
    ]
    assert not problems, "\n".join(problems)


def test_the_house_checks_see_a_break(tmp_path: Path) -> None:
    """Each check finds what it is for, on a sample: a device's inside and torch reached from
    the server, a long function nested in a class, the ceilings."""
    devices = {"torch", "numpy"}
    assert not _inside("plugserve.plugins.torch", devices)
    assert not _inside("plugserve.plugins.torch.serving", devices)
    assert not _inside("plugserve.plugins.api", devices)
    assert not _inside("plugserve.plugins.passes.fold", devices)
    assert _inside("plugserve.plugins.torch.devmem", devices)
    assert _inside("plugserve.plugins.numpy.kernels.conv", devices)
    reaching = tmp_path / "reaching.py"
    reaching.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from torch import Tensor\n"
        "from ...plugins.torch import devmem, serving\n"
        "def f() -> None:\n"
        "    import torch.cuda\n"
    )
    assert list(_reach("plugserve.server.plane.reaching", reaching, devices)) == [
        "torch",
        "plugserve.plugins.torch.devmem",
        "torch",
    ]
    sample = tmp_path / "sample.py"
    body = "\n".join(f"        x = {i}" for i in range(FUNCTION_LINES))
    sample.write_text(
        f"class A:\n    def long(self):\n{body}\n    def short(self):\n        pass\n"
    )
    assert dict(_functions(ast.parse(sample.read_text()))) == {
        "A.long": FUNCTION_LINES + 1,
        "A.short": 2,
    }
    assert _over({"m": 1200, "n": 1100}, {"m": 1100, "n": 1100}, "module", "F") == [
        "m grew from 1100 to 1200 lines, past the module bound\n    -> F"
    ]
    assert _unused_logger(ast.parse("import logging\nlog = logging.getLogger(__name__)\n"))
    assert not _unused_logger(
        ast.parse(
            "import logging\nlog = logging.getLogger(__name__)\ndef f():\n    log.info('x')\n"
        )
    )


# -- loggers ---------------------------------------------------------------------------------


def _unused_logger(module: ast.Module) -> bool:
    """The module binds ``log`` at its top level and never reads an attribute of it."""
    made = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "log" for t in node.targets)
        for node in module.body
    )
    used = any(
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "log"
        for node in ast.walk(module)
    )
    return made and not used


def test_a_module_that_makes_a_logger_uses_it() -> None:
    unused = sorted(rel(path) for path in MODULES.values() if _unused_logger(tree(path)))
    assert not unused, "a logger nobody logs with (drop it, and its import): " + ", ".join(unused)
