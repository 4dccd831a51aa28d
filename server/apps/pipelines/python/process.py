"""One instance's process: started in its sandbox, initialized, bounded, watched, started again,
stopped.

``python sandbox.py FD MAX_BYTES NICENESS SHM_BYTES PARENT LIFE`` sets the process's bounds
before anything of the model runs (its data, its own ``/dev/shm``, its priority, its
out-of-memory order, its end with the server's: ``sandbox.py``), then runs ``worker.py``
(Triton's stub) on its end of a ``SOCK_SEQPACKET`` socket. Its output reaches the server's log
through one pump for every process, rate-limited (``output.py``). The process leads a group of
its own, which :meth:`ModelProcess.kill` stops whole, so what a model starts goes with it; its
id is not reaped before, so the group stopped is never another process's. Every process is
started from one thread that lives as long as the server (:class:`Spawner`), so the kernel's
parent-death signal fires with the server only.

============================  ===============================================================
a model that fails to import  its load fails with the reason (INITIALIZE_SECONDS, 300 s, for
or to initialize              ``initialize``); other models load
a process that dies           the request it ran fails with the exit code; the next request
                              starts it again (:meth:`ModelProcess.ensure`); one that closed
                              its socket is not given another request
an execute past               the hang watch (:class:`HangWatch`, one thread for the server)
MAX_EXECUTE_SECONDS           stops the process, its requests fail, the next starts it again
a process holding more than   stopped after its request (``RESTART_AT``, 80 %), so the next
RESTART_AT of its data limit  starts a fresh one before the model's allocations fail
the server stopping           an idle process runs ``finalize``, a busy or hung one gets SIGTERM
                              (its group), any left after STOP_SECONDS is killed
                              (``server/plane/children.py``); none starts again
the server killed outright    the process ends with it, and what it started (``sandbox.py``:
                              the kernel's parent-death signal, and a watcher process)
============================  ===============================================================

A client's deadline never stops a process: only the hang watch, a memory bound or the
process's own end do (``device.py`` says why).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

from plugserve.plugins.api import InvalidModel
from plugserve.plugins.threads import LazyDaemon, Watchlist
from plugserve.server.apps.pipelines.python import ipc, protocol
from plugserve.server.apps.pipelines.python.kinds import Kind
from plugserve.server.apps.pipelines.python.output import PUMP, LineBudget
from plugserve.server.plane import children
from plugserve.server.plane.errors import Unloaded

__all__ = ["HANGS", "SPAWNER", "HangWatch", "Limits", "ModelProcess", "Spawner", "exit_code"]

log = logging.getLogger(__name__)

#: what the server runs: the process's bounds (sandbox.py), then the worker (worker.py)
SANDBOX = Path(__file__).resolve().parent / "sandbox.py"
#: how long a model's initialize (and its auto_complete_config) may take before its load fails
INITIALIZE_SECONDS = 300.0
#: how long finalize may take when a model is unloaded
FINALIZE_SECONDS = 10.0
#: each instance's two arenas (requests in, answers out): larger tensors travel in a memfd of
#: their own; memory is taken only as pages are touched
ARENA_BYTES = 8 << 20
#: a process whose data is past this share of its MAX_PROCESS_BYTES after a request is started
#: again (its next allocations would soon fail)
RESTART_AT = 0.8
#: how often the hang watch looks at the executes under way, at most (it looks at least four
#: times per the smallest MAX_EXECUTE_SECONDS of the models it watches)
HANG_LOOK_SECONDS = 1.0
_PAGE = os.sysconf("SC_PAGE_SIZE")


class Spawner:
    """Starts every model process from one thread that lives as long as the server. A model's
    process asks the kernel to kill it when its parent ends (``PR_SET_PDEATHSIG``,
    ``sandbox.py``), and the kernel takes the *thread* that forked it for its parent: a process
    started from a load's or a request's thread would be killed when that thread ends. A start
    waits for a hand-off to this thread (microseconds, against the process's own start)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = LazyDaemon("python-spawn", self._run)

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(*args, **kwargs)``, run on the spawning thread."""
        done: Future[subprocess.Popen] = Future()
        with self._lock:
            self._thread.ensure()
        self._jobs.put((done, args, kwargs))
        return done.result()

    def _run(self) -> None:
        while True:
            done, args, kwargs = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(*args, **kwargs))
            except Exception as exc:  # the caller gets it; the thread goes on
                done.set_exception(exc)
            del done, args, kwargs


#: the server's one spawning thread
SPAWNER = Spawner()


class Limits(NamedTuple):
    """What bounds one instance's process (its model's configuration keys)."""

    #: bytes of data it may hold (MAX_PROCESS_BYTES; checked after each request)
    max_bytes: int = 0
    #: how far below the server's priority it runs (PROCESS_NICENESS)
    niceness: int = 0
    #: the size of its own /dev/shm (MAX_SHM_BYTES; 0: the host's)
    shm_bytes: int = 0
    #: the longest one execute may run (MAX_EXECUTE_SECONDS; 0: no bound)
    max_execute_seconds: float = 0.0


class ModelProcess:
    """One instance's process, started (and initialized) on demand. ``lock`` is held by the
    one execute that may run at a time, and by a start: a process is started again only
    between executes. ``mailbox_of(sock)`` makes the mailbox of a process just started;
    ``on_start(mailbox)`` is called once it is initialized."""

    def __init__(
        self,
        python: str,
        model_path: Path,
        output: LineBudget,
        mailbox_of: Callable[[socket.socket], ipc.Mailbox],
        on_start: Callable[[ipc.Mailbox], None],
    ) -> None:
        self.python, self.model_path, self.label = python, model_path, output.label
        self.output, self.mailbox_of, self.on_start = output, mailbox_of, on_start
        self.limits = Limits()
        #: the message that initializes the model (set once its configuration is final)
        self.hello: dict[str, Any] = protocol.initialize(str(model_path), {}, False)
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.mailbox: ipc.Mailbox | None = None
        self.inbox: ipc.Arena | None = None  # the process reads requests from it
        self.outbox: ipc.Arena | None = None  # and writes answers into this one
        #: the readiness checks' socket (a model with is_ready())
        self.checks: socket.socket | None = None
        self.restarts = 0
        #: when the execute under way started (``time.monotonic``; 0: none runs): the hang
        #: watch reads it; and whether the process was stopped for running past its bound
        self.execute_started = 0.0
        self.hung = False
        #: the network was closed: nothing starts its process again
        self.closed = False
        self._hangup: select.poll | None = None
        self._statm: tuple[int, int] | None = None  # (pid, descriptor of its /proc statm)
        #: the server's end of the process's life line (closed: its group is killed)
        self._life: io.FileIO | None = None
        self._shm_warned = False

    # --- starting

    def spawn(self) -> None:
        """Start the process (its model not yet initialized: :meth:`auto_complete` may run
        first, then :meth:`start`)."""
        if self.closed:  # unloaded, or the server is stopping: nothing starts it again
            raise Unloaded(f"{self.label}: its model is unloaded or the server is stopping; retry")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        life, self._life = _life_line()
        limits = self.limits
        try:
            command = [self.python, str(SANDBOX), str(theirs.fileno()), str(limits.max_bytes)]
            command += [str(limits.niceness), str(limits.shm_bytes), str(os.getpid()), str(life)]
            self.process = SPAWNER.popen(
                command,
                pass_fds=(theirs.fileno(), life),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one pipe: their lines in the order written
                close_fds=True,
                start_new_session=True,  # a group of its own, which kill() stops whole
            )
        except BaseException:
            self._life.close()
            raise
        finally:
            theirs.close()
            os.close(life)
        children.register(self)  # stopped with the server
        output = self.process.stdout
        PUMP.add(os.dup(output.fileno()), self.output)
        output.close()
        self.mailbox = self.mailbox_of(ours)
        self._hangup = select.poll()  # the process closed its end (one poll(2), no wait)
        self._hangup.register(ours, select.POLLRDHUP | select.POLLHUP)
        self.inbox, self.outbox = ipc.Arena(ARENA_BYTES), ipc.Arena(ARENA_BYTES, writable=False)

    def _hello(self, message: dict[str, Any], *fds: int) -> dict[str, Any]:
        """``message`` to a process that is starting, and its answer within INITIALIZE_SECONDS;
        InvalidModel (the process stopped) when it does not answer or answers an error."""
        if self.mailbox is None:
            self.spawn()
        mailbox = self.mailbox
        mailbox.sock.settimeout(INITIALIZE_SECONDS)
        try:
            mailbox.send(message, *fds)
            reply, _ = mailbox.wait("main")
        except (OSError, EOFError, ValueError) as exc:
            self.stop()
            what = "answer" if message["op"] == Kind.AUTO_COMPLETE else "initialize"
            raise InvalidModel(f"{self.label}: its process did not {what}: {exc}") from None
        mailbox.sock.settimeout(None)
        if reply.get("error"):
            self.stop()
            failed = "auto_complete_config failed: " if message["op"] == Kind.AUTO_COMPLETE else ""
            raise InvalidModel(f"{self.label}: {failed}{reply['error']}")
        return reply

    def auto_complete(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The model's ``auto_complete_config`` run on ``config`` (Triton's JSON form) in the
        process, before ``initialize``: the config it returns, or None when the model has no
        such function. InvalidModel with the model's own reason when it fails."""
        return self._hello(protocol.auto_complete(str(self.model_path), config)).get("config")

    def start(self) -> None:
        """Spawn the process (unless :meth:`spawn` did) and initialize the model in it;
        InvalidModel with the model's own reason when it cannot."""
        if self.mailbox is None:
            self.spawn()
        reply = self._hello(self.hello, self.inbox.fd, self.outbox.fd)
        shm = reply.get("shm")
        if self.limits.shm_bytes and shm and not self._shm_warned:
            self._shm_warned = True
            log.warning(
                "%s: its process uses the host's /dev/shm (%s): files it makes there are not "
                "bounded by MAX_SHM_BYTES; run the server as root or where unprivileged user "
                "namespaces are allowed", self.label, shm,
            )  # fmt: skip
        if reply.get("is_ready"):  # the model has is_ready(): a socket of its own for it
            self._open_checks(self.mailbox)
        self.on_start(self.mailbox)

    def _open_checks(self, mailbox: ipc.Mailbox) -> None:
        """A socket for readiness checks, served by a thread of the process: a check is
        answered while an execute runs (which reads nothing of the model's socket)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            mailbox.send({"op": Kind.CHECKS}, theirs.fileno())
        except OSError:
            ours.close()
            return
        finally:
            theirs.close()
        self.checks = ours

    def ensure(self) -> ipc.Mailbox:
        """The mailbox of a running process: the one there is, else a new one started (with
        the lock held)."""
        mailbox = self.mailbox
        if (
            mailbox is None
            or mailbox.closed
            or not self.alive()
            or (self._hangup is not None and self._hangup.poll(0))
        ):  # a process that closed its socket is exiting (its mount namespace's teardown
            # takes a while): the next request goes to a new one, not into its exit
            if self.process is not None:
                self.restarts += 1
                log.warning("%s: starting its process again", self.label)
            self.stop()
            self.start()
        return self.mailbox

    # --- its state

    def alive(self) -> bool:
        return self.process is not None and exit_code(self.process) is None

    def exit_code(self) -> int | None:
        """The process's exit code once it ended (None: it runs, or none was started)."""
        return exit_code(self.process) if self.process is not None else None

    def bound_memory(self) -> None:
        """Stop a process whose data (what its ``RLIMIT_DATA`` counts: heap and private
        mappings) is past ``RESTART_AT`` of its ``max_bytes`` after a request, so the next
        request starts a fresh one before the model's allocations begin to fail (a model that
        leaks would otherwise fail every request from then on); one ``pread`` of ``/proc``,
        from a descriptor opened once per process (opening the file took 15 us a request, the
        read takes 1). The caller knows none of its decoupled requests is open."""
        process, limit = self.process, self.limits.max_bytes
        if not limit or process is None:
            return
        try:
            if self._statm is None or self._statm[0] != process.pid:
                self._close_statm()
                self._statm = (process.pid, os.open(f"/proc/{process.pid}/statm", os.O_RDONLY))
            data = int(os.pread(self._statm[1], 256, 0).split()[5]) * _PAGE  # data + stack
        except (OSError, ValueError, IndexError):
            self._close_statm()
            return
        if data > limit * RESTART_AT:
            log.warning(
                "%s: its process holds %d MiB, over %d%% of its MAX_PROCESS_BYTES (%d MiB): "
                "started again for the next request", self.label, data >> 20,
                RESTART_AT * 100, limit >> 20,
            )  # fmt: skip
            self.kill()

    def past_bound(self, now: float) -> bool:
        """The hang watch's look: stop the process when its execute has run past
        MAX_EXECUTE_SECONDS (True when it did)."""
        started, bound = self.execute_started, self.limits.max_execute_seconds
        if not started or not bound or now - started <= bound:
            return False
        log.warning(
            "%s: its execute has run %.1f s, past MAX_EXECUTE_SECONDS (%g s): taken as hung, "
            "its process is stopped and started again", self.label, now - started, bound,
        )  # fmt: skip
        self.hung = True
        self.execute_started = 0.0
        self.kill()
        return True

    # --- stopping

    def end(self) -> None:
        """The server is stopping (``server/plane/children.py``): nothing starts the process
        again; an idle one is asked to run its model's ``finalize`` and exit, a busy or hung one
        gets SIGTERM, sent to its group. Waits for nothing."""
        self.closed = True
        HANGS.processes.discard(self)
        process = self.process
        if process is None or not self.alive():
            return
        if self.lock.acquire(blocking=False):  # no execute runs: finalize, as an unload does
            try:
                mailbox = self.mailbox
                if mailbox is not None and not mailbox.closed:  # one message: no send lock
                    ipc.send(mailbox.sock, {"op": Kind.FINALIZE}, flags=socket.MSG_DONTWAIT)
                    return
            except OSError:
                pass
            finally:
                self.lock.release()
        with contextlib.suppress(OSError):  # not reaped: its id is still its group's
            os.killpg(process.pid, signal.SIGTERM)

    def ended(self) -> bool:
        return not self.alive()

    def kill(self) -> None:
        """Stop the process (from any thread: the hang watch calls it) and wake whoever waits
        on its socket. What a run may be using (the arenas) is left to the next
        :meth:`ensure` or :meth:`finalize`, which hold the lock."""
        process, mailbox, life = self.process, self.mailbox, self._life  # this process's:
        # a request may start the next one while this runs (the hang watch's kill)
        if process is not None:
            if process.returncode is None:  # not reaped: its id is still its group's
                with contextlib.suppress(OSError):  # what the model started goes with it
                    os.killpg(process.pid, signal.SIGKILL)
            if process.poll() is None:
                process.kill()
                process.wait(10)
        if life is not None:
            life.close()  # its watcher ends what is left of the group (closing twice is
            # nothing: FileIO forgets its descriptor before it closes it)
        if mailbox is not None:
            mailbox.close("its process was stopped")
            mailbox.sock.close()
        checks, self.checks = self.checks, None
        if checks is not None:
            checks.close()

    def stop(self) -> None:
        """:meth:`kill`, then let go of what the process used (with the lock held, or before
        any request)."""
        self.kill()
        for arena in (self.inbox, self.outbox):
            if arena is not None:
                arena.close()
        self.inbox = self.outbox = None
        self.mailbox = None
        self._close_statm()

    def _close_statm(self) -> None:
        statm, self._statm = self._statm, None
        if statm is not None:
            with contextlib.suppress(OSError):
                os.close(statm[1])

    def finalize(self) -> None:
        """The model is unloaded: its ``finalize`` runs (FINALIZE_SECONDS at most), then the
        process is stopped, never to start again."""
        self.closed = True
        HANGS.processes.discard(self)
        children.discard(self)
        if self.execute_started:  # the unload waited its --model-unload-timeout already: an
            # execute still running is stopped, not waited for (the lock is its until it ends:
            # a red team's unload of 1 s took 9.4 s during a 10 s execute, 39 s during 40 s)
            log.warning("%s: unloaded during an execute: its process is stopped", self.label)
            self.kill()
        with self.lock:
            mailbox = self.mailbox
            if self.alive() and mailbox is not None:
                try:
                    mailbox.sock.settimeout(FINALIZE_SECONDS)
                    mailbox.send({"op": Kind.FINALIZE})
                    mailbox.wait("main")
                    self.process.wait(FINALIZE_SECONDS)
                except (OSError, EOFError, ValueError, subprocess.TimeoutExpired):
                    pass
            self.stop()


def _life_line() -> tuple[int, io.FileIO]:
    """A pipe whose read end a model's process keeps (sandbox.py's watcher waits on it) and
    whose write end only the server holds (made close-on-exec, so no other process started
    inherits it): when the server ends, however it ends, the watcher reads end of file."""
    read, write = os.pipe()
    return read, io.FileIO(write, "wb")


def exit_code(process: subprocess.Popen) -> int | None:
    """``process``'s exit code once it ended (negative: the signal that ended it), else None,
    without reaping it: until :meth:`ModelProcess.kill` does, its id cannot name another
    process's group, so stopping its group never reaches one that is not the model's."""
    if process.returncode is not None:
        return process.returncode
    try:
        found = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile
        return process.poll()
    if found is None:
        return None
    return found.si_status if found.si_code == os.CLD_EXITED else -found.si_status


class HangWatch:
    """One thread for every Python model's instances: stops a process whose execute has run
    past its MAX_EXECUTE_SECONDS (:meth:`ModelProcess.past_bound`). A request pays nothing for
    it but two stores (when its execute starts and ends); the thread looks once a second (more
    often for a bound under four seconds), started with the first model and idle between
    looks."""

    def __init__(self) -> None:
        #: the processes watched (weakly: one dropped without ``discard`` leaves by itself)
        self.processes: Watchlist[ModelProcess] = Watchlist("python-hangs", self._run, weak=True)

    def _run(self) -> None:
        while True:
            processes = self.processes.items()
            bounds = [b for p in processes if (b := p.limits.max_execute_seconds)]
            time.sleep(min([HANG_LOOK_SECONDS, *(b / 4 for b in bounds)]))
            now = time.monotonic()
            for process in processes:
                try:
                    process.past_bound(now)
                except Exception:  # one process that cannot be stopped must not stop the watch
                    log.exception("%s: stopping its hung process failed", process.label)
            del processes


#: the server's one hang watch
HANGS = HangWatch()
