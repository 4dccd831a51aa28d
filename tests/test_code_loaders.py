"""Every call that can run code a file or a byte string carries, held to a list.

What a client sends is data, never code (DESIGN.md, "Trust"; docs/security.md, "What runs code
and who may cause it"). Loaders that run code (pickle, ``torch.load`` without
``weights_only=True``, TorchScript's and torch.export's loaders, importing a file, ``exec``,
native libraries, starting programs, pickling channels to other processes) may only be reached
from the operator's files or the server's own. This test reads the code of ``plugins/`` and
``server/`` (their syntax trees, not their text: comments and strings do not count) and finds
each such call; every one must be in :data:`ALLOWED`, with why it is safe. A new call site fails
the test until someone writes down why it cannot be reached with a client's bytes; an entry
whose call is gone fails it too, so the list only says what is true.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("plugins", "server")

#: dotted names (matched on their last parts, so ``self.torch.jit.load`` is ``torch.jit.load``)
#: of calls that run code a file or bytes carry, or run a program
LOADERS = (
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "_pickle.load",
    "_pickle.loads",
    "dill.load",
    "dill.loads",
    "cloudpickle.load",
    "cloudpickle.loads",
    "joblib.load",
    "shelve.open",
    "marshal.load",
    "marshal.loads",
    "yaml.load",
    "yaml.unsafe_load",
    "torch.load",  # unless weights_only=True (below)
    "torch.jit.load",
    "torch.export.load",
    "torch.package.PackageImporter",
    "torch._C._pickle_load_obj",
    "torch.ops.load_library",
    "torch.classes.load_library",
    "torch.utils.cpp_extension.load",
    "torch.utils.cpp_extension.load_inline",
    "numpy.load",  # only with allow_pickle=True (below)
    "importlib.import_module",
    "importlib.util.spec_from_file_location",
    "importlib.machinery.SourceFileLoader",
    "runpy.run_path",
    "runpy.run_module",
    "ctypes.CDLL",
    "ctypes.PyDLL",
    "ctypes.cdll.LoadLibrary",
    "register_custom_ops_library",  # onnxruntime's SessionOptions
    "subprocess.Popen",
    "subprocess.run",
    "os.system",
    "os.execv",
    "os.execve",
    "os.execvp",
    "multiprocessing.Pool",
    "multiprocessing.Pipe",
    "multiprocessing.Queue",
    "ProcessPoolExecutor",  # pickles calls and results to and from its processes
)
#: builtins that run code given as text
BUILTINS = ("exec", "eval", "compile", "__import__")

#: (file, function, loader) -> why it cannot run a client's code. ``function`` is the enclosing
#: ``Class.method`` or function (``<module>`` at the top level).
ALLOWED = {
    # --- models: what a model carries
    ("plugins/torch/programs.py", "load_module", "torch.jit.load"): (
        "a PyTorch program loads here only with trusted=True (it raises PermissionDenied "
        "first otherwise): the Core's trusted loads are the model repository's on disk or "
        "--allow-code-from-clients (tests/server/test_no_code_from_clients.py)"
    ),
    ("plugins/torch/programs.py", "load_module", "torch.export.load"): (
        "as torch.jit.load above: torch.export.load unpickles an archive's pickled parts"
    ),
    (
        "server/apps/pipelines/python/worker.py",
        "_import",
        "importlib.util.spec_from_file_location",
    ): (
        "imports a Python model's model.py in its worker process; a PythonNetwork (which "
        "starts the workers) is made only by PythonPlugin.load_trusted, the repository's "
        "model.py or --allow-code-from-clients; load_network refuses"
    ),
    ("server/apps/pipelines/python/sandbox.py", "main", "runpy.run_path"): (
        "runs plugserve's own worker.py (beside it) in the model's sandboxed process"
    ),
    ("server/apps/pipelines/python/sandbox.py", "_libc", "ctypes.CDLL"): (
        "the C library (find_library('c')), for the sandbox's prctl and unshare"
    ),
    ("server/apps/pipelines/python/sandbox.py", "_watch", "os.execv"): (
        "/bin/sh with a fixed script that kills the model's process group when the server dies"
    ),
    ("plugins/workers.py", "Worker.__init__", "subprocess.Popen"): (
        "starts a helper process: the server's own interpreter running one of our modules "
        "(plugins/shape_worker.py, plugins/openvino/query_helper.py, server/apps/generate/"
        "text/grammar_check.py; the name is a constant at each call, the arguments ints): a "
        "client's model or grammar reaches it as data on stdin and is only read, checked or "
        "queried there, never run"
    ),
    ("server/apps/pipelines/python/process.py", "Spawner._run", "subprocess.Popen"): (
        "starts a Python model's worker with the interpreter its config.pbtxt names "
        "(EXECUTION_ENV_PATH): a client's config may not name one (ModelControl."
        "refuse_code_keys), so it is the repository's, or the server's own Python"
    ),
    # --- the operator's configuration
    ("server/process/app.py", "Server._configure_plugins", "importlib.import_module"): (
        "a custom op's module named in the --plugins file, which is the operator's"
    ),
    # --- native libraries at fixed names
    ("plugins/numpy/blas.py", "_load", "ctypes.CDLL"): (
        "the BLAS library numpy itself was built with (numpy's own config names it)"
    ),
    ("plugins/memory.py", "_libc", "ctypes.CDLL"): "the C library (find_library('c'))",
    ("plugins/ort/locales.py", "available", "ctypes.CDLL"): "the process itself (None)",
    ("plugins/ort/held.py", "_Api.__init__", "ctypes.PyDLL"): (
        "onnxruntime's own library, found beside its installed Python binding"
    ),
    ("plugins/torch/capture.py", "_driver", "ctypes.CDLL"): "the CUDA driver, libcuda.so.1",
    ("server/control/allocator.py", "_glibc", "ctypes.CDLL"): "the C library, for mallopt",
    ("server/plane/cuda_shm.py", "_driver", "ctypes.CDLL"): "the CUDA driver, libcuda.so.1",
    ("server/plane/cuda_shm.py", "_runtime", "ctypes.CDLL"): (
        "the CUDA runtime, found in torch's or NVIDIA's installed packages (no client path)"
    ),
    # --- pickling channels between the server and its own processes
    ("server/protocols/http/offload.py", "_helpers", "ProcessPoolExecutor"): (
        "the server's own JSON helper: it pickles what it built (arrays, numbers) from a "
        "client's JSON, never bytes a client sent, and the server unpickles only that"
    ),
    ("server/protocols/http/offload.py", "call", "pickle.loads"): (
        "the same helper's result, pickled there by _call_in_helper from what our function "
        "returned (values parsed from a client's JSON, never its bytes), read back from its "
        "pipe or from a segment of the server's user (mode 0600) in the host's /dev/shm, "
        "which a Python model's process does not see (a /dev/shm of its own: sandbox.py)"
    ),
}


def _names(tree: ast.Module) -> dict[str, str]:
    """What each imported name stands for (``np`` -> ``numpy``, ``loads`` -> ``pickle.loads``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(names.get(node.id, node.id))
    elif isinstance(node, ast.Call):  # ``a().b()``: what ``b`` is on
        parts.append(_dotted(node.func, names) + "()")
    else:
        return ""
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str) -> object:
    for keyword in call.keywords:
        if keyword.arg == name and isinstance(keyword.value, ast.Constant):
            return keyword.value.value
    return None


def _loader(call: ast.Call, names: dict[str, str]) -> str:
    """The loader ``call`` is ("" when none)."""
    if isinstance(call.func, ast.Name) and call.func.id in BUILTINS and call.func.id not in names:
        return call.func.id
    dotted = _dotted(call.func, names)
    for loader in LOADERS:
        if (
            dotted == loader
            or dotted.endswith("." + loader)
            or ("." not in loader and dotted.rsplit(".", 1)[-1] == loader)
        ):
            if loader == "torch.load" and _keyword(call, "weights_only") is True:
                return ""
            if loader == "numpy.load" and _keyword(call, "allow_pickle") is not True:
                return ""
            return loader
    return ""


def call_sites(source: str, where: str) -> set[tuple[str, str, str]]:
    """``(where, enclosing function, loader)`` for every loader called in ``source``."""
    tree = ast.parse(source)
    names = _names(tree)
    found: set[tuple[str, str, str]] = set()

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, [*scope, f"class {child.name}"])
                continue
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Call):
                loader = _loader(child, names)
                if loader:
                    function = _function(scope)
                    found.add((where, function, loader))
            visit(child, scope)

    visit(tree, [])
    return found


def _function(scope: list[str]) -> str:
    """``Class.method`` or ``function`` (a nested function is its outer one's call site)."""
    classes = [s.removeprefix("class ") for s in scope if s.startswith("class ")]
    functions = [s for s in scope if not s.startswith("class ")]
    if not functions:
        return ".".join(classes) or "<module>"
    outer = scope.index(functions[0])
    return ".".join([*(s.removeprefix("class ") for s in scope[:outer]), functions[0]])


def _scan() -> set[tuple[str, str, str]]:
    found: set[tuple[str, str, str]] = set()
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            where = path.relative_to(ROOT).as_posix()
            found |= call_sites(path.read_text(encoding="utf-8"), where)
    return found


def test_every_code_loader_call_is_on_the_list():
    found = _scan()
    new = sorted(found - ALLOWED.keys())
    gone = sorted(ALLOWED.keys() - found)
    assert not new, (
        "calls that can run code a file or bytes carry, not on tests/test_code_loaders.py's "
        "list: make sure a client's bytes cannot reach them (docs/security.md, 'What runs "
        "code and who may cause it'), then add each with why:\n"
        + "\n".join(f"  {site}" for site in new)
    )
    assert not gone, "listed calls that are no longer in the code: remove them:\n" + "\n".join(
        f"  {site}" for site in gone
    )


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import pickle\ndef f(b):\n    return pickle.loads(b)\n", {("f", "pickle.loads")}),
        ("from pickle import loads as l\nl(b)\n", {("<module>", "pickle.loads")}),
        ("def f(torch, b):\n    return torch.load(b)\n", {("f", "torch.load")}),
        ("def f(torch, b):\n    return torch.load(b, weights_only=True)\n", set()),
        ("def f(torch, b):\n    return torch.load(b, weights_only=False)\n", {("f", "torch.load")}),
        (
            "class P:\n    def g(self, b):\n        return self.torch.jit.load(b)\n",
            {("P.g", "torch.jit.load")},
        ),
        ("import numpy as np\nnp.load(f)\n", set()),
        ("import numpy as np\nnp.load(f, allow_pickle=True)\n", {("<module>", "numpy.load")}),
        ("exec(text)\n", {("<module>", "exec")}),
        (
            "import importlib\nimportlib.import_module(name)\n",
            {("<module>", "importlib.import_module")},
        ),
        ("import ctypes\nctypes.CDLL(path)\n", {("<module>", "ctypes.CDLL")}),
        (
            "options.register_custom_ops_library(path)\n",
            {("<module>", "register_custom_ops_library")},
        ),
        ("json.loads(text)\n", set()),
    ],
)
def test_the_scan_finds_loaders(source, found):
    """The reader itself: what it must find, and what is safe (so the list means something)."""
    assert {(f, loader) for _, f, loader in call_sites(source, "x.py")} == found


def test_an_untrusted_program_is_refused_before_torch_is_touched():
    """The listed program loader refuses without trust before it reaches torch (``torch`` is
    None here: any use of it would raise AttributeError, not PermissionDenied)."""
    from plugserve.plugins.api import PermissionDenied
    from plugserve.plugins.torch.programs import EXPORT, TORCHSCRIPT, load_module

    for kind in (TORCHSCRIPT, EXPORT):
        with pytest.raises(PermissionDenied, match="runs the code it carries"):
            load_module(b"PK\x03\x04", kind, None, None, "sent", trusted=False)


def test_a_python_model_is_loaded_only_when_trusted(tmp_path):
    """PYTHON's load_network (anyone's) refuses a model.py before anything runs it."""
    from plugserve.plugins.api import PermissionDenied
    from plugserve.server.apps.pipelines.python.device import PythonPlugin

    model = tmp_path / "sent" / "1" / "model.py"
    model.parent.mkdir(parents=True)
    marker = tmp_path / "ran"
    model.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(PermissionDenied, match=r"model\.py is code"):
        PythonPlugin().load_network(str(model))
    assert not marker.exists()
