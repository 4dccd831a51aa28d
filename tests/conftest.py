from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

# The whole run, and every server it starts, writes its temporary files into a folder of its
# own, so that what a test leaves behind can be found (and another process's files on the
# machine are not counted): a run that leaves plugserve's files there fails. Libraries' own
# caches there (torch's inductor, openvino's telemetry session) go with the folder at the end.
_SYSTEM_TMP = tempfile.gettempdir()
_RUN_TMP = tempfile.mkdtemp(prefix="plugserve-tests-", dir=_SYSTEM_TMP)
os.environ["TMPDIR"] = _RUN_TMP
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

# tests/support holds the helpers every folder imports (serving, models, reference); tests/ holds
# the zoo package. Test files sit in folders by area: plugins/<device>, server, client, deploy, zoo.
sys.path[:0] = [str(Path(__file__).parent / "support"), str(Path(__file__).parent)]


@pytest.fixture(scope="session")
def core():
    from plugserve.server import Core

    return Core()


@pytest.fixture
def numpy_plugin():
    """A fresh NUMPY plugin, so config changes and extensions do not leak between tests."""
    from plugserve.plugins.numpy import NumpyPlugin

    return NumpyPlugin()


@pytest.fixture
def regions():
    """System shared memory regions under the server's default key prefix (tritonclient's
    utilities): ``make(byte_size) -> (name, key, handle)``; destroyed afterwards."""
    import uuid

    shm = pytest.importorskip(
        "tritonclient.utils.shared_memory", reason="pip install 'tritonclient[grpc,http]'"
    )
    made = []

    def make(byte_size: int):
        tag = uuid.uuid4().hex[:12]
        handle = shm.create_shared_memory_region(f"r{tag}", f"/plugserve-test-{tag}", byte_size)
        made.append(handle)
        return f"r{tag}", f"/plugserve-test-{tag}", handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)  # unmaps without touching a page


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real server on the bundled example models, shared by a test module."""
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    with RunningServer("--model-repository", str(repo)) as running:
        running.repository = repo
        yield running


def _leftovers() -> list[str]:
    return sorted(n for n in os.listdir(_RUN_TMP) if n.startswith("plugserve"))


def _stray_processes() -> list[tuple[int, str]]:
    """Processes other than this one whose command line names the run's temporary folder: a
    server (or model process) a test started and did not stop, alive after the run."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if _RUN_TMP in command:
            found.append((int(entry), command.strip()[:160]))
    return found


def pytest_sessionfinish(session, exitstatus):
    """Fail a run that leaves files in the temporary folder (a test's servers, caches and
    scratch folders must be removed by the test) or processes running (which are killed),
    then remove the run's folder."""
    try:
        # objects the tests dropped in reference cycles go now, not at interpreter exit (after
        # this check): an ORT request's unread profiling folder is removed when it goes
        gc.collect()
        stray = _stray_processes()
        for pid, _ in stray:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        left = _leftovers()
        if (left or stray) and exitstatus == 0:
            if stray:
                sys.stderr.write(
                    f"\nthe test run left {len(stray)} processes running (killed now): "
                    + "; ".join(f"{pid} {command}" for pid, command in stray[:5])
                    + "\n"
                )
            if left:
                sys.stderr.write(
                    f"\nthe test run left {len(left)} entries in its temporary folder: "
                    + ", ".join(left[:20])
                    + "\n"
                )
            session.exitstatus = 1
    finally:
        shutil.rmtree(_RUN_TMP, ignore_errors=True)
