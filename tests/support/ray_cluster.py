"""A real multi-node Ray cluster on this machine, for tests: a head and workers, each in a
network namespace of its own on a private bridge, all run from one cached virtual environment.

Why namespaces: in the host's namespace Ray listens on every interface whatever
``--node-ip-address`` says, so two nodes on one machine would share ports and reach each other
over loopback; a namespace per node gives each its own interfaces, ports (GCS 6379, Serve's
8000 and 9000) and address, and a node can be cut off by taking its link down, as a real
machine's cable. The bridge (``<tag>b``, 10.213.<n>.1/24 in the host's namespace) is the
cluster's private network; the test process reaches every node over it.

What is started here is ended here, by process id: every process inside a node's namespace
(``ip netns pids``) is that node's (its raylet, GCS, workers, Serve's proxies and replicas),
and nothing else is ever signalled. ``ray stop`` is never run: it kills every Ray process on
the machine, other people's too. :meth:`RayCluster.close` kills what is left, removes the
namespaces, links and temporary folders, and the module's ``atexit`` does it for a run that
ends early.

The environment: ``ray[serve]`` pinned (:data:`RAY_VERSION`) with this checkout installed
editable into it (``ray_venv``), cached under ``~/.cache/plugserve-tests`` per checkout and
per ``pyproject.toml`` (an editable install reads the checkout's files, but its entry points
and dependencies are fixed when it is installed).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serving import RunningServer
from venvs import cached_venv

RAY_VERSION = "2.60.0"
CHECKOUT = Path(__file__).resolve().parents[2]
#: the install line a skipped test names
INSTALL = f"pip install -e '.[ray]' 'ray[serve]=={RAY_VERSION}' (as root, with iproute2)"
#: Serve's ports, set explicitly everywhere (each node's namespace has its own)
HTTP_PORT = 8000
GRPC_PORT = 9000
GCS_PORT = 6379
REDIS_PORT = 6380
#: each node's Prometheus exposition of Ray's metrics (its metrics agent)
METRICS_PORT = 8080
#: what Serve's gRPC proxy registers: plugserve's KServe v2 servicer
GRPC_SERVICER = "plugserve.proto.grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server"


class Unavailable(Exception):
    """A cluster cannot be made here: the reason, for a skip."""


def ray_venv() -> Path:
    """The cached venv with ``ray[serve]`` and this checkout (editable, with the ``ray``,
    ``generate``, ``ort`` and ``image`` extras: the bundled examples' image decoder needs Pillow);
    raises :class:`Unavailable` when pip cannot make it."""
    packages = ["-e", f"{CHECKOUT}[ray,generate,ort,image]", f"ray[serve]=={RAY_VERSION}"]
    key = hashlib.sha256(
        str(CHECKOUT).encode()
        + (CHECKOUT / "pyproject.toml").read_bytes()
        + " ".join(packages).encode()
    ).hexdigest()[:12]
    try:
        return cached_venv(f"ray-{RAY_VERSION}-{key}", packages, timeout=1800)
    except (subprocess.SubprocessError, OSError) as exc:
        raise Unavailable(f"the Ray venv cannot be made: {exc}; {INSTALL}") from None


def check_host() -> None:
    """Raise :class:`Unavailable` unless namespaces can be made here (root, iproute2)."""
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root; run as root (CI does)")
    if shutil.which("ip") is None:
        raise Unavailable("no `ip` command: apt-get install iproute2")
    probe = f"psrprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        raise Unavailable(f"`ip netns add` fails here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass
class Node:
    name: str  # head, w1, w2 ...; also the Ray node name, so RAY.<name> is its device
    namespace: str
    ip: str
    link: str  # the bridge's end of its veth pair (down: the node is cut off)
    temp: Path
    cpus: int
    process: subprocess.Popen | None = None
    log: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)


_LIVE: list[RayCluster] = []


class RayCluster:
    """``workers`` worker nodes and a head, started by :meth:`start`. ``head_cpus`` 0 keeps
    replicas and actors off the head (as production clusters do), so killing the head takes
    no replica with it; ``fault_tolerant`` runs a Redis server for the GCS (on the bridge's
    host address) so the head can be killed and started again."""

    def __init__(
        self,
        workers: int = 2,
        head_cpus: int = 0,
        worker_cpus: int = 2,
        fault_tolerant: bool = False,
    ) -> None:
        check_host()
        self.venv = ray_venv()
        _become_subreaper()
        if fault_tolerant and shutil.which("redis-server") is None:
            raise Unavailable(
                "GCS fault tolerance needs redis-server: apt-get install redis-server"
            )
        pid = os.getpid()
        self.tag = f"psr{pid % 100000}"
        self.subnet = _free_subnet(pid)
        self.bridge = f"{self.tag}b"
        # short: a node's sockets live under it, and a socket path is at most 107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="psr-", dir="/tmp"))
        self.fault_tolerant = fault_tolerant
        self.redis: subprocess.Popen | None = None
        self.nodes: dict[str, Node] = {}
        names = ["head", *(f"w{i}" for i in range(1, workers + 1))]
        for index, name in enumerate(names):
            self.nodes[name] = Node(
                name,
                f"{self.tag}{name}",
                f"{self.subnet}.{index + 2}",
                f"{self.tag}{index}a",
                self.root / name,
                head_cpus if name == "head" else worker_cpus,
            )
        self._made: list[str] = []
        _LIVE.append(self)

    # --- addresses

    @property
    def head(self) -> Node:
        return self.nodes["head"]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process of the cluster (a node, a driver)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RAY_", "PYTEST", "VIRTUAL_ENV")) and k != "PYTHONPATH"
        }
        env.update(
            PATH=f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
            RAY_ADDRESS=self.address,
            RAY_USAGE_STATS_ENABLED="0",
            # a dead node is noticed in ~3 s, not 30 (the GCS's health checks of raylets)
            RAY_health_check_period_ms="1000",
            RAY_health_check_timeout_ms="1000",
            RAY_health_check_failure_threshold="3",
            # metrics reach each node's exporter within a second, not ten
            RAY_metrics_report_interval_ms="1000",
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    # --- the network

    def _make_network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node in self.nodes.values():
            inner = node.link[:-1] + "b"
            _ip("netns", "add", node.namespace)
            _ip("link", "add", node.link, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", node.namespace)
            _ip("link", "set", node.link, "master", self.bridge, "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.ip}/24", "dev", inner)
            _ip("-n", node.namespace, "link", "set", inner, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            # the host's address on the bridge is every node's way out (Redis lives there)
            _ip("-n", node.namespace, "route", "add", "default", "via", f"{self.subnet}.1")

    def partition(self, name: str) -> None:
        """Cut ``name`` off the others (its link to the bridge down): its processes live on."""
        _ip("link", "set", self.nodes[name].link, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.nodes[name].link, "up")

    # --- processes

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``name``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[name].namespace, *argv]

    def popen(self, name: str, argv: list[str], log: Path, **env: str) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.command(name, argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(**env),
                cwd=self.root,  # never the checkout: its folders would shadow packages
                start_new_session=True,
            )

    def run(self, name: str, argv: list[str], timeout: float = 300, **env: str):
        """``argv`` in node ``name``'s namespace, to its end: the completed process."""
        return subprocess.run(
            self.command(name, argv),
            capture_output=True,
            text=True,
            env=self.env(**env),
            cwd=self.root,
            timeout=timeout,
        )

    def python(self, code: str, name: str = "head", timeout: float = 300, **env: str) -> str:
        """Run ``code`` with the venv's Python in node ``name``'s namespace (a Ray driver
        when it calls ``ray.init()``): its stdout; a failure raises with its output."""
        done = self.run(name, [str(self.venv / "bin" / "python"), "-c", code], timeout, **env)
        if done.returncode:
            raise RuntimeError(f"driver failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def _start_redis(self) -> None:
        log = self.root / "redis.log"
        with open(log, "ab") as out:
            self.redis = subprocess.Popen(
                [
                    "redis-server",
                    "--bind", f"{self.subnet}.1",
                    "--port", str(REDIS_PORT),
                    "--save", "",
                    "--appendonly", "no",
                    "--protected-mode", "no",
                    "--dir", str(self.root),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        if not _port_open(f"{self.subnet}.1", REDIS_PORT, 20):
            raise RuntimeError(f"redis-server did not start:\n{log.read_text()}")

    def start_node(self, name: str) -> None:
        """Start (or start again) node ``name``; returns once ``ray start`` is running."""
        node = self.nodes[name]
        node.temp.mkdir(parents=True, exist_ok=True)
        node.log = self.root / f"{name}.log"
        argv = [
            str(self.venv / "bin" / "ray"),
            "start",
            "--block",
            "--node-ip-address", node.ip,
            "--node-name", name,
            "--num-cpus", str(node.cpus),
            "--object-store-memory", str(100 << 20),
            "--temp-dir", str(node.temp),
            "--disable-usage-stats",
            "--metrics-export-port", str(METRICS_PORT),
        ]  # fmt: skip
        env: dict[str, str] = {}
        if name == "head":
            # `ray start --head` refuses an address that the last start wrote here while a
            # process on this machine names it as its GCS: the workers here do (on a real
            # cluster they run on other machines), so a restarted head forgets it first
            (node.temp / "ray_current_cluster").unlink(missing_ok=True)
            argv += ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"]
            if self.fault_tolerant:
                env["RAY_REDIS_ADDRESS"] = f"{self.subnet}.1:{REDIS_PORT}"
                env["RAY_external_storage_namespace"] = self.tag
        else:
            argv += ["--address", self.address]
        node.process = self.popen(name, argv, node.log, **env)

    def start(self, timeout: float = 180) -> RayCluster:
        try:
            self._make_network()
            if self.fault_tolerant:
                self._start_redis()
            self.start_node("head")
            if not _port_open(self.head.ip, GCS_PORT, timeout):
                raise RuntimeError(f"the head did not start:\n{self.logs()}")
            for name in self.nodes:
                if name != "head":
                    self.start_node(name)
            self.wait_nodes(list(self.nodes), timeout)
        except BaseException:
            self.close()
            raise
        return self

    def restart_node(self, name: str, timeout: float = 180, attempts: int = 3) -> None:
        """Start node ``name`` again and wait until the GCS holds it alive; a ``ray start``
        that gives up meanwhile is run again (a restarted head waits at most 30 s for its
        raylet to register with the GCS, hard-coded in Ray: on 2 busy cores that can pass)."""
        end = time.monotonic() + timeout
        for attempt in range(attempts):
            self.start_node(name)
            process = self.nodes[name].process
            while time.monotonic() < end:
                if process is not None and process.poll() is not None:
                    break  # ray start gave up: again
                try:
                    if name in self.alive_nodes():
                        return
                except (RuntimeError, subprocess.TimeoutExpired, StopIteration, ValueError):
                    pass
                time.sleep(1)
            else:
                break
            self.kill_node(name)
            if attempt + 1 == attempts:
                break
        raise RuntimeError(f"node {name} did not come back in {timeout} s:\n{self.logs()}")

    def alive_nodes(self) -> list[str]:
        """The names of the nodes the GCS holds alive."""
        out = self.python(
            "import json, ray; ray.init(logging_level='ERROR', log_to_driver=False); "
            "print('NODES', json.dumps([n['NodeName'] for n in ray.nodes() if n['Alive']]))",
            timeout=120,
        )
        # Ray may print its own lines (the autoscaler's) to the driver's stdout too
        line = next(line for line in out.splitlines() if line.startswith("NODES "))
        return json.loads(line[len("NODES ") :])

    def wait_nodes(self, names: list[str], timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                if set(names) <= set(self.alive_nodes()):
                    return
            except (RuntimeError, subprocess.TimeoutExpired, StopIteration, ValueError):
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"nodes {names} did not all join in {timeout} s:\n{self.logs()}")
            time.sleep(1)

    def kill_node(self, name: str) -> int:
        """SIGKILL every process in node ``name``'s namespace (a machine losing power), and
        reap them; how many there were."""
        node = self.nodes[name]
        pids = self.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        starter = node.process.pid if node.process is not None else None
        if node.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(30)
            node.process = None
        _reap([p for p in pids if p != starter], 30)
        return len(pids)

    def pids(self, name: str) -> list[int]:
        done = _ip("netns", "pids", self.nodes[name].namespace, check=False)
        return [int(p) for p in done.stdout.split()]

    def logs(self, tail: int = 40) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def close(self) -> None:
        """Kill every process of every node, then remove namespaces, links and folders."""
        for name in self.nodes:
            if (
                self.nodes[name].namespace
                and _ip("netns", "pids", self.nodes[name].namespace, check=False).returncode == 0
            ):
                self.kill_node(name)
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(10)
            self.redis = None
        for node in self.nodes.values():
            _ip("netns", "delete", node.namespace, check=False)
            _ip("link", "delete", node.link, check=False)
        _ip("link", "delete", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        if self in _LIVE:
            _LIVE.remove(self)

    # --- Serve

    def serve_run(
        self, applications: list[dict], ready: list[str], timeout: float = 300
    ) -> subprocess.Popen:
        """``serve run`` of a config holding ``applications`` (each with its ``import_path``
        and ``args``), a driver in the head's namespace, Serve's ports set explicitly and
        plugserve's KServe servicer on the gRPC proxy; returns once each URL of ``ready``
        answers 200 through Serve's HTTP proxy."""
        config = {
            "proxy_location": "EveryNode",
            "http_options": {"host": "0.0.0.0", "port": HTTP_PORT},
            "grpc_options": {"port": GRPC_PORT, "grpc_servicer_functions": [GRPC_SERVICER]},
            "applications": applications,
        }
        path = self.root / "serve.json"
        path.write_text(json.dumps(config))
        log = self.root / "serve.log"
        process = self.popen("head", [str(self.venv / "bin" / "serve"), "run", str(path)], log)
        end = time.monotonic() + timeout
        waiting = list(ready)
        while waiting:
            if process.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"serve run did not deploy:\n{log.read_text()[-5000:]}")
            try:
                with urllib.request.urlopen(waiting[0], timeout=5) as answer:
                    if answer.status == 200:
                        waiting.pop(0)
                        continue
            except OSError:
                pass
            time.sleep(1)
        return process

    def replicas(self, deployment: str) -> dict[str, int]:
        """How many replicas of ``deployment`` (``APP:NAME``: Serve's process title
        ``ServeReplica:APP:NAME``) run on each node, read from each namespace's processes."""
        return {name: len(self.replica_pids(deployment, name)) for name in self.nodes}

    def replica_pids(self, deployment: str, node: str) -> list[int]:
        """The processes of ``deployment``'s replicas (as :meth:`replicas`) on ``node``."""
        title = f"ServeReplica:{deployment}".encode()
        found = []
        for pid in self.pids(node):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if title in command:
                found.append(pid)
        return found

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class NodeServer(RunningServer):
    """``plugserve serve`` inside node ``name``'s namespace (a Ray driver: the RAY device
    connects to the cluster through RAY_ADDRESS), listening on the node's address."""

    def __init__(self, cluster: RayCluster, name: str, *args: str) -> None:
        node = cluster.nodes[name]
        wrapper = cluster.root / f"python-{name}"
        wrapper.write_text(
            "#!/bin/sh\nexec ip netns exec "
            f'{node.namespace} {cluster.venv / "bin" / "python"} "$@"\n'
        )
        wrapper.chmod(0o755)
        super().__init__("--host", node.ip, *args, env=cluster.env(), python=str(wrapper))
        self.host = node.ip


def _free_subnet(pid: int) -> str:
    """A /24 under 10.213 that no interface of this machine is on (another cluster of ours
    may be running: a second bridge on the same subnet would take its routes)."""
    taken = _ip("-4", "addr", check=False).stdout
    for step in range(150):
        subnet = f"10.213.{100 + (pid + step) % 150}"
        if f" {subnet}." not in taken:
            return subnet
    raise Unavailable("every 10.213.100-249 subnet is taken by another cluster here")


def _port_open(host: str, port: int, timeout: float) -> bool:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection((host, port), timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def _become_subreaper() -> None:
    """Orphans of what this process started are reparented to it, not to the machine's init
    (which, in a container, may never reap them): a killed node's processes would otherwise
    stay zombies, and Ray's ``ray start`` takes a zombie GCS's command line for a GCS still
    running at that address and refuses to start the head again."""
    import ctypes

    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def _reap(pids: list[int], timeout: float) -> None:
    """Wait until each of ``pids`` (killed) is gone, reaping those that became ours."""
    end = time.monotonic() + timeout
    left = set(pids)
    while left and time.monotonic() < end:
        for pid in list(left):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not os.path.exists(f"/proc/{pid}"):
                left.discard(pid)
        if left:
            time.sleep(0.05)


def load(
    clients: int, seconds: float, call, stop: threading.Event | None = None
) -> tuple[int, list[tuple[float, str]]]:
    """``call()`` from ``clients`` threads for ``seconds`` (or until ``stop``): how many
    calls were made, and when (``time.monotonic``) and why those that failed failed."""
    stop = stop or threading.Event()
    end = time.monotonic() + seconds
    counts = [0] * clients
    errors: list[tuple[float, str]] = []
    lock = threading.Lock()

    def loop(i: int) -> None:
        while not stop.is_set() and time.monotonic() < end:
            try:
                call()
            except Exception as exc:
                with lock:
                    errors.append((time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]))
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    return sum(counts), errors


@atexit.register
def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


if __name__ == "__main__":
    # ``python tests/support/ray_cluster.py venv``: make (or find) the cached Ray venv and
    # print its path (CI makes it in the background before the tests)
    if sys.argv[1:] != ["venv"]:
        raise SystemExit("usage: python tests/support/ray_cluster.py venv")
    try:
        print(ray_venv())
    except Unavailable as exc:
        raise SystemExit(str(exc)) from None
