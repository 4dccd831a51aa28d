"""The HETERO device: one network split across devices by node affinity.

Affinity comes from the user first (config ``AFFINITY`` as JSON, or an ``affinity`` entry in a
node's ONNX ``metadata_props``), then, for the other nodes, from each device's QueryNetwork in
priority order (``DEVICE_PRIORITIES``; ``HETERO:A,B`` sets it). The nodes are then grouped into
subgraphs by the algorithm of seed 000 (:mod:`plugserve.plugins.hetero.partition`), each
subgraph is cut into an ONNX model of its own and compiled on its device, and a request runs the
subgraphs in topological order, handing tensors from one to the next.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from plugserve.plugins import cancel, reading
from plugserve.plugins.api import (
    CompiledNetwork,
    InvalidArgument,
    InvalidModel,
    Model,
    NotFound,
    PlugserveError,
    listing,
    refusal_reasons,
)
from plugserve.plugins.hetero.check import REFERENCE, wrong_piece
from plugserve.plugins.hetero.compiled import HeteroCompiledNetwork, Step, spec_from_json
from plugserve.plugins.hetero.config import HeteroConfiguration
from plugserve.plugins.hetero.partition import (
    TooLargeError,
    TooManySubgraphsError,
    order_subgraphs,
    partition,
)
from plugserve.plugins.hetero.split import Piece, cut, untyped_crossings
from plugserve.plugins.hetero.typing import type_untyped_values
from plugserve.plugins.ir import Graph, load_model, read_model, subgraph_free_names
from plugserve.plugins.passes import PassContext
from plugserve.plugins.passes.types import infer_extension_types
from plugserve.plugins.virtual import VirtualPlugin

__all__ = ["HeteroPlugin"]

log = logging.getLogger(__name__)

#: Most subgraphs one network is split into. Each is a network of its own (a backend session,
#: its threads) and a tensor hand-over per request; past a few dozen the split is a model
#: built to make the server work, and the partition's rounds grow with the count.
MAX_SUBGRAPHS = 256


class HeteroPlugin(VirtualPlugin):
    name = "HETERO"
    config_class = HeteroConfiguration
    cancellation = "between pieces, and within each as its device"

    # --- helpers

    def _priorities(self, config: HeteroConfiguration) -> list[str]:
        priorities = config.priorities()
        if not priorities:
            raise InvalidArgument(
                "HETERO needs a device list: use HETERO:A,B or set DEVICE_PRIORITIES"
            )
        devices = self._devices()
        for device in priorities:
            devices.plugin(device)  # NotFound names an unknown or unavailable device
        return priorities

    def affinities(self, graph: Graph, model: Any, config: HeteroConfiguration) -> dict[str, str]:
        """``{node name: device}``: the user's pins first, then QueryNetwork by priority."""
        priorities = self._priorities(config)
        names = {n.name for n in graph.nodes}
        chosen: dict[str, str] = {}
        pinned = {n.name: n.affinity for n in graph.nodes if n.affinity}
        pinned.update(config.affinity())
        for node, device in pinned.items():
            if node not in names:
                raise NotFound(
                    f"AFFINITY names node {node!r}, which is not in model {graph.name!r}"
                )
            if device not in priorities:
                self._devices().plugin(device)  # NotFound names an unknown device
            chosen[node] = device
        for device in priorities:
            for node in self._query(model, device, config):
                chosen.setdefault(node, device)
        return chosen

    def _query(self, model: Any, device: str, config: HeteroConfiguration) -> dict[str, str]:
        """A device's QueryNetwork; one that cannot read the model at all takes no node, and
        every node goes on to the next device (``refusals`` says why)."""
        try:
            return self._devices().query_network(model, device, config.child(device))
        except PlugserveError as exc:
            log.info("HETERO: %s takes no node: %s", device, exc)
            return {}

    def refusals(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for each node and each device of the priority list that
        did not take it: the device's own reason (no kernel, unsupported type, a conversion
        that failed), or that the user pinned the node elsewhere. Devices after the one a
        node went to are not listed: they were never asked for it."""
        cfg = self.merged_config(config, strict=False)
        proto, _ = read_model(model)
        graph = load_model(proto)
        chosen = self.affinities(graph, proto, cfg)
        pinned = {n.name for n in graph.nodes if n.affinity} | set(cfg.affinity())
        order = self._priorities(cfg)
        found: list[tuple[str, str, str]] = []
        for index, device in enumerate(order):
            # the nodes that reached this device: not placed on one before it
            reached = [n.name for n in graph.nodes if chosen.get(n.name) not in order[: index + 1]]
            asked = [n for n in reached if n not in pinned]
            child = cfg.child_strings(device)  # parsed by the device, whose errors say why
            why = refusal_reasons(self._devices(), proto, device, child, asked)
            for node in reached:
                if node in pinned and chosen[node] != device:
                    why[node] = f"pinned to {chosen[node]} by AFFINITY"
            found += [(node, device, why[node]) for node in reached if node in why]
        order_of = {n.name: i for i, n in enumerate(graph.nodes)}
        return sorted(found, key=lambda f: (order_of[f[0]], order.index(f[1])))

    def _typed(self, graph: Graph, priorities: list[str]) -> Graph:
        """Types for values ONNX cannot infer (custom ops), from the devices' extension rules,
        so every cut point between subgraphs is typed."""
        rules: dict[tuple[str, str], Any] = {}
        for device in priorities:
            rules.update(self._devices().plugin(device).type_rules)
        if rules:
            infer_extension_types(graph, PassContext(supports=lambda n, g: True, type_rules=rules))
        type_untyped_values(graph)
        return graph

    def _type_crossings(self, graph: Graph, plan: list[tuple[str, list[int]]]) -> None:
        """Types for the values the plan hands between pieces that ONNX's inference and the
        rules leave without a rank (everything after an If whose branches differ in rank):
        the device making each value says what it computes there, else the reference does.
        A device that cannot answer leaves the value untyped, and :func:`cut` names it."""
        untyped = untyped_crossings(graph, plan)
        if not untyped:
            return
        available = self._devices().available_devices
        for device in dict.fromkeys([*untyped.values(), REFERENCE]):
            asked = [n for n, d in untyped.items() if d == device or device == REFERENCE]
            plugin = self._devices().plugin(device)
            if not asked or device.split(".")[0] not in available:
                continue
            for name, spec in plugin.computed_types(graph, asked).items():
                graph.value_info[name] = spec
                untyped.pop(name, None)
        graph.refresh_types()

    # --- the Plugin API

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        cfg = self.merged_config(config, strict=False)
        proto, _ = read_model(model)
        graph = load_model(proto)
        return self.affinities(graph, proto, cfg)

    def subgraphs(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """The split a load would make, in execution order (for ``plugserve query --graph``)."""
        cfg = self.merged_config(config, strict=False)
        proto, _ = read_model(model)
        graph = load_model(proto)
        plan = self._plan(graph, self.affinities(graph, proto, cfg), self._priorities(cfg))
        return [{"device": d, "nodes": [graph.nodes[i].name for i in nodes]} for d, nodes in plan]

    def _plan(
        self, graph: Graph, chosen: dict[str, str], priorities: list[str]
    ) -> list[tuple[str, list[int]]]:
        missing = [n.name for n in graph.nodes if n.name not in chosen]
        if missing:
            raise InvalidArgument(
                f"model {graph.name!r}: no device in {','.join(priorities)} supports node(s) "
                f"{', '.join(repr(m) for m in missing[:10])}"
                + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            )
        producers = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs if o}
        preds = [
            sorted({producers[x] for x in [*n.inputs, *subgraph_free_names(n)] if x in producers})
            for n in graph.nodes
        ]
        successors: list[list[int]] = [[] for _ in graph.nodes]
        for index, before in enumerate(preds):
            for p in before:
                successors[p].append(index)
        order = list(dict.fromkeys([*priorities, *chosen.values()]))
        affinity = [chosen[n.name] for n in graph.nodes]
        try:
            subgraphs = partition(
                successors,
                affinity,
                order,
                predecessors=preds,
                max_subgraphs=MAX_SUBGRAPHS,
                max_bytes=reading.limits().max_bytes,
            )
        except TooLargeError as exc:
            raise InvalidModel(
                f"model {graph.name!r}: {exc}, more than one read of a model may take "
                f"(--max-read-bytes / PLUGSERVE_MAX_READ_BYTES); send a smaller model, pin "
                "it to fewer devices, or raise the limit"
            ) from None
        except TooManySubgraphsError:
            raise InvalidArgument(
                f"model {graph.name!r}: its node affinities split it into more than "
                f"{MAX_SUBGRAPHS} subgraphs (devices alternate along its paths); HETERO "
                "refuses such a split: pin longer runs of nodes to one device"
            ) from None
        return [(s.device, list(s.nodes)) for s in order_subgraphs(subgraphs, successors)]

    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> CompiledNetwork:
        cfg = self.merged_config(config)
        proto, _ = read_model(model)
        priorities = self._priorities(cfg)
        graph = self._typed(load_model(proto), priorities)
        chosen = self.affinities(graph, proto, cfg)
        checked = REFERENCE in priorities
        while True:  # at most once per device other than the reference
            plan = self._plan(graph, chosen, priorities)
            self._type_crossings(graph, plan)
            pieces = cut(graph, plan)  # untypable: raises
            steps, wrong = self._compile(graph, pieces, cfg, checked)
            if not wrong:
                break
            for step in steps:
                step.network.close()
            for piece, why in wrong:
                log.warning(
                    "HETERO: model %r: %s computes the piece of node(s) %s wrongly (%s); "
                    "it runs on %s instead",
                    graph.name,
                    piece.device,
                    listing(piece.node_names),
                    why,
                    REFERENCE,
                )
                chosen.update(dict.fromkeys(piece.node_names, REFERENCE))
        constants = {
            o.name: graph.initializers[o.name]
            for o in graph.outputs
            if o.name in graph.initializers
        }
        return HeteroCompiledNetwork(
            self, graph.name, cfg, list(graph.inputs), list(graph.outputs), steps, constants
        )

    def _compile(
        self,
        graph: Graph,
        pieces: list[Piece],
        cfg: HeteroConfiguration,
        checked: bool,
    ) -> tuple[list[Step], list[tuple[Piece, str]]]:
        """Each piece compiled on its device; with ``checked``, the pieces whose device
        disagrees with the reference on made-up data (see :mod:`.check`), and why."""
        steps: list[Step] = []
        wrong: list[tuple[Piece, str]] = []
        try:
            for piece in pieces:
                cancel.check(f"HETERO: compiling {graph.name!r}")
                child = cfg.child(piece.device)
                network = self._devices().load_network(piece.model, piece.device, child)
                producers = {o: n.name for n in piece.model.graph.node for o in n.output if o}
                steps.append(
                    Step(
                        piece.device,
                        network,
                        piece.node_names,
                        piece.inputs,
                        piece.outputs,
                        producers,
                    )
                )
                why = wrong_piece(self._devices(), piece, network, cfg) if checked else ""
                if why:
                    wrong.append((piece, why))
        except PlugserveError as exc:
            for step in steps:
                step.network.close()
            raise type(exc)(f"HETERO: a subgraph failed to compile: {exc}") from exc
        return steps, wrong

    def import_network(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> CompiledNetwork:
        _, payload, cfg = self._unpack(data, config)
        try:
            content = json.loads(payload)
            steps = []
            for s in content["steps"]:
                network = self._devices().import_network(base64.b64decode(s["blob"]), s["device"])
                steps.append(Step(s["device"], network, s["nodes"], s["inputs"], s["outputs"]))
            constants = {
                k: np.frombuffer(base64.b64decode(v["data"]), dtype=np.dtype(v["dtype"])).reshape(
                    v["shape"]
                )
                for k, v in content.get("constants", {}).items()
            }
            inputs = [spec_from_json(s) for s in content["inputs"]]
            outputs = [spec_from_json(s) for s in content["outputs"]]
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"exported HETERO network is corrupt: {exc}") from None
        return HeteroCompiledNetwork(
            self, content.get("name", "network"), cfg, inputs, outputs, steps, constants
        )

    def device_name(self) -> str:
        return "HETERO: one network split across devices by node affinity"
