"""HETERO subgraph selection: split a graph into single-device subgraphs.

A pure, dependency-free (numpy only) implementation of the subgraph selection
algorithm of OpenVINO's hetero plugin design overview (the old ``splitGraph`` /
``ade::selectSubgraphs`` of the Inference Engine):

For each device (in priority order):

1. select a *root*: a node with that device's affinity that is not in a subgraph
   constructed before in this round (subgraphs of different roots may overlap);
2. select a node adjacent (predecessor or successor) to a node of the subgraph
   that is neither in it nor in the rejected list; if there is none, **end**;
3. check that the node has the same affinity (and is still unassigned);
4. add it to the subgraph if so, to the rejected list otherwise;
5. check the global condition: no indirect self-reference of the subgraph, i.e.
   for no pair ``(src, dst)`` of subgraph nodes do the ``path`` nodes (reachable
   from ``src`` and reaching ``dst``) intersect the rejected list;
6. on failure remove the *last added* node from the subgraph, add it to the
   rejected list and go to 5 (possibly several rollbacks);
7. go to 2.

The candidate subgraphs of every root are collected, the largest is selected
("always"; the first of the largest on a tie), its nodes are removed, and the
round is repeated on the remaining nodes until that device has no roots left.

The adjacent nodes are visited depth first, as ``ade::assembleSubgraph`` does
(recursively from the node merged last), but successors first, then
predecessors, each in the order given: that is the order of the design
document's walkthrough (merge 6 and 7 before failing on 4, then roll back 7, 6
and 5); ade's predecessors-first order would fail on 4 right after merging 5.
Pass a list as ``trace`` to record the walkthrough (:class:`Growth`,
:class:`Step` and :class:`Selection`).

Scale: the transitive closure is one bitset (a Python int) per node, for the
descendants and for the ancestors. The path nodes of ``(src, dst)`` are
``desc[src] & anc[dst]``, so "some pair's path nodes meet the rejected list" is
exactly ``desc(S) & anc(S) & rejected != 0`` with ``desc(S)``/``anc(S)`` the
unions over the subgraph (in a DAG a node cannot be both a descendant and an
ancestor of the same node, so the two ends of such a path always differ). The
unions are kept as prefix stacks in merge order: adding a node is one OR, a
rollback (always of the last added node) is a pop, and a check is one AND, so a
step costs O(n / 64) machine words whatever the subgraph size. A candidate's
growth is reused in the next rounds while nothing it depended on changed (the
availability of the nodes it visited, the closure bits among them), which gives
the same result as growing it again.

One deliberate refinement (``through_subgraphs=True``, the default): nodes of
subgraphs already selected count as one node for the self-reference check (the
closure is updated as if each selected subgraph were contracted), so a path
leaving the subgraph, going through a selected subgraph and coming back counts
as a self-reference. Without it (``through_subgraphs=False``, the text
verbatim) every subgraph is convex but the graph of subgraphs can still have a
cycle, e.g. ``p->x1, p->x2, x1->y1, y2->x2, y1->q, y2->q`` with ``p, x*`` on
one device and ``y*, q`` on the other; :func:`order_subgraphs` raises then.
Neither changes the design document's example.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "CyclicSubgraphsError",
    "Growth",
    "Selection",
    "Step",
    "Subgraph",
    "TooManySubgraphsError",
    "order_subgraphs",
    "partition",
    "predecessors_of",
    "subgraph_edges",
]


class CyclicSubgraphsError(ValueError):
    """The graph of subgraphs has a cycle: there is no execution order."""


class TooManySubgraphsError(ValueError):
    """The partition needs more subgraphs than the caller allows."""


class TooLargeError(ValueError):
    """The partition's bitsets would hold more bytes than the caller allows."""


@dataclass(frozen=True)
class Subgraph:
    """A selected subgraph: a device and its node indices (ascending)."""

    device: str
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class Step:
    """One step of a subgraph's growth, with the state after it.

    ``action`` is ``"root"``, ``"merge"``, ``"reject"`` (failed to merge),
    or ``"rollback"``; ``ok`` is the global condition on that state.
    """

    action: str
    node: int
    subgraph: tuple[int, ...]
    rejected: tuple[int, ...]
    ok: bool


@dataclass
class Growth:
    """The growth of one candidate subgraph from a root."""

    device: str
    possible_roots: tuple[int, ...]
    root: int
    steps: list[Step] = field(default_factory=list)
    result: tuple[int, ...] = ()


@dataclass(frozen=True)
class Selection:
    """The end of a round: the candidates and the one selected (the largest)."""

    device: str
    candidates: tuple[tuple[int, ...], ...]
    selected: tuple[int, ...]


def predecessors_of(successors: Sequence[Sequence[int]]) -> list[list[int]]:
    """The predecessor lists of a successor list, each in ascending order."""
    preds: list[list[int]] = [[] for _ in successors]
    for u, succ in enumerate(successors):
        for v in succ:
            preds[v].append(u)
    return preds


def _indices(bits: int, nbytes: int) -> list[int]:
    """The indices of the set bits of ``bits``, ascending."""
    if not bits:
        return []
    raw = np.frombuffer(bits.to_bytes(nbytes, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


def _bits(indices: Sequence[int], nbytes: int) -> int:
    """A bitset of ``indices``."""
    flags = np.zeros(nbytes * 8, dtype=np.uint8)
    flags[list(indices)] = 1
    return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")


@dataclass
class _Candidate:
    """A candidate subgraph grown from ``root`` and what its growth depended on."""

    root: int
    nodes: list[int]
    visited: list[int]
    touched: list[int]
    visited_bits: int
    steps: list[Step] | None


def _validate(successors, predecessors, affinities, devices) -> list[list[int]]:
    n = len(successors)
    if len(affinities) != n:
        raise ValueError(f"{len(affinities)} affinities for {n} nodes")
    if len(set(devices)) != len(devices):
        raise ValueError(f"duplicate devices in {list(devices)}")
    unknown = sorted(set(affinities) - set(devices))
    if unknown:
        raise ValueError(f"affinities {unknown} are not among the devices {list(devices)}")
    for u, succ in enumerate(successors):
        for v in succ:
            if not u < v < n:
                raise ValueError(f"edge {u}->{v}: the nodes must be in topological order")
        if len(set(succ)) != len(succ):
            raise ValueError(f"duplicate successors of node {u}")
    derived = predecessors_of(successors)
    if predecessors is None:
        return derived
    if len(predecessors) != n or any(
        sorted(p) != d for p, d in zip(predecessors, derived, strict=True)
    ):
        raise ValueError("predecessors do not match successors")
    return [list(p) for p in predecessors]


def partition(
    successors: Sequence[Sequence[int]],
    affinities: Sequence[str],
    devices: Sequence[str],
    *,
    predecessors: Sequence[Sequence[int]] | None = None,
    through_subgraphs: bool = True,
    trace: list | None = None,
    max_subgraphs: int = 0,
    max_bytes: int = 0,
) -> list[Subgraph]:
    """Split a DAG into single-device subgraphs, in selection order.

    ``successors[i]`` (and optionally ``predecessors[i]``) are the indices of the
    nodes adjacent to node ``i``; the nodes are in topological order (every edge
    goes from a lower to a higher index). ``affinities[i]`` is node ``i``'s device
    and ``devices`` the device priority order. Every node ends in exactly one
    subgraph. With ``trace`` a list, the :class:`Growth` of every candidate and the
    :class:`Selection` of every round are appended to it.

    Every round looks at every root still available, so the work is rounds x nodes;
    ``max_subgraphs`` (> 0) bounds the rounds: one more subgraph raises
    :class:`TooManySubgraphsError`, which keeps the work linear in the graph.

    The closure's bitsets and a growth's prefix unions hold up to a node's bit per pair of
    nodes (a chain of 60,000 nodes: 1.4 GB; 120,000 went past 6.8 GB); ``max_bytes`` (> 0)
    bounds what they hold: :class:`TooLargeError` past it. A graph whose nodes all have one
    affinity needs none of it: its subgraphs are its connected components (what every round
    would select, the largest first), found in linear time.
    """
    preds = _validate(successors, predecessors, affinities, devices)
    if trace is None and len(set(affinities)) == 1:
        return _components(successors, preds, affinities[0] if affinities else devices[0])
    selector = _Selector(successors, preds, affinities, devices, trace, max_bytes)
    result: list[Subgraph] = []
    for dev, device in enumerate(devices):
        selector.start_device(dev)
        while True:
            best = selector.select_round(dev, device)
            if best is None:
                break
            result.append(Subgraph(device, tuple(best)))
            if max_subgraphs and len(result) > max_subgraphs:
                raise TooManySubgraphsError(
                    f"the affinities need more than {max_subgraphs} subgraphs"
                )
            selector.take(best, through_subgraphs)
    return result


def _components(
    successors: Sequence[Sequence[int]], preds: Sequence[Sequence[int]], device: str
) -> list[Subgraph]:
    """The subgraphs of a graph on one device: its connected components, the largest first
    (on a tie, the one of the lowest node), each ascending, as the rounds select them."""
    n = len(successors)
    component = [-1] * n
    found: list[list[int]] = []
    for start in range(n):
        if component[start] >= 0:
            continue
        label, nodes, stack = len(found), [start], [start]
        component[start] = label
        while stack:
            u = stack.pop()
            for v in (*successors[u], *preds[u]):
                if component[v] < 0:
                    component[v] = label
                    nodes.append(v)
                    stack.append(v)
        found.append(sorted(nodes))
    found.sort(key=lambda nodes: (-len(nodes), nodes[0]))
    return [Subgraph(device, tuple(nodes)) for nodes in found]


class _Selector:
    """The state one :func:`partition` shares between its rounds: the strict transitive
    closure (``desc[i]`` / ``anc[i]`` exclude ``i``), what is still available, and the
    growths cached per root.

    The growth from a root reads only the availability and (through the rows of the nodes
    it accepted) the closure bits of the nodes it visited, so it is reused in later rounds
    until one of those changes (exactly the same result and steps as growing it again).
    """

    def __init__(
        self,
        successors: Sequence[Sequence[int]],
        preds: Sequence[Sequence[int]],
        affinities: Sequence[str],
        devices: Sequence[str],
        trace: list | None,
        max_bytes: int = 0,
    ) -> None:
        n = self.n = len(successors)
        self.nbytes = (n + 7) // 8
        self.trace = trace
        self.max_bytes = max_bytes
        self.held = 0  # bytes of the closure's bitsets
        # adjacency in visiting order: successors first, then predecessors
        self.adjacent = [tuple(s) + tuple(p) for s, p in zip(successors, preds, strict=True)]
        code = {d: k for k, d in enumerate(devices)}
        self.aff = [code[a] for a in affinities]
        desc = self.desc = [0] * n
        for u in range(n - 1, -1, -1):
            bits = 0
            for v in successors[u]:
                bits |= desc[v] | (1 << v)
            desc[u] = bits
            self._hold(bits)
        anc = self.anc = [0] * n
        for v in range(n):
            bits = 0
            for u in preds[v]:
                bits |= anc[u] | (1 << u)
            anc[v] = bits
            self._hold(bits)
        self.available = bytearray(b"\x01") * n
        self.unassigned = (1 << n) - 1  # `available` as a bitset
        self.roots: list[int] = []
        self.cache: dict[int, _Candidate] = {}
        self.by_visited: dict[int, list[_Candidate]] = {}
        self.by_touched: dict[int, list[_Candidate]] = {}

    def _hold(self, *values: int, extra: int = 0) -> None:
        """Count bitsets about to be kept (with ``extra`` bytes the caller holds besides);
        TooLargeError past ``max_bytes``."""
        size = sum(v.bit_length() for v in values) // 8
        if self.max_bytes and self.held + extra + size > self.max_bytes:
            raise TooLargeError(
                f"partitioning it needs more than {self.max_bytes:,} bytes of reachability "
                f"bitsets ({self.n:,} nodes)"
            )
        self.held += size

    def start_device(self, dev: int) -> None:
        self.roots = [i for i in range(self.n) if self.aff[i] == dev]
        self.cache.clear()
        self.by_visited.clear()
        self.by_touched.clear()

    def select_round(self, dev: int, device: str) -> list[int] | None:
        """One round for ``dev``: a candidate grown from every root not covered by an earlier
        one, and the largest of them (the first on a tie); None when no root is left."""
        available, trace = self.available, self.trace
        roots = self.roots = [r for r in self.roots if available[r]]
        if not roots:
            return None
        covered = bytearray(self.n)
        candidates: list[list[int]] = []
        for r in roots:
            if covered[r]:
                continue
            growth = None
            if trace is not None:
                growth = Growth(device, tuple(x for x in roots if not covered[x]), r)
                trace.append(growth)
            cand = self.cache.get(r)
            if cand is None:
                cand = self.cache[r] = self.grow(r, dev, growth)
                for v in cand.visited:
                    self.by_visited.setdefault(v, []).append(cand)
                for v in cand.touched:
                    self.by_touched.setdefault(v, []).append(cand)
            elif growth is not None:
                growth.steps = list(cand.steps)
            nodes = cand.nodes
            if growth is not None:
                growth.result = tuple(nodes)
            candidates.append(nodes)
            for v in nodes:
                covered[v] = 1
        best = candidates[0]
        for c in candidates[1:]:
            if len(c) > len(best):
                best = c
        if trace is not None:
            trace.append(Selection(device, tuple(map(tuple, candidates)), tuple(best)))
        return best

    def take(self, best: list[int], through_subgraphs: bool) -> None:
        """``best`` is selected: its nodes leave, and the growths it made stale are dropped."""
        for v in best:
            self.available[v] = 0
        self.unassigned &= ~_bits(best, self.nbytes)
        self.forget(best, self.contract(best) if through_subgraphs else None)

    def grow(self, root: int, dev: int, growth: Growth | None) -> _Candidate:
        """The candidate subgraph of ``root`` (steps 2 to 7 of the algorithm)."""
        desc, anc, adjacent, available, aff = (
            self.desc, self.anc, self.adjacent, self.available, self.aff
        )  # fmt: skip
        # state: 0 unvisited, 1 accepted, 2 rejected
        state = bytearray(self.n)
        state[root] = 1
        visited = [root]  # every node accepted or rejected, in order
        touched = [root]  # every node ever accepted (whose closure rows were read)
        merged = [root]  # accepted nodes in merge order (rollback pops the last)
        dstack = [desc[root]]  # prefix unions of desc over `merged`
        astack = [anc[root]]
        xstack = [desc[root] & anc[root]]  # dstack[k] & astack[k]
        stacked, sizes = 0, [0]  # bytes of the stacks past the root's, and each entry's
        rejected = 0
        if growth is not None:
            growth.steps.append(Step("root", root, (root,), (), True))
        frames = [[root, adjacent[root], 0]]
        while frames:
            frame = frames[-1]
            u, nbrs, i = frame
            if state[u] == 2 or i == len(nbrs):  # done, or rolled back meanwhile
                frames.pop()
                continue
            frame[2] = i + 1
            v = nbrs[i]
            if state[v]:
                continue
            merge = available[v] and aff[v] == dev
            visited.append(v)
            if merge:
                state[v] = 1
                merged.append(v)
                touched.append(v)
                d = dstack[-1] | desc[v]
                a = astack[-1] | anc[v]
                x = d & a
                if self.max_bytes:
                    size = (d.bit_length() + a.bit_length() + x.bit_length()) // 8
                    self._hold(extra=stacked + size)
                    stacked += size
                    sizes.append(size)
                dstack.append(d)
                astack.append(a)
                xstack.append(x)
            else:
                state[v] = 2
                rejected |= 1 << v
            ok = not (xstack[-1] & rejected)
            if growth is not None:
                growth.steps.append(
                    Step("merge" if merge else "reject", v, *_snapshot(state, merged), ok)
                )
            while not ok:
                merge = False
                # a single node never fails (no node is its own descendant), so the
                # root is never rolled back
                w = merged.pop()
                dstack.pop()
                astack.pop()
                xstack.pop()
                if self.max_bytes:
                    stacked -= sizes.pop()
                state[w] = 2
                rejected |= 1 << w
                ok = not (xstack[-1] & rejected)
                if growth is not None:
                    growth.steps.append(Step("rollback", w, *_snapshot(state, merged), ok))
            if merge:
                frames.append([v, adjacent[v], 0])
        merged.sort()
        bits = _bits(visited, self.nbytes)
        self._hold(bits)  # kept with the candidate (counted until the partition ends)
        return _Candidate(
            root, merged, visited, touched, bits, growth.steps if growth is not None else None
        )

    def contract(self, nodes: list[int]) -> tuple[list[int], int, list[int], int]:
        """Make the selected subgraph one node for reachability: whatever reaches a node of
        it reaches everything any node of it reaches, and vice versa. Only the rows of nodes
        still available are ever read again. Returns the rows that changed and the bits they
        gained, for ``desc`` and for ``anc``."""
        desc, anc, nbytes = self.desc, self.anc, self.nbytes
        members = _bits(nodes, nbytes)
        down, up = members, members
        reach_all, reached_by_all = -1, -1  # reach every member / reached by every one
        for v in nodes:
            down |= desc[v]
            up |= anc[v]
            reach_all &= anc[v]
            reached_by_all &= desc[v]
        # a row changes only if its node reaches (is reached by) some member but not
        # all of them: the rows are transitively closed
        changed = []
        for rows, candidates, gained in (
            (desc, up & ~reach_all, down),
            (anc, down & ~reached_by_all, up),
        ):
            rows_changed, bits_gained = [], 0
            for v in _indices(candidates & self.unassigned, nbytes):
                old = rows[v]
                new = old | gained
                if new != old:
                    rows[v] = new
                    rows_changed.append(v)
                    bits_gained |= new ^ old
            changed += [rows_changed, bits_gained]
        return changed[0], changed[1], changed[2], changed[3]

    def forget(self, selected: list[int], changes) -> None:
        """Drop the cached growths that visited a selected node or read a changed row."""
        cache, by_visited, by_touched = self.cache, self.by_visited, self.by_touched
        stale: dict[int, _Candidate] = {}
        for v in selected:
            for c in by_visited.get(v, ()):
                stale[id(c)] = c
        if changes is not None:
            desc_rows, desc_bits, anc_rows, anc_bits = changes
            for rows, bits in ((desc_rows, desc_bits), (anc_rows, anc_bits)):
                for v in rows:
                    for c in by_touched.get(v, ()):
                        if c.visited_bits & bits:
                            stale[id(c)] = c
        for c in stale.values():
            if cache.get(c.root) is c:
                del cache[c.root]
                for v in c.visited:
                    by_visited[v].remove(c)
                for v in c.touched:
                    by_touched[v].remove(c)


def _snapshot(state: bytearray, merged: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rejected = tuple(i for i, s in enumerate(state) if s == 2)
    return tuple(sorted(merged)), rejected


def subgraph_edges(
    subgraphs: Sequence[Subgraph], successors: Sequence[Sequence[int]]
) -> set[tuple[int, int]]:
    """The edges ``(i, j)`` of the graph of subgraphs (indices into ``subgraphs``).

    Raises ``ValueError`` unless the subgraphs cover every node exactly once.
    """
    owner = [-1] * len(successors)
    for k, sg in enumerate(subgraphs):
        for v in sg.nodes:
            if owner[v] != -1:
                raise ValueError(f"node {v} is in subgraphs {owner[v]} and {k}")
            owner[v] = k
    missing = [v for v, k in enumerate(owner) if k == -1]
    if missing:
        raise ValueError(f"nodes {missing[:10]} are in no subgraph")
    edges = set()
    for u, succ in enumerate(successors):
        for v in succ:
            if owner[u] != owner[v]:
                edges.add((owner[u], owner[v]))
    return edges


def order_subgraphs(
    subgraphs: Sequence[Subgraph], successors: Sequence[Sequence[int]]
) -> list[Subgraph]:
    """The subgraphs in an execution order: a topological order of their graph.

    Among the subgraphs ready to run, the one with the lowest first node comes
    first. Raises :class:`CyclicSubgraphsError` if the graph of subgraphs has a
    cycle (and ``ValueError`` unless the subgraphs cover every node exactly once).
    """
    edges = subgraph_edges(subgraphs, successors)
    m = len(subgraphs)
    indegree = [0] * m
    out: list[list[int]] = [[] for _ in range(m)]
    for i, j in edges:
        out[i].append(j)
        indegree[j] += 1
    ready = [(min(sg.nodes), k) for k, sg in enumerate(subgraphs) if indegree[k] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(subgraphs[k])
        for j in out[k]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, (min(subgraphs[j].nodes), j))
    if len(order) != m:
        stuck = sorted(k for k in range(m) if indegree[k] > 0)
        raise CyclicSubgraphsError(f"the graph of subgraphs has a cycle through {stuck}")
    return order
