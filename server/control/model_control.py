"""Model control: which networks are loaded, from where, and when that changes.

Triton keeps this apart from the request path (its ModelRepositoryManager; MLServer's
ModelRepositoryHandlers), and so does plugserve, so that loading's concerns (compiling, the
repository, the limits on what is loaded) stay out of the path every request pays for: loads,
unloads, reloads, load overrides, the repository's startup load and polling, import/export and
query are here.

The dependency runs one way. This module fills the table of loaded networks (``networks.py``)
and uses the data plane (``dataplane.py``) for what belongs to the request path: a sequence
model's runs go through its admission, a reload hands late requests over through it, and loads
are refused while it drains. The data plane never imports this module.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from plugserve.plugins import cancel, reading
from plugserve.plugins.api import (
    CompiledNetwork,
    FailedPrecondition,
    InferenceError,
    InvalidArgument,
    InvalidInput,
    NotFound,
    PermissionDenied,
    PlugserveError,
    ResourceExhausted,
    refuse_non_tensors,
)
from plugserve.server.control.allocator import freezes, give_back_freed_memory
from plugserve.server.control.core import Core, refuse_server_keys
from plugserve.server.control.devices import batch_device, parse_device, runs_on_torch
from plugserve.server.control.loading import Loading, LoadStopped, check_stop
from plugserve.server.control.model_names import check_name
from plugserve.server.control.placement import place
from plugserve.server.control.read_charge import read_charge
from plugserve.server.control.repository import ModelEntry, Repository
from plugserve.server.control.retire import Retirement, close_network, end_sequences
from plugserve.server.control.triton_config import (
    EVERY_VERSION,
    ModelSettings,
    OverrideFolder,
    VersionPolicy,
    write_overrides,
)
from plugserve.server.control.turns import Turns
from plugserve.server.control.warmup import Warmup, warm_up
from plugserve.server.plane.dataplane import DataPlane, ShuttingDown
from plugserve.server.plane.metrics import Metrics
from plugserve.server.plane.networks import LoadedNetwork, NotReady
from plugserve.server.plane.queue_policy import PolicyQueue, QueuePolicy
from plugserve.server.plane.sequence_config import SequenceSettings
from plugserve.server.plane.sequences import SequenceBatcher, Sequences
from plugserve.server.plane.versions import check_version, is_version, next_version

if TYPE_CHECKING:
    from plugserve.server.control.on_demand import OnDemand

# (batch_device is devices.py's, named here for those who import it from here)
__all__ = ["ControlDisabled", "ModelControl", "batch_device", "failed_to_load"]

log = logging.getLogger(__name__)

_Item = TypeVar("_Item")
_Outcome = TypeVar("_Outcome")


# Messages begin with Triton's own words for the condition (triton-inference-server/core:
# model_repository_manager.cc, model_lifecycle.cc), which Triton's example clients and users'
# scripts match on ("failed to load"); plugserve's explanation and what to do follow them.


class ControlDisabled(PlugserveError):
    """A load or unload request under --model-control-mode none or poll (as Triton)."""

    code = "UNAVAILABLE"

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"explicit model load / unload is not allowed if polling is enabled: {detail}"
        )


class Starting(PlugserveError):
    """A load or unload request while the server loads its repository at startup."""

    code = "UNAVAILABLE"


def failed_to_load(name: str, exc: PlugserveError) -> PlugserveError:
    """``exc`` (same type, so the same status) with Triton's ``failed to load 'NAME'`` first."""
    if str(exc).startswith("failed to load"):
        return exc
    return type(exc)(f"failed to load {name!r}: {exc}")


#: What lets a client's models run code, as refusals name it.
ALLOW_CODE = (
    "the server's operator may allow code from clients: --allow-code-from-clients 1 / "
    "PLUGSERVE_ALLOW_CODE_FROM_CLIENTS=1; such a load runs the code it carries"
)

#: Config keys that name a program the server runs (a Python model's interpreter, a virtual
#: environment's ``bin/python``): a client's config may not set them (``refuse_code_keys``).
CODE_KEYS = frozenset({"EXECUTION_ENV_PATH"})


#: requests that may wait in BATCH's batcher at once for a model with priority levels (else
#: twice its batch size): past them, requests wait out of the batcher's sight, so a higher
#: priority could not overtake the lower ones already there (the number a Python model's
#: gatherer waits on, ``MAX_GATHER_STREAMS``)
WAITING_WITH_PRIORITIES = 64


class ModelControl:
    """Loads, reloads and unloads networks into the data plane's table, from a call or from
    the model repository, and answers what is loaded or stored."""

    def __init__(
        self,
        plane: DataPlane,
        core: Core,
        metrics: Metrics,
        repository: Repository | None,
        default_device: str = "NUMPY",
        queue_size: int = 0,
        max_networks: int = 0,
        max_model_bytes: int = 0,
        load_threads: int = 1,
        max_sequences: int = 0,
        unload_timeout: float = 30.0,
        allow_code_from_clients: bool = False,
        max_queries: int = 0,
    ) -> None:
        """``plane``: the data plane that serves what is loaded here, and whose table of
        networks this fills. ``max_networks`` / ``max_model_bytes`` / ``max_sequences``:
        --max-networks, --max-model-bytes and --max-sequences (0: no limit);
        ``load_threads``: --model-load-threads, made concrete; ``unload_timeout``:
        --model-unload-timeout, how long an unload waits for its model's requests
        (``retire.py``); ``allow_code_from_clients``: --allow-code-from-clients
        (:attr:`client_trusted`); ``max_queries``: QueryNetworks running or waiting at once,
        server-wide (``turns.py``; 0: a tenant's own bound only)."""
        self.plane = plane
        #: how networks leave: their requests waited for, closed, their memory given back
        self.retirement = Retirement(plane, metrics, unload_timeout)
        self.table = plane.table
        self.load_threads = max(1, load_threads)
        #: every sequence model's bounds and idle reaper (--max-sequences)
        self.sequences = Sequences(max_sequences, plane.budget)
        self.max_networks = max_networks
        self.max_model_bytes = max_model_bytes
        self.core = core
        self.metrics = metrics
        self.repository = repository
        self.default_device = default_device
        self.queue_size = queue_size
        #: --model-control-mode
        self.control_mode = ""
        #: the server's startup is loading the repository (the process sets and clears it):
        #: a client's load of a model the startup then loaded failed the startup, and with
        #: --exit-on-error the server exited (a red team's REST load, 3 of 5 tries)
        self.starting = False
        #: --strict-readiness: a model that failed keeps the server not ready (as Triton)
        self.strict_readiness = True
        #: what each repository version was loaded from (poll)
        self._stamps: dict[tuple[str, int], tuple] = {}
        #: whether what a client sends (a model's bytes, an imported blob, a load's file
        #: overrides, a config naming code) is trusted as the repository's files are: a
        #: model that runs code when loaded (a PyTorch program, a Python model) then loads.
        #: --allow-code-from-clients, off by default; repository loads are always trusted
        self.client_trusted = allow_code_from_clients
        #: --model-load-on-demand: what loads and unloads the repository's models as requests
        #: come (``on_demand.py``, which sets it); None: the repository loads at startup
        self.on_demand: OnDemand | None = None
        #: the versions loading, each with the event an unload sets to stop its warm-up
        self.loading = Loading(self.table)
        #: networks made and not yet entered: the heap's freezes when each was begun
        self._begun: weakref.WeakKeyDictionary[CompiledNetwork, int] = weakref.WeakKeyDictionary()
        #: QueryNetworks, one at a time per tenant (``turns.py``)
        self._queries = Turns(
            "QueryNetwork",
            max_queries,
            " (a quarter of --grpc-workers), so that they never hold the threads inference needs",
        )

    # --- networks

    def load(
        self,
        name: str,
        model: bytes | str | Path,
        device: str = "",
        config: Mapping[str, str] | None = None,
        persist: bool = False,
        version: int = 0,
        max_batch_size: int = 0,
        dynamic_batching: bool = True,
        batch_size: int = 0,
        sequence: SequenceSettings | None = None,
        queue: QueuePolicy | None = None,
        warmup: Warmup | None = None,
        *,
        trusted: bool = False,
    ) -> tuple[LoadedNetwork, bool]:
        """Compile and register a network; returns it and whether it came from the cache.

        ``trusted``: ``model`` is the operator's (a file of the repository on disk), so a model
        that runs code when loaded may load (``Core.load_network``); a client's bytes are
        trusted only under --allow-code-from-clients (:attr:`client_trusted`).

        Dynamic batching: a network with ``max_batch_size`` > 0 (a repository model's
        ``config.json``) is loaded as ``BATCH:<device>(<max_batch_size>)``, so concurrent
        requests are gathered into batches of up to that many rows, unless its device already
        is a BATCH device (which then decides the batch size). BATCH wraps one plain device:
        a HETERO, MULTI or AUTO device is loaded as it is, without dynamic batching.
        ``dynamic_batching=False`` (a Triton config.pbtxt without dynamic_batching): no BATCH.
        ``batch_size``: the rows BATCH gathers, when not ``max_batch_size`` (Triton's preferred
        size). ``max_batch_size`` always bounds each request's rows. ``queue``: Triton's queue
        policies, which admit its requests (with priority levels, BATCH lets
        :data:`WAITING_WITH_PRIORITIES` wait in its batcher, where they are ordered).
        ``warmup``: Triton's model_warmup, run on every stream before the network is listed
        (``warmup.py``), as are the streams' requests made when CUDA_GRAPH_SHAPES lists shapes
        to capture.
        """
        check_name(name)
        check_version(version)
        if self.plane.draining:
            raise ShuttingDown(f"network {name!r}: the server is shutting down; not loading it")
        self._check_model_size(model, "LoadNetwork")
        device = device or self.default_device
        if dynamic_batching:
            device = batch_device(device, batch_size or max_batch_size)
        config = dict(config or {})
        if queue is not None and queue.levels > 1 and parse_device(device).kind == "BATCH":
            config.setdefault("BATCH_WAITING", str(WAITING_WITH_PRIORITIES))
        if persist and self.repository is None:
            raise FailedPrecondition("persist needs a server started with --model-repository")
        if persist and not isinstance(model, bytes):
            raise InvalidArgument("persist needs the model as bytes")
        with self.table.lock:
            if not version:  # the next free one: past those loaded and those loading (two
                # loads at once both took the same version, and one was refused)
                loading = (v for n, v in self.table.loading if n == name)
                loaded = max([*self.table.by_name.get(name, {}), *loading], default=0)
                stored = (
                    self.repository.next_version(name) - 1 if (persist and self.repository) else 0
                )
                version = next_version(max(loaded, stored), name)
            if version in self.table.by_name.get(name, {}) or (name, version) in self.table.loading:
                raise InvalidArgument(
                    f"network {name!r} version {version} is already loaded; unload it first "
                    "or load another version"
                )
            self._check_network_count(name, version, len(self.table.loading))
            stop = self.loading.begin(name, version)
        try:
            network = self._compile(name, model, device, config, trusted)
            network.name = name
            self._warm(network, name, config, warmup, stop)
            if persist:
                self.repository.persist(name, version, model, device, config, max_batch_size)
            entry = self._entry(name, version, device, network, persist, max_batch_size)
            self._queued(entry, queue)
            self._sequenced(entry, sequence)
            with self.table.lock:
                self.table.by_name.setdefault(name, {})[version] = entry
        finally:
            self.loading.end(name, version)
        log.info(
            "network %s version %d ready on %s%s%s",
            name,
            version,
            entry.device,
            f" in {network.precision}" if network.precision else "",
            " (from cache)" if network.loaded_from_cache else "",
        )
        return entry, network.loaded_from_cache

    def _entry(
        self,
        name: str,
        version: int,
        device: str,
        network: CompiledNetwork,
        persisted: bool,
        max_batch_size: int,
    ) -> LoadedNetwork:
        kind = str(parse_device(device))
        if network.max_batch_size is not None:  # its own config decided (auto_complete_config)
            max_batch_size = network.max_batch_size
        recorder = self.metrics.recorder(kind, name, version, network.precision)
        entry = LoadedNetwork(
            name, version, kind, network, persisted, max_batch_size, recorder, self.queue_size
        )
        with contextlib.suppress(TypeError):
            entry.made_after_freezes = self._begun.pop(network, None)
        return entry

    def _queued(self, entry: LoadedNetwork, policy: QueuePolicy | None) -> None:
        """Give ``entry`` Triton's queue policies (its config's dynamic_batching), before it
        serves a request."""
        if policy is not None:
            entry.queue = PolicyQueue(entry.name, policy, self.plane.queue_timeouts)

    def _sequenced(self, entry: LoadedNetwork, settings: SequenceSettings | None) -> None:
        """Give ``entry`` its sequence batcher (Triton's sequence_batching); its state outputs
        are then the server's, not an answer's. A network that passes sequence requests on
        (an ensemble of a sequence model: ``sequences_for``) gets what relays them instead."""
        if settings is None:  # an ensemble of a sequence model relays its sequences
            entry.sequences = entry.network.sequences_for(self.plane.admission(entry))
            return
        try:
            entry.sequences = SequenceBatcher(
                entry.name,
                settings,
                entry.max_batch_size,
                entry.network.inputs,
                entry.output_names,
                self.plane.admission(entry),
                self.sequences,
                entry.recorder.joined,
            )
        except PlugserveError:
            close_network(entry)
            raise
        batcher = entry.sequences
        entry.output_names = [n for n in entry.output_names if n not in batcher.hidden_outputs]
        entry.inputs = [s for s in entry.inputs if s.name not in batcher.hidden_inputs]
        entry.outputs = [s for s in entry.outputs if s.name not in batcher.hidden_outputs]

    def unload(self, name: str, version: int = 0, remove: bool = False) -> int:
        """Unload a version (every version when 0); ``remove`` also deletes it from the
        repository. Files are never deleted implicitly: an operator's models stay on disk.
        A name nothing is loaded under is NOT_FOUND, or INVALID_ARGUMENT when it could never
        name a model (``check_name``: ``..``, ``a/b``, control characters, empty); a model
        that failed to load is unloaded (its failure forgotten), as Triton's. Returns once
        each version's admitted requests are answered (at most --model-unload-timeout) and
        it is closed, its memory given back (``retire.py``); how many versions went.

        A version still loading is stopped at its warm-up's next run (its load fails,
        Cancelled) and waited for, and counts as one that went: an unload of a model is never
        outrun by a load of it already under way."""
        stopped = self.loading.stop(name, version, self.retirement.timeout)
        with self.table.lock:
            versions = self.table.by_name.get(name)
            if stopped and (not versions or (version and version not in versions)):
                return stopped
            if not versions and not version and any(k[0] == name for k in self.table.failed):
                self._loaded(name)  # a model that failed to load, unloaded: no longer failed
                return 0
            if not versions or (version and version not in versions):
                if not versions:
                    check_name(name)
                raise self.table.missing(name, version)
            targets = [versions.pop(version)] if version else list(versions.values())
            if version == 0 or not versions:
                versions.clear()
                del self.table.by_name[name]
                self._loaded(name)  # an unloaded model is not a failed one (as Triton's)
        closed = []
        while targets:  # (popped: nothing here holds a network while its memory goes back)
            entry = targets.pop()
            if remove and entry.persisted and self.repository is not None:
                self.repository.remove(name, entry.version)
            closed.append(self.retirement.retire(entry, keep_series=False))
            entry = None  # type: ignore[assignment]
        for done in closed:
            done.wait(self.retirement.timeout + 60)  # (and the close, bounded by its device)
        return len(closed)

    def _compile(
        self,
        name: str,
        model: bytes | str | Path,
        device: str,
        config: Mapping[str, str],
        trusted: bool,
    ) -> CompiledNetwork:
        """Core.load_network, with a device's own exceptions as a typed INTERNAL error."""
        before = freezes()  # (none of it is frozen unless the heap is frozen meanwhile)
        try:
            with self._reading(model, f"network {name!r}"):
                network = self.core.load_network(model, device, config, trusted=trusted)
        except PermissionDenied as exc:  # code from a client: say which setting allows it
            raise PermissionDenied(f"{exc} ({ALLOW_CODE})") from exc
        except PlugserveError:
            raise
        except Exception as exc:
            log.exception("network %s: loading on %s failed", name, device)
            raise InferenceError(
                f"network {name!r}: loading on {device} failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            refuse_non_tensors(network, f"network {name!r}")
        except PlugserveError:
            network.close()
            raise
        with contextlib.suppress(TypeError):  # (a plugin's network that cannot be a key)
            self._begun[network] = before  # (its entry's: retire.py need not thaw for it)
        return network

    def _warm(
        self,
        network: CompiledNetwork,
        name: str,
        config: Mapping[str, str],
        warmup: Warmup | None,
        stop: threading.Event | None = None,
    ) -> None:
        """The warm-up of a network just compiled (``warmup.py``), under the memory budget;
        one that fails, or that an unload stops (``stop``: before, during or after its
        warm-up, ``loading.py``), is closed and its error fails the load."""
        try:
            check_stop(stop, name, "loaded")
            graphs = bool(config.get("CUDA_GRAPH_SHAPES"))
            warm_up(network, warmup, name, graphs, self.plane.budget, stop)
            check_stop(stop, name, "warmed up")
        except BaseException:
            network.close()
            raise

    def _check_model_size(self, model: Any, what: str) -> None:
        """--max-model-bytes, before anything parses the model (a file path is the
        operator's repository and is not limited)."""
        limit = self.max_model_bytes
        if limit and isinstance(model, bytes | bytearray | memoryview) and len(model) > limit:
            raise InvalidArgument(
                f"{what}: the model is {len(model)} bytes, over this server's limit of "
                f"{limit} bytes (--max-model-bytes / PLUGSERVE_MAX_MODEL_BYTES)"
            )

    def _reading(self, model: Any, what: str) -> contextlib.AbstractContextManager[None]:
        """One read's share of the memory budget, held while ``model`` (a model's bytes or
        file, a blob) is read (``read_charge.py``): a client's bytes are refused at once when
        it has no room, the repository's files wait for it. A folder (a generative model, a
        Python model) is not a graph to read: nothing is held for it."""
        sent = isinstance(model, bytes | bytearray | memoryview)
        if not sent and not (isinstance(model, str | Path) and Path(model).is_file()):
            return contextlib.nullcontext()
        return read_charge(self.plane.budget, what, wait=not sent)

    def _check_network_count(self, name: str, version: int, loading: int) -> None:
        """--max-networks: loaded plus loading network versions (call with the lock held)."""
        limit = self.max_networks
        loaded = sum(len(v) for v in self.table.by_name.values()) + loading
        if limit and loaded >= limit:
            raise ResourceExhausted(
                f"cannot load network {name!r}"
                + (f" version {version}" if version else "")
                + f": {loaded} network version(s) are loaded or loading, the limit is {limit} "
                "(--max-networks / PLUGSERVE_MAX_NETWORKS); unload one first"
            )

    def networks(self) -> list[LoadedNetwork]:
        """Every loaded network version."""
        return self.table.all()

    # --- readiness

    def unready(self) -> list[str]:
        """Why the server is not ready (empty: it is): :meth:`failures` under Triton's strict
        readiness (``--strict-readiness``, on by default); nothing with it off."""
        return self.failures() if self.strict_readiness else []

    def failures(self) -> list[str]:
        """One line per model that cannot be served: a model the server was asked to serve
        that failed to load (at startup, by a poll, by a repository load request), or an
        ensemble or pipeline with a step whose model is not loaded."""
        with self.table.lock:
            failed = sorted(self.table.failed.items())
            entries = self.table.all()
        reasons = [
            f"model {name!r}" + (f" version {version}" if version else "") + f": {why}"
            for (name, version), why in failed
        ]
        for entry in sorted(entries, key=lambda e: (e.name, e.version)):
            reasons += entry.network.unready_reasons()  # an ensemble's missing steps
        return reasons

    def _loaded(self, name: str, version: int | None = None) -> None:
        """``version`` of ``name`` loaded (None: the model was unloaded): it, and the model
        as a whole, have failed no longer."""
        if version is not None and self.on_demand is not None:
            self.on_demand.loaded(name)
        with self.table.lock:
            for key in [k for k in self.table.failed if k[0] == name]:
                if version is None or key[1] in (0, version):
                    del self.table.failed[key]

    def _failed_at(self, problem: str) -> str:
        """Keep a repository problem (its message begins with the file it is about) as the
        failure of the model whose folder that is, and name that model ("": one outside any
        model's folder, an OVMS config.json, stands for itself)."""
        root = str(self.repository.root) if self.repository is not None else ""
        where = problem.partition(": ")[0]
        name = where[len(root) + 1 :].partition("/")[0] if where.startswith(root + "/") else ""
        with self.table.lock:
            self.table.failed[(name or problem, 0)] = problem
        return name

    # --- the rest of the plugin API

    def subgraphs(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """The split a HETERO load would make (empty for devices that do not split)."""
        plugin, merged = self.core.resolve(device, config)
        try:
            with self._reading(model, "QueryNetwork"):
                return plugin.subgraphs(model, merged)
        except PlugserveError:  # some node has no device: the query itself says which
            return []

    def refusals(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for the nodes a virtual device's devices did not take
        (empty for a real device: ``query`` gives its reasons)."""
        plugin, merged = self.core.resolve(device, config)
        with self._reading(model, "QueryNetwork"):
            return plugin.refusals(model, merged)

    @contextlib.contextmanager
    def querying(self, tenant: str, gone: Callable[[], bool]) -> Iterator[None]:
        """A QueryNetwork's bounds, around all it does: its tenant's turn (``turns.py``),
        then --max-read-seconds for the whole of it, and a stop once its caller is gone
        (``gone()``; the work asks at its steps: ``cancel.check``)."""
        seconds = reading.limits().seconds
        with (
            self._queries.turn(tenant, gone),
            cancel.stop_when(gone, seconds, reading.READ_SECONDS),
        ):
            yield

    def query(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """The supported nodes and why the others are not, of one read of the model (a
        device that can answers both at once: ``Plugin.query_with_reasons``)."""
        self._check_model_size(model, "QueryNetwork")
        with self._reading(model, "QueryNetwork"):
            supported, reasons = self.core.query_with_reasons(model, device, config)
        return supported, {k: v for k, v in reasons.items() if k not in supported}

    def export(self, name: str, version: int = 0) -> bytes:
        return self.plane.get(name, version).network.export()

    def import_network(
        self, name: str, blob: bytes, device: str, config: Mapping[str, str] | None = None
    ) -> LoadedNetwork:
        check_name(name)
        if self.plane.draining:
            raise ShuttingDown(f"network {name!r}: the server is shutting down; not loading it")
        self._check_model_size(blob, "ImportNetwork")
        device = device or self.default_device
        with self.table.lock:
            self._check_network_count(name, 0, len(self.table.loading))
        before = freezes()
        try:
            with self._reading(blob, f"ImportNetwork of {name!r}"):
                network = self.core.import_network(
                    blob, device, config, trusted=self.client_trusted
                )
        except PermissionDenied as exc:  # an exported program is its archive: code
            raise PermissionDenied(f"{exc} ({ALLOW_CODE})") from exc
        network.name = name
        with contextlib.suppress(TypeError):
            self._begun[network] = before
        with self.table.lock:
            version = next_version(max(self.table.by_name.get(name, {}), default=0), name)
            self._check_network_count(name, version, len(self.table.loading))
            entry = self._entry(name, version, device, network, False, 0)
            self.table.by_name.setdefault(name, {})[version] = entry
        return entry

    def repository_model(self, path: str) -> tuple[Path, str, dict[str, str], int]:
        """A model named by ``name`` or ``name/version`` in the repository, with its settings."""
        if self.repository is None:
            raise FailedPrecondition("this server has no model repository")
        name, _, version = path.partition("/")
        if version and not is_version(version):
            raise InvalidArgument(f"repository path {path!r}: expected NAME or NAME/VERSION")
        model, settings = self._stored(name, int(version or 0))
        device, config = self._placed(name, settings, model)
        return model, device, config, settings.max_batch_size

    def _placed(
        self, name: str, settings: ModelSettings, model: Any = None
    ) -> tuple[str, dict[str, str]]:
        """The device and config a repository model (``model``, its file) loads with: its
        own, or where its Triton ``instance_group`` places it (``placement.py``, with the CPU
        fallback of an ONNX graph on one GPU; the config's own NUM_STREAMS stays the
        user's)."""
        device, config = settings.device, settings.config
        if settings.placement is not None:
            device, placed = place(
                settings.placement, device or self.default_device, self.core, f"model {name!r}",
                model,
            )  # fmt: skip
            config = {**placed, **config}
        if settings.graphs:
            if runs_on_torch(device or self.default_device):
                config = {**settings.graphs, **config}  # parameters' own keys win
            else:
                log.warning(
                    "model %r: not acted on: optimization.cuda (CUDA graphs are TORCH's and "
                    "GPU's; the model runs on %s)", name, device or self.default_device,
                )  # fmt: skip
        return device, config

    def version_policy(self, name: str) -> VersionPolicy:
        """Which versions of ``name`` the repository loads (every one for a model loaded by an
        RPC, or kept by config.json; Triton's and OVMS's own policy for theirs)."""
        if self.repository is not None:
            with contextlib.suppress(PlugserveError, OSError):
                return self.repository.read_settings(name).policy
        return EVERY_VERSION

    def _stored(
        self, name: str, version: int = 0, repository: Repository | None = None
    ) -> tuple[Path, ModelSettings]:
        repository = repository or self.repository
        if repository is None:
            raise FailedPrecondition("this server has no model repository")
        model = repository.model_path(name, version)
        settings = repository.read_settings(name)
        if settings.pipeline is not None:  # an OVMS pipeline: its config.json, version 1
            return model, settings
        return model, repository.read_settings(name, Repository.version_of(model))

    def versions(self, name: str, version: int = 0) -> list[LoadedNetwork]:
        """The loaded version asked for, or every loaded version of ``name`` (0); NotFound
        names what is loaded."""
        with self.table.lock:
            found = self.table.by_name.get(name, {})
            if version in found or (not version and found):
                return [found[version]] if version else [found[v] for v in sorted(found)]
            raise self.table.missing(name, version)

    def refuse_code_keys(self, config: Mapping[str, Any] | None, where: str) -> None:
        """A client's config (a load's, an import's, SetConfig's, a load override's) may not
        name code for the server to run (:data:`CODE_KEYS`: a Python model's interpreter),
        unless --allow-code-from-clients: PermissionDenied saying where it is set instead."""
        named = sorted(CODE_KEYS.intersection(config or ()))
        if named and not self.client_trusted:
            raise PermissionDenied(
                f"{where}: {', '.join(named)} names a program the server would run, which only "
                "the model repository's own config.pbtxt may name; a client may not "
                f"({ALLOW_CODE})"
            )

    def check_control(self, what: str, client: bool = True) -> None:
        """Load and unload requests are refused in Triton's none and poll modes, and a
        ``client``'s while the server loads its repository at startup (UNAVAILABLE: retry
        once it is ready; a Python model's initialize may load the models it calls)."""
        if self.starting and client:
            raise Starting(
                f"{what}: the server is starting and loading its model repository; retry "
                "once it is ready (/v2/health/ready)"
            )
        if self.control_mode in ("none", "poll"):
            raise ControlDisabled(
                f"{what}: model load and unload requests are not allowed with "
                f"--model-control-mode {self.control_mode} (the repository decides what is "
                "loaded); start the server with --model-control-mode explicit to allow them"
            )

    def load_with_overrides(self, name: str, config: str | None, files: dict[str, bytes]) -> None:
        """Triton's RepositoryModelLoad with overrides: ``config`` (a ModelConfig as JSON)
        replaces the model's configuration, ``files`` (``<version>/<file name>`` -> bytes) its
        version folders (then ``config`` is required, as in Triton). They are written to a
        private folder, loaded from it (seamlessly, as :meth:`reload`), which is removed when
        the networks loaded from it are gone; the repository on disk is left as it is."""
        check_name(name)
        if files and config is None:
            raise InvalidArgument(
                f"model {name!r}: file overrides need a 'config' override too (as in Triton)"
            )
        for data in files.values():
            self._check_model_size(data, "RepositoryModelLoad")
        scratch = OverrideFolder()  # (held by the networks loaded from it)
        tmp = scratch.path
        folder = tmp / name
        folder.mkdir()
        write_overrides(folder, name, config, files)
        if not files:  # the repository's versions, with the new configuration
            model = self._stored(name)[0]
            if model == self.repository.folder(name):  # a transformers folder as it is
                (folder / "1").symlink_to(model.resolve(), target_is_directory=True)
            for version in self.repository.folder(name).iterdir():
                if is_version(version.name) and version.is_dir():
                    (folder / version.name).symlink_to(version.resolve())
        overridden = Repository(tmp)
        entries, problems = overridden.scan()
        if problems:
            raise InvalidArgument(f"model {name!r}: {'; '.join(problems)}")
        for entry in entries:
            settings = self._stored(name, entry.version, overridden)[1]
            refuse_server_keys(settings.config, f"model {name!r}: the load's 'config'")
            self.refuse_code_keys(settings.config, f"model {name!r}: the load's 'config'")
        if not entries:
            raise InvalidArgument(f"model {name!r}: the overrides give no version to load")
        # without files, the versions are the repository's own (linked above): the
        # operator's files, as any repository load; files sent are a client's
        trusted = not files or self.client_trusted
        for entry in entries:
            self.reload(name, entry.version, overridden, trusted=trusted).keeps = scratch

    def load_request(self, name: str, parameters: Mapping[str, Any]) -> None:
        """RepositoryModelLoad for both protocols: a reload, or one with Triton's overrides
        (``config``: ModelConfig JSON; ``file:<version>/<name>``: a file's bytes). Whatever
        fails says Triton's ``failed to load 'NAME'`` first, which its clients match on."""
        try:
            config = parameters.get("config")
            if config is not None and not isinstance(config, str):
                raise InvalidInput(f"model {name!r}: the 'config' parameter must be a JSON string")
            files = {k[5:]: v for k, v in parameters.items() if k.startswith("file:")}
            for key, value in files.items():
                if not isinstance(value, bytes):
                    raise InvalidInput(f"model {name!r}: 'file:{key}' must carry the file's bytes")
            if config is None and not files:
                self.reload(name)
            else:
                self.load_with_overrides(name, config, files)
        except PlugserveError as exc:
            error = failed_to_load(name, exc)
            if error is exc:
                raise
            raise error from exc

    def reload(
        self,
        name: str,
        version: int = 0,
        repository: Repository | None = None,
        *,
        trusted: bool = True,
    ) -> LoadedNetwork:
        """Load the repository's ``version`` of ``name`` (0: its latest), as Triton reloads:
        the new network is compiled while the loaded one (if any) still serves, then takes its
        place in one step; requests admitted by the old one finish there, and it closes after
        them. ``repository``: another than the server's (load overrides); ``trusted``: its
        files are the operator's (false for a load's file overrides: see :meth:`load`)."""
        if self.plane.draining:
            raise ShuttingDown(f"model {name!r}: the server is shutting down; not loading it")
        try:
            entry = self._reload(name, version, repository, trusted)
        except (NotFound, LoadStopped):
            raise  # no such model or version, or it was unloaded: nothing failed
        except PlugserveError as exc:
            with self.table.lock:
                loaded = self.table.by_name.get(name, {})
                if not (version in loaded if version else loaded):  # the old one serves on
                    self.table.failed[(name, version)] = str(exc)
            raise
        self._loaded(name, entry.version)
        return entry

    def _reload(
        self, name: str, version: int, repository: Repository | None, trusted: bool
    ) -> LoadedNetwork:
        model, settings = self._stored(name, version, repository)
        stamp = self.repository.stamp(name, model) if self.repository else ()
        # the repository layout is NAME/VERSION/model.onnx (a transformers folder: NAME/VERSION/
        # or NAME/ itself, version 1); an OVMS pipeline is version 1
        version = 1 if settings.pipeline is not None else Repository.version_of(model)
        self._check_model_size(model, "RepositoryModelLoad")
        device, config = self._placed(name, settings, model)
        batch = settings.max_batch_size
        device = device or self.default_device
        if settings.dynamic_batching:
            device = batch_device(device, settings.batch_size or batch)
        with self.table.lock:
            old = self.table.by_name.get(name, {}).get(version)
            if (name, version) in self.table.loading:
                raise NotReady(  # (another load of it is under way: UNAVAILABLE, retry)
                    f"model {name!r} version {version} is being loaded; retry once it is ready"
                )
            if old is None:
                self._check_network_count(name, version, len(self.table.loading))
            stop = self.loading.begin(name, version)
        try:
            source = settings.pipeline if settings.pipeline is not None else model
            network = self._compile(name, source, device, dict(config), trusted)
            network.name = name
            self._warm(network, name, config, settings.warmup, stop)
            # from the repository's files, or from a load's overrides (not the repository's:
            # on demand neither counts nor unloads it, an unload never removes its files)
            entry = self._entry(name, version, device, network, repository is None, batch)
            entry.labels = dict(settings.labels)
            entry.formats = dict(settings.formats)
            entry.dims = dict(settings.dims)
            self._queued(entry, settings.queue)
            self._sequenced(entry, settings.sequence)
            with self.table.lock:
                self.table.by_name.setdefault(name, {})[version] = entry
                self._stamps[(name, version)] = stamp
        finally:
            self.loading.end(name, version)
        log.info("network %s version %d %s on %s", name, version,
                 "reloaded" if old else "ready", entry.device)  # fmt: skip
        if old is not None:  # closed once the requests it admitted are done; its
            # replacement takes any that reach it later (DataPlane._admit)
            self.retirement.retire(old, keep_series=old.device == entry.device)
        return entry

    def index(self, ready_only: bool = False) -> list[tuple[str, int, str, str]]:
        """``(name, version, state, reason)`` for every loaded, loading or stored network
        version, sorted, as Triton's repository index: READY (it serves), LOADING, or
        UNAVAILABLE with why: a loaded ensemble whose step is not loaded (it was listed READY
        while every request was UNAVAILABLE, a red team's), the failure of a model that failed
        to load, or "unloaded"."""
        loaded = {(n.name, n.version): n for n in self.networks()}
        stored: set[tuple[str, int]] = set()
        if self.repository is not None:
            entries, _ = self.repository.scan()
            stored = {(e.name, e.version) for e in entries}
        with self.table.lock:
            loading = set(self.table.loading)
            failed = dict(self.table.failed)
        rows = []
        for name, version in set(loaded) | stored | loading:
            entry = loaded.get((name, version))
            unready = entry.network.unready_reasons() if entry is not None else []
            if entry is not None and not unready:
                state, reason = "READY", ""
            elif entry is not None:
                state, reason = "UNAVAILABLE", "; ".join(unready)
            elif (name, version) in loading:
                state, reason = "LOADING", ""
            else:
                why = failed.get((name, version)) or failed.get((name, 0))
                state, reason = "UNAVAILABLE", why or "unloaded"
            if state == "READY" or not ready_only:
                rows.append((name, version, state, reason))
        return sorted(rows)

    def load_repository(
        self, names: Collection[str] | None = None
    ) -> tuple[list[LoadedNetwork], list[str]]:
        """Load every model of the repository (only ``names``, when given); one bad model does
        not stop the others."""
        if self.repository is None:
            return [], []
        self.repository.clean_staging()
        entries, problems = self.repository.scan()
        if names is not None:
            found = {e.name for e in entries}
            for n in sorted(set(names) - found):
                problems.append(f"--load-model {n}: no such model in the repository")
                with self.table.lock:
                    self.table.failed[(n, 0)] = problems[-1]
            entries = [e for e in entries if e.name in names]
        if self.repository.root.is_dir():  # else no model failed: there is none to serve
            for problem in problems:
                self._failed_at(problem)
        ready: list[LoadedNetwork] = []
        # ensembles after the models their steps run (their load checks the steps' types)
        first = [e for e in entries if e.device != "ENSEMBLE"]
        then = [e for e in entries if e.device == "ENSEMBLE"]
        # one at a time: an ensemble refuses to run itself through one loaded before it
        for outcome in [*self._each(self._load_entry, first), *map(self._load_entry, then)]:
            if isinstance(outcome, LoadedNetwork):
                ready.append(outcome)
            else:
                problems.append(outcome)
        return ready, problems

    def _load_entry(self, entry: ModelEntry) -> LoadedNetwork | str:
        """One repository version loaded, or what went wrong with it (its file first)."""
        try:
            pipeline = entry.settings.pipeline
            device, config = self._placed(entry.name, entry.settings, entry.path)
            loaded, _ = self.load(
                entry.name,
                pipeline if pipeline is not None else entry.path,
                device,
                config,
                version=entry.version,
                max_batch_size=entry.max_batch_size,
                dynamic_batching=entry.settings.dynamic_batching,
                batch_size=entry.settings.batch_size,
                sequence=entry.settings.sequence,
                queue=entry.settings.queue,
                warmup=entry.settings.warmup,
                trusted=True,  # the repository on disk: the operator's files
            )
        except PlugserveError as exc:
            with self.table.lock:
                self.table.failed[(entry.name, entry.version)] = str(exc)
            return f"{entry.path}: {exc}"
        self._loaded(entry.name, entry.version)
        loaded.persisted = True
        loaded.labels = dict(entry.settings.labels)
        loaded.formats = dict(entry.settings.formats)
        loaded.dims = dict(entry.settings.dims)
        stamp = self.repository.stamp(entry.name, entry.path)
        with self.table.lock:
            self._stamps[(entry.name, entry.version)] = stamp
        return loaded

    def _each(self, load: Callable[[_Item], _Outcome], items: list[_Item]) -> list[_Outcome]:
        """``load`` of every item, ``load_threads`` at a time (Triton's model load threads), in
        the items' order. Each version loads on its own: one that fails or is slow holds up
        none of the others, and the caller sees every outcome once all are done. Then the
        loads' scratch memory goes back to the system (see give_back_freed_memory)."""
        if not items:
            return []
        if self.load_threads == 1 or len(items) == 1:
            outcomes = [load(item) for item in items]
        else:
            threads = min(self.load_threads, len(items))
            with ThreadPoolExecutor(threads, thread_name_prefix="model-load") as pool:
                outcomes = list(pool.map(load, items))
        give_back_freed_memory()
        return outcomes

    def poll_repository(self) -> list[str]:
        """One look at the repository (--model-control-mode poll): versions added are loaded,
        removed ones unloaded, changed ones (model or config file) reloaded seamlessly.
        Networks loaded by request without ``persist`` are not the repository's: left alone.
        Returns what went wrong, one line each."""
        if self.repository is None or self.plane.draining:
            return []
        entries, problems = self.repository.scan()
        wanted = {(e.name, e.version): e for e in entries}
        with self.table.lock:  # the repository decides anew: what fails again is retried below
            self.table.failed.clear()
        troubled = set()  # models the scan could not read whole this time
        if self.repository.root.is_dir():
            for problem in problems:
                troubled.add(self._failed_at(problem))
        ours = {(n.name, n.version) for n in self.networks() if n.persisted}
        changed = [
            entry
            for (name, version), entry in sorted(wanted.items())
            if (name, version) not in ours
            or self._stamps.get((name, version)) != self.repository.stamp(name, entry.path)
        ]
        # what is new loads before what it replaces goes, and a model whose files are being
        # written (a config.pbtxt rewritten in place, a version folder copied in before its
        # model file) keeps what it serves: a red team's model answered 404 for the whole
        # write, its versions unloaded before anything replaced them
        failed = self._each(self._reload_entry, changed)
        troubled |= {entry.name for entry, problem in zip(changed, failed) if problem}
        problems += [p for p in failed if p]
        for name, version in sorted(ours - wanted.keys()):
            if name in troubled:
                continue
            with contextlib.suppress(NotFound):
                self.unload(name, version)
                self._stamps.pop((name, version), None)
                log.info("repository poll: %s version %d removed: unloaded", name, version)
        for problem in problems:
            log.error("repository poll: %s", problem)
        return problems

    def _reload_entry(self, entry: ModelEntry) -> str:
        """:meth:`reload` of a repository version; what went wrong, or "" when it loaded."""
        try:
            self.reload(entry.name, entry.version)
        except PlugserveError as exc:
            return f"{entry.path}: {exc}"
        return ""

    def close(self) -> None:
        """Stop every network's streams: what is queued still runs, nothing new is taken."""
        self.sequences.close()
        for entry in self.networks():
            end_sequences(entry)
            entry.executor.shutdown(wait=False)
