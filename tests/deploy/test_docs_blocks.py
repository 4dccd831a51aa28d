"""Every fenced shell and Python block of README.md and docs/*.md, run as a reader pastes them:
in order, on a fresh copy of the checkout, against real servers the blocks themselves start.

How a document is run (one test per document):

- The checkout's files (``git ls-files``: tracked, and new ones not ignored) are copied to a
  temporary folder, which is each block's working directory; the installed ``plugserve`` and
  this interpreter's ``python`` are on PATH.
- Shell blocks (``bash``, ``sh``) run with ``bash -e -o pipefail``, Python blocks as a script
  of their own (each must stand alone, as one pasted into a fresh interpreter).
- ``pip install ...`` lines are checked, not run: a ``pip`` on PATH says whether what the line
  names (``-e '.[all]'`` is the checkout's extras) is installed in this environment with a
  version the line allows, and fails the block when not. Running them would take minutes and
  the internet; tests/deploy/test_install_report.py resolves README's own installs.
- ``curl`` gets ``--fail-with-body``, so an HTTP error fails its block.
- Marks, HTML comments on the lines just above a fence (``<!-- docs: ... -->``):
  ``server``: the block starts a server; it runs in the background until the document's next
  server block or its end, and the blocks after it run once its log says ``server ready:``.
  ``file PATH``: the block is a file's text, written to PATH (a model.py, a plugins file).
  ``skip CATEGORY: WHY``: not run, only parsed (``bash -n``, ``compile``); CATEGORY is one of
  :data:`SKIPS` (internet, cluster, the suite itself, an excerpt of a file, a benchmark of
  minutes) and WHY says why.
  Other comments (``<!-- openai-example -->``, which tests/generate/test_openai_curl.py reads)
  are left alone.
- Ports: a server started by a block listens where the reader's would, on 8000 (REST), 8001
  (gRPC) and 8002 (metrics), when all three are free here; else (another test's server, another
  engineer's) on three free ports, given to ``plugserve serve`` through PLUGSERVE_HTTP_PORT,
  PLUGSERVE_GRPC_PORT and PLUGSERVE_METRICS_PORT and to client verbs through PLUGSERVE_TARGET,
  and written into the blocks' text in place of ``:8000``, ``:8001`` and ``:8002``. Servers
  listen on 127.0.0.1 only (PLUGSERVE_HOST).

Bounds: a block may take :data:`BLOCK_SECONDS`, a server :data:`READY_SECONDS` to be ready;
every server a block started is stopped (its process group) when its document ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from checkout import copy_checkout

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
#: why a block may be left out, and what each means
SKIPS = {
    "internet": "downloads from outside PyPI's packages this test has (a model hub, a venv)",
    "cluster": "needs Kubernetes or another machine",
    "suite": "runs the test suite this test is part of",
    "excerpt": "lines of a larger file (a model.py's methods) that the test it names runs",
    "benchmark": "a benchmark of minutes (some against a virtual environment of an older "
    "commit) whose numbers the page records",
}
BLOCK_SECONDS = 300
READY_SECONDS = 180
READER_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```",
                    re.M | re.S)  # fmt: skip
_MARK = re.compile(r"<!--\s*docs:\s*(?P<mark>.*?)\s*-->")


@dataclass
class Block:
    doc: Path
    line: int
    language: str
    code: str
    marks: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def mark(self, prefix: str) -> str | None:
        return next((m for m in self.marks if m.split(" ", 1)[0].rstrip(":") == prefix), None)


def blocks(doc: Path) -> list[Block]:
    """The document's fenced blocks with the marks on the comment lines just above each."""
    text = doc.read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].splitlines()
        marks = []
        while before and before[-1].strip().startswith("<!--"):
            mark = _MARK.search(before.pop())
            if mark:
                marks.insert(0, mark.group("mark"))
        code = "\n".join(
            line[len(match.group("indent")) :] for line in match.group("code").splitlines()
        )
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(doc, line, match.group("lang").lower(), code + "\n", marks))
    return found


def _runnable(block: Block) -> bool:
    return block.language in SHELL | PYTHON


# --- the environment the blocks run in

PIP = '''#!{python}
"""pip install as the docs test runs it: checks that what the line names is installed."""
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement


def extras_of(spec):
    match = re.fullmatch(r"\\.?/?(?:\\[(.*)\\])?", spec.strip("'\\""))
    if match is None:
        return None
    return [e.strip() for e in (match.group(1) or "").split(",") if e.strip()]


def requirements(extras):
    """plugserve's requirements with these extras (an extra naming plugserve[...] unfolded)."""
    out, todo, done = [], ["", *extras], set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for text in md.requires("plugserve") or []:
            req = Requirement(text)
            if (req.marker is None) != (extra == ""):
                continue
            if req.marker is not None and not req.marker.evaluate({{"extra": extra}}):
                continue
            if req.name == "plugserve":
                todo += sorted(req.extras)
            else:
                out.append(req)
    return out


def missing(req):
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        return f"{{req}} is not installed"
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return f"{{req}}: {{version}} is installed"
    return None


args = sys.argv[1:]
if not args or args[0] != "install":
    sys.exit(f"pip (docs test): only 'pip install' is checked, not {{' '.join(args)}}")
problems, wanted = [], []
for arg in args[1:]:
    if arg in ("-e", "--editable", "-q", "--quiet", "-U", "--upgrade"):
        continue
    extras = extras_of(arg)
    if extras is not None:
        wanted += requirements(extras)
        continue
    if arg.startswith("-"):
        sys.exit(f"pip (docs test): option {{arg}} is not understood here")
    wanted.append(Requirement(arg))
problems += [p for p in map(missing, wanted) if p]
if problems:
    sys.exit("pip (docs test): " + "; ".join(problems))
print(f"pip (docs test): {{len(wanted)}} requirement(s) already installed")
'''

CURL = """#!/bin/sh
exec {curl} --fail-with-body "$@"
"""


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _any_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reader:
    """A reader's shell: the checkout copy, PATH, ports, and the servers blocks started."""

    folder: Path
    env: dict[str, str]
    ports: dict[str, int]
    servers: list[tuple[subprocess.Popen, Path]] = field(default_factory=list)

    def text(self, code: str) -> str:
        for kind, port in READER_PORTS.items():
            code = re.sub(rf"(?<=[\w.\]]):{port}\b", f":{self.ports[kind]}", code)
        return code

    def run(self, block: Block) -> None:
        code = self.text(block.code)
        if block.mark("file"):
            path = self.folder / block.mark("file").split(" ", 1)[1].strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code)
            return
        if block.mark("server"):
            self.stop_servers()
            self.start_server(block, code)
            return
        if block.language in PYTHON:
            script = self.folder / f".docs-block-{block.line}.py"
            script.write_text(code)
            argv = [sys.executable, script.name]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", code]
        try:
            done = subprocess.run(argv, cwd=self.folder, env=self.env, capture_output=True,
                                  text=True, timeout=BLOCK_SECONDS)  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: still running after {BLOCK_SECONDS} s:\n{code}")
        assert done.returncode == 0 and "Traceback" not in done.stderr, (
            f"{block.where} failed ({done.returncode}):\n{code}\n--- stdout\n{done.stdout}"
            f"\n--- stderr\n{done.stderr}\n{self.server_logs()}"
        )

    def start_server(self, block: Block, code: str) -> None:
        log = self.folder / f".docs-server-{block.line}.log"
        with log.open("w") as out:
            process = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", "-c", code],
                cwd=self.folder,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.servers.append((process, log))
        end = time.monotonic() + READY_SECONDS
        while time.monotonic() < end:
            if process.poll() is not None:
                pytest.fail(f"{block.where}: the server exited ({process.returncode}):\n"
                            f"{code}\n{log.read_text()}")  # fmt: skip
            # its log says so (a TLS or token-guarded server answers no plain health check)
            if "server ready:" in log.read_text():
                return
            time.sleep(0.2)
        pytest.fail(f"{block.where}: not ready in {READY_SECONDS} s:\n{log.read_text()}")

    def server_logs(self) -> str:
        return "\n".join(f"--- server log\n{log.read_text()[-4000:]}" for _, log in self.servers)

    def stop_servers(self) -> None:
        while self.servers:
            process, _ = self.servers.pop()
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(10)
        # the ports are free again before the next server asks for them
        end = time.monotonic() + 10
        while time.monotonic() < end and not all(_free(p) for p in self.ports.values()):
            time.sleep(0.1)


@pytest.fixture
def reader(tmp_path):
    folder = copy_checkout(tmp_path / "clone")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "pip").write_text(PIP.format(python=sys.executable))
    curl = shutil.which("curl")
    if curl is not None:
        (tools / "curl").write_text(CURL.format(curl=curl))
    for tool in tools.iterdir():
        tool.chmod(0o755)
    ours = Path(sys.executable).parent
    if all(_free(p) for p in READER_PORTS.values()):
        ports = dict(READER_PORTS)
    else:
        ports = {kind: _any_port() for kind in READER_PORTS}
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(tools), str(ours), os.environ.get("PATH", "")]),
        "PLUGSERVE_HOST": "127.0.0.1",
        "PLUGSERVE_HTTP_PORT": str(ports["http"]),
        "PLUGSERVE_GRPC_PORT": str(ports["grpc"]),
        "PLUGSERVE_METRICS_PORT": str(ports["metrics"]),
        "PLUGSERVE_TARGET": f"127.0.0.1:{ports['grpc']}",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("PYTHONPATH", None)
    running = Reader(folder, env, ports)
    try:
        yield running
    finally:
        running.stop_servers()


def _skip_reason(block: Block) -> str | None:
    mark = block.mark("skip")
    if mark is None:
        return None
    category, _, why = mark.partition(" ")[2].partition(":")
    assert category in SKIPS and why.strip(), (
        f"{block.where}: a skip says its category ({', '.join(SKIPS)}) and why: {mark!r}"
    )
    return f"{category}: {why.strip()}"


def _parses(block: Block) -> None:
    if block.language in PYTHON:
        compile(block.code, block.where, "exec")
    else:
        done = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True,
                              timeout=30)  # fmt: skip
        assert done.returncode == 0, f"{block.where}: not valid shell: {done.stderr}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_block_runs_as_pasted(doc, reader, record_property):
    if shutil.which("curl") is None:
        pytest.skip("the docs' examples use curl: apt-get install curl")
    found = blocks(doc)
    skipped = []
    for block in found:
        reason = _skip_reason(block)
        if reason is not None:
            if _runnable(block):
                _parses(block)
            skipped.append(f"{block.where}: {reason}")
            continue
        if _runnable(block) or block.mark("file"):
            reader.run(block)
    record_property("skipped", skipped)
    for line in skipped:
        print("not run:", line)


def test_the_marks_are_known_and_the_docs_have_blocks():
    """A mark this test does not know would be ignored silently: every mark is one of its
    kinds, and README holds the blocks a reader meets first."""
    for doc in DOCS:
        for block in blocks(doc):
            for mark in block.marks:
                kind = mark.split(" ", 1)[0].rstrip(":")
                assert kind in ("server", "file", "skip"), f"{block.where}: unknown mark {mark!r}"
            _skip_reason(block)
            if block.mark("server"):
                assert block.language in SHELL, f"{block.where}: a server block is shell"
    readme = blocks(ROOT / "README.md")
    assert readme[0].code.startswith("# 1. install and start the server")
    assert sum(_runnable(b) for b in readme) >= 8


def test_the_model_folders_readme_makes_are_ignored_by_git():
    """README's generation section downloads or makes models/qwen (and models/minilm) at the
    checkout's root: git ignores them (and ruff, by pyproject.toml; README's last block runs
    its lint command after the others made them)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    for path in ("models/qwen/model.onnx", "models/minilm/onnx/model.onnx"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, timeout=60)
        assert done.returncode == 0, f"git does not ignore {path}"
    assert "ruff check plugins server client conformance tests" in blocks(DOCS[0])[-1].code
