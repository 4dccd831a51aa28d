"""What a Python model's process is bounded by, set before the model (or numpy) is imported:
``python sandbox.py FD MAX_BYTES NICENESS SHM_BYTES PARENT LIFE`` sets the bounds, then runs
``worker.py FD`` in the same process. Standard library only (a model may run under its own
Python, as old as 3.10: ``ctypes`` where ``os`` has no call yet).

======================  ======================================================================
its data                ``RLIMIT_DATA`` at MAX_BYTES (the model's MAX_PROCESS_BYTES): heap and
                        private mappings, where numpy's arrays live; an allocation past it fails
                        in the model with MemoryError
its ``/dev/shm``        a tmpfs of its own of SHM_BYTES (MAX_SHM_BYTES, default 64 MiB, Docker's
                        default ``/dev/shm``), in a mount namespace of its own: files a model
                        (or its ``multiprocessing``) makes there fail with ENOSPC past the size,
                        and are gone with the process (a model bounded at 256 MiB left 1,258 MB
                        in the host's ``/dev/shm``, which no restart freed). Root makes the
                        namespace directly; another user through a user namespace of its own,
                        where the kernel allows one; where neither can, the process keeps the
                        host's ``/dev/shm`` and the server logs that its files are unbounded
its priority            NICENESS below the server's (``nice(2)``): the server's threads, which
                        answer every model's requests, get a core from a model busy on all
its kill order          the first the kernel's out-of-memory killer takes (``oom_score_adj``
                        1000), never the server
its children            the process leads a session of its own (the server starts it so), and
                        the server stops the whole group: a model's own subprocesses go with it
its end                 with the server's (PARENT, its process id; LIFE, a pipe only the server
                        writes to), even when the server is killed outright and the model is
                        stuck in ``execute``, holding the GIL or not: the kernel is asked to
                        kill the process when its parent ends (``PR_SET_PDEATHSIG``), and a
                        watcher process in its group kills the whole group (what the model
                        started too) once the pipe closes (:func:`end_with`). A hung model's
                        process used to outlive the server (and, on a GPU, would hold its
                        memory); Triton's stub watches its parent too
======================  ======================================================================

Namespaces are made while the process has one thread: ``unshare`` of a user namespace refuses a
threaded process, and numpy's BLAS starts threads when it is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import resource
import runpy
import select
import signal
import sys
from pathlib import Path

#: (from <sched.h> and <sys/mount.h>)
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 0x4000, 1 << 18
#: where the worker learns how its /dev/shm is bounded ("" private; else why it is not)
SHM_NOTE = "PLUGSERVE_SHM"
#: (from <sys/prctl.h>)
PR_SET_PDEATHSIG = 1
#: the watcher's program: read the pipe until the server's end closes, then kill the group
SHELL = "/bin/sh"
WAIT_AND_KILL = 'read -r _ <&3; kill -s KILL -- "-$1"'
#: how often a watcher without a shell looks whether the worker it watches has ended (the
#: server's end is seen at once)
WATCH_SECONDS = 1.0


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _call(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def private_shm(size: int) -> None:
    """A tmpfs of ``size`` bytes on ``/dev/shm``, seen by this process and its children only
    (OSError naming the step that failed)."""
    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]  # fmt: skip
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWNS) != 0:  # not privileged: a user namespace gives the right
        _call(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare (user and mount namespaces)")
        with contextlib.suppress(FileNotFoundError):
            _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _call(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making mounts private")
    options = f"size={size},mode=1777".encode()
    _call(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, options), "mount")


def bound(max_bytes: int, niceness: int, shm_bytes: int) -> str:
    """Set the process's bounds; returns "" when its /dev/shm is its own, else why not."""
    note = "not asked"
    if shm_bytes > 0:
        try:
            private_shm(shm_bytes)
            note = ""
        except OSError as exc:
            note = str(exc)
    if niceness > 0:
        with contextlib.suppress(OSError):
            os.nice(niceness)
    if max_bytes > 0:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_DATA, (max_bytes, max_bytes))
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as adj:
        adj.write("1000")
    return note


def _end_group(group: int) -> None:
    """Kill process group ``group`` (the worker's, with whatever the model started), or this
    process alone when ``group`` is 0 (it leads none: never so when the server started it)."""
    with contextlib.suppress(OSError):
        if group:
            os.killpg(group, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _watch(life: int, worker: int) -> None:
    """The watcher's life (a process forked before the model runs): wait until the server's
    end of ``life`` closes (the server ended, however, or stopped this process), then kill the
    group. It holds nothing of the worker's (its socket, its output), so the server still sees
    the worker's own end at once. It becomes ``/bin/sh`` waiting on the pipe (1.7 MB resident,
    0.3 MB its own; as this forked Python it kept 5 MB of the interpreter's pages, private once
    the worker writes its own); without a shell, it stays Python and also ends once the worker
    has."""
    try:
        os.dup2(life, 3)
        os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        with contextlib.suppress(OSError):
            os.execv(SHELL, ["sh", "-c", WAIT_AND_KILL, "plugserve-watch", str(worker)])
        poller = select.poll()
        poller.register(3, select.POLLIN)  # the server writes nothing: only its end closing
        while not poller.poll(WATCH_SECONDS * 1000) and os.getppid() == worker:
            pass
    finally:
        _end_group(worker)


def end_with(parent: int, life: int) -> None:
    """End this process, and its group, when ``parent`` (the server) ends, even one killed
    outright while the model holds the GIL. Two ways, since either alone can fail: the
    kernel's parent-death signal (it kills this process but not what the model started),
    asked after the namespaces are made (a change of credentials, as entering a user
    namespace is, clears it); and a watcher process in the group, forked while the process
    has one thread, which kills the whole group once ``life`` (the read end of a pipe whose
    write end only the server holds) reads end of file (the server closes it when it stops the
    process, too). A parent already gone ends the process now."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    leads = os.getpgid(0) == os.getpid()
    if os.getppid() != parent:
        _end_group(os.getpid() if leads else 0)
    if life < 0:
        return
    if leads and os.fork() == 0:  # a watcher for its group
        try:
            _watch(life, os.getppid())
        finally:
            os._exit(0)
    os.close(life)


def main() -> None:
    fd, max_bytes, niceness, shm_bytes = (int(arg) for arg in sys.argv[1:5])
    parent, life = (int(arg) for arg in sys.argv[5:7]) if len(sys.argv) > 6 else (os.getppid(), -1)
    os.environ[SHM_NOTE] = bound(max_bytes, niceness, shm_bytes)
    end_with(parent, life)
    worker = str(Path(__file__).resolve().parent / "worker.py")
    sys.argv = [worker, str(fd)]
    runpy.run_path(worker, run_name="__main__")


if __name__ == "__main__":
    main()
