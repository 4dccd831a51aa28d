"""HETERO subgraph selection: the design document's example, step by step, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugserve.plugins.hetero.partition import (
    CyclicSubgraphsError,
    Growth,
    Selection,
    Subgraph,
    order_subgraphs,
    partition,
    predecessors_of,
    subgraph_edges,
)

# The example of the design document, nodes labelled 1..7 (index = label - 1):
#     1 - 2, 2 - 3, 2 - 4, 3 - 5, 4 - 5, 5 - 6, 6 - 7
SEED_EDGES = [(1, 2), (2, 3), (2, 4), (3, 5), (4, 5), (5, 6), (6, 7)]


def _seed_graph():
    succ = [[] for _ in range(7)]
    for a, b in SEED_EDGES:
        succ[a - 1].append(b - 1)
    aff = ["FIRST"] * 7
    aff[4 - 1] = "SECOND"  # [4] is not supported by the first device
    return succ, aff


def _labels(nodes):
    return [v + 1 for v in nodes]


def _steps(growth: Growth):
    return [
        (s.action, s.node + 1, _labels(s.subgraph), _labels(s.rejected), s.ok) for s in growth.steps
    ]


def test_seed_example_result():
    succ, aff = _seed_graph()
    result = partition(succ, aff, ["FIRST", "SECOND"])
    assert [(s.device, _labels(s.nodes)) for s in result] == [
        ("FIRST", [3, 5, 6, 7]),
        ("FIRST", [1, 2]),
        ("SECOND", [4]),
    ]
    # the same without the refinement (the text verbatim)
    assert partition(succ, aff, ["FIRST", "SECOND"], through_subgraphs=False) == result
    order = order_subgraphs(result, succ)
    assert [_labels(s.nodes) for s in order] == [[1, 2], [4], [3, 5, 6, 7]]


def test_seed_example_walkthrough():
    succ, aff = _seed_graph()
    trace: list = []
    partition(succ, aff, ["FIRST", "SECOND"], trace=trace)
    first, second, selection = trace[:3]

    # Possible roots: [1,2,3,5,6,7]
    assert isinstance(first, Growth)
    assert (first.device, _labels(first.possible_roots), first.root + 1) == (
        "FIRST",
        [1, 2, 3, 5, 6, 7],
        1,
    )
    assert _steps(first) == [
        ("root", 1, [1], [], True),  # 1. Select root [1]
        ("merge", 2, [1, 2], [], True),  # 2. Merge [2]
        ("merge", 3, [1, 2, 3], [], True),  # 3. Merge [3]
        ("merge", 5, [1, 2, 3, 5], [], True),  # 4. Merge [5]
        ("merge", 6, [1, 2, 3, 5, 6], [], True),  # 5. Merge [6]
        ("merge", 7, [1, 2, 3, 5, 6, 7], [], True),  # 6. Merge [7]
        ("reject", 4, [1, 2, 3, 5, 6, 7], [4], False),  # 7. Failed to merge [4]
        ("rollback", 7, [1, 2, 3, 5, 6], [4, 7], False),  # 8. Rollback [7]
        ("rollback", 6, [1, 2, 3, 5], [4, 6, 7], False),  # 9. Rollback [6]
        ("rollback", 5, [1, 2, 3], [4, 5, 6, 7], True),  # 10. Rollback [5]
    ]  # 11. no more nodes to merge: end
    assert _labels(first.result) == [1, 2, 3]

    # Possible roots: [5,6,7]
    assert isinstance(second, Growth)
    assert (_labels(second.possible_roots), second.root + 1) == ([5, 6, 7], 5)
    assert _steps(second) == [
        ("root", 5, [5], [], True),  # 1. Select root [5]
        ("merge", 6, [5, 6], [], True),  # 2. Merge [6]
        ("merge", 7, [5, 6, 7], [], True),  # 3. Merge [7]
        ("merge", 3, [3, 5, 6, 7], [], True),  # 4. Merge [3]
        ("merge", 2, [2, 3, 5, 6, 7], [], True),  # 5. Merge [2]
        ("reject", 4, [2, 3, 5, 6, 7], [4], False),  # 6. Failed to merge [4]
        ("rollback", 2, [3, 5, 6, 7], [2, 4], True),  # 7. Rollback [2]
    ]  # 8. no more nodes to merge: end
    assert _labels(second.result) == [3, 5, 6, 7]

    # Possible roots: [] -> END; the larger [3,5,6,7] is selected, always
    assert isinstance(selection, Selection)
    assert [_labels(c) for c in selection.candidates] == [[1, 2, 3], [3, 5, 6, 7]]
    assert _labels(selection.selected) == [3, 5, 6, 7]

    # Repeat with the remaining nodes [1,2], then the second device: [4]
    rest = trace[3:]
    assert [type(t) for t in rest] == [Growth, Selection, Growth, Selection]
    assert _labels(rest[0].possible_roots) == [1, 2] and _labels(rest[0].result) == [1, 2]
    assert rest[2].device == "SECOND" and _labels(rest[2].result) == [4]


def test_chain_with_alternating_devices_gives_one_subgraph_per_node():
    n = 9
    succ = [[i + 1] for i in range(n - 1)] + [[]]
    aff = ["A" if i % 2 == 0 else "B" for i in range(n)]
    result = partition(succ, aff, ["A", "B"])
    assert sorted(s.nodes for s in result) == [(i,) for i in range(n)]
    assert all(s.device == aff[s.nodes[0]] for s in result)
    assert [s.nodes for s in order_subgraphs(result, succ)] == [(i,) for i in range(n)]


def test_single_device_gives_one_subgraph():
    succ = [[1, 2], [3], [3], [4, 5], [6], [6], []]
    result = partition(succ, ["CPU"] * 7, ["GPU", "CPU"])
    assert result == [Subgraph("CPU", tuple(range(7)))]
    assert partition([], [], ["CPU"]) == []


def test_cycle_through_a_selected_subgraph():
    # p->x1, p->x2, x1->y1, y2->x2, y1->q, y2->q; p, x* on A and y*, q on B.
    # Each subgraph is convex, but taken verbatim {y1, y2, q} depends on {p, x1, x2}
    # (x1->y1) and the other way round (y2->x2).
    p, y2, x1, x2, y1, q = range(6)
    succ = [[x1, x2], [x2, q], [y1], [], [q], []]
    aff = ["A", "B", "A", "A", "B", "B"]
    verbatim = partition(succ, aff, ["A", "B"], through_subgraphs=False)
    assert [s.nodes for s in verbatim] == [(p, x1, x2), (y2, y1, q)]
    with pytest.raises(CyclicSubgraphsError):
        order_subgraphs(verbatim, succ)
    refined = partition(succ, aff, ["A", "B"])
    assert [s.nodes for s in refined] == [(p, x1, x2), (y1, q), (y2,)]
    assert [s.nodes for s in order_subgraphs(refined, succ)] == [(y2,), (p, x1, x2), (y1, q)]


def test_invalid_input():
    with pytest.raises(ValueError, match="topological"):
        partition([[], [0]], ["A", "A"], ["A"])
    with pytest.raises(ValueError, match="not among the devices"):
        partition([[1], []], ["A", "B"], ["A"])
    with pytest.raises(ValueError, match="do not match"):
        partition([[1], []], ["A", "A"], ["A"], predecessors=[[], []])
    with pytest.raises(ValueError, match="in no subgraph"):
        order_subgraphs([Subgraph("A", (0,))], [[1], []])


# -- a literal reference: recursion, sets, and the path nodes of every pair --------


def _reference(succ, aff, devices, through_subgraphs=True):
    """The algorithm as written, naively: the pairs' path nodes from a fresh closure."""
    n = len(succ)
    preds = predecessors_of(succ)
    owner = {}  # node -> index of its selected subgraph
    result, steps = [], []

    def reach_sets():
        # reachability in the graph with each selected subgraph contracted (if refined)
        def key(v):
            return ("S", owner[v]) if through_subgraphs and v in owner else ("N", v)

        out = {}
        for u in range(n):
            for v in succ[u]:
                if key(u) != key(v):
                    out.setdefault(key(u), set()).add(key(v))
        memo = {}

        def down(k):
            if k not in memo:
                memo[k] = set()
                for j in out.get(k, ()):
                    memo[k] |= {j} | down(j)
            return memo[k]

        return key, down

    for dev in devices:
        while True:
            key, down = reach_sets()

            def path(src, dst, key=key, down=down):
                return {
                    x for x in range(n) if key(x) in down(key(src)) and key(dst) in down(key(x))
                }

            def ok(nodes, rejected, path=path):
                return not any(path(s, d) & rejected for s in nodes for d in nodes if s != d)

            roots = [v for v in range(n) if aff[v] == dev and v not in owner]
            if not roots:
                break
            cannot, candidates = set(), []
            for root in roots:
                if root in cannot:
                    continue
                nodes, rejected = [root], set()
                log = [("root", root, (root,), (), True)]

                def visit(u, nodes=nodes, rejected=rejected, log=log, dev=dev):
                    for v in list(succ[u]) + preds[u]:
                        if u in rejected:
                            return
                        if v in nodes or v in rejected:
                            continue
                        merge = aff[v] == dev and v not in owner
                        (nodes.append if merge else rejected.add)(v)
                        good = ok(nodes, rejected)
                        action = "merge" if merge else "reject"
                        state = (tuple(sorted(nodes)), tuple(sorted(rejected)))
                        log.append((action, v, *state, good))
                        while not good:
                            merge = False
                            w = nodes.pop()
                            rejected.add(w)
                            good = ok(nodes, rejected)
                            log.append(
                                ("rollback", w, tuple(sorted(nodes)), tuple(sorted(rejected)), good)
                            )
                        if merge:
                            visit(v)

                visit(root)
                steps.append(log)
                candidates.append(tuple(sorted(nodes)))
                cannot |= set(nodes)
            best = max(candidates, key=len)  # the first of the largest
            for v in best:
                owner[v] = len(result)
            result.append(Subgraph(dev, best))
    return result, steps


# -- random DAGs -----------------------------------------------------------------


@st.composite
def dags(draw, max_nodes=60):
    n = draw(st.integers(1, max_nodes))
    local = draw(st.booleans())  # mostly short edges, like a network, or anywhere
    succ = [[] for _ in range(n)]
    for v in range(1, n):
        lo = max(0, v - 4) if local else 0
        for u in sorted(draw(st.sets(st.integers(lo, v - 1), max_size=3))):
            succ[u].append(v)
    devices = ["D0", "D1", "D2"][: draw(st.integers(2, 3))]
    if draw(st.booleans()):
        aff = draw(st.lists(st.sampled_from(devices), min_size=n, max_size=n))
    else:  # runs on one device with a few others
        aff = [
            devices[0] if draw(st.integers(0, 9)) else draw(st.sampled_from(devices))
            for _ in range(n)
        ]
    return succ, aff, devices


def _weakly_connected(nodes, succ):
    nodes = set(nodes)
    adj = {v: set() for v in nodes}
    for u in nodes:
        for v in succ[u]:
            if v in nodes:
                adj[u].add(v)
                adj[v].add(u)
    seen, todo = set(), [min(nodes)]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(adj[v] - seen)
    return seen == nodes


def _descendants(succ):
    desc = [set() for _ in succ]
    for u in range(len(succ) - 1, -1, -1):
        for v in succ[u]:
            desc[u] |= {v} | desc[v]
    return desc


@settings(max_examples=150, deadline=None)
@given(dags())
def test_partition_properties(graph):
    succ, aff, devices = graph
    n = len(succ)
    result = partition(succ, aff, devices)

    assigned = sorted(v for s in result for v in s.nodes)
    assert assigned == list(range(n))  # every node exactly once
    for s in result:
        assert s.nodes and list(s.nodes) == sorted(s.nodes)
        assert all(aff[v] == s.device for v in s.nodes)  # single-device
        assert _weakly_connected(s.nodes, succ)
    # devices in priority order
    ranks = [devices.index(s.device) for s in result]
    assert ranks == sorted(ranks)

    # the graph of subgraphs is acyclic, and the order respects every edge
    order = order_subgraphs(result, succ)
    position = {v: k for k, s in enumerate(order) for v in s.nodes}
    assert all(position[u] <= position[v] for u in range(n) for v in succ[u])
    assert len(order) == len(result) and set(order) == set(result)

    # each subgraph is convex: no path leaves it and comes back
    desc = _descendants(succ)
    for s in result:
        nodes = set(s.nodes)
        outside = set().union(*(desc[v] for v in nodes)) - nodes
        assert not any(desc[x] & nodes for x in outside)


@settings(max_examples=100, deadline=None)
@given(dags(max_nodes=25), st.booleans())
def test_partition_matches_the_literal_reference(graph, through_subgraphs):
    succ, aff, devices = graph
    trace: list = []
    result = partition(succ, aff, devices, through_subgraphs=through_subgraphs, trace=trace)
    expected, expected_steps = _reference(succ, aff, devices, through_subgraphs)
    assert result == expected
    growths = [t for t in trace if isinstance(t, Growth)]
    got = [[(s.action, s.node, s.subgraph, s.rejected, s.ok) for s in g.steps] for g in growths]
    assert got == expected_steps
    edges = subgraph_edges(result, succ)
    assert all(i != j for i, j in edges)


@settings(max_examples=100, deadline=None)
@given(dags(), st.integers(1, 4))
def test_one_device_takes_its_components_as_the_rounds_would(graph, cuts):
    """A graph on one device is split into its connected components in linear time; the same
    subgraphs, in the same order, as the rounds select (``trace`` makes them run)."""
    succ, _aff, devices = graph
    n = len(succ)
    for k in range(cuts):  # some edges dropped: several components
        for u in range(k, n, cuts + 1):
            succ[u] = []
    aff = [devices[0]] * n
    assert partition(succ, aff, devices) == partition(succ, aff, devices, trace=[])


def test_the_bitsets_are_bounded():
    """A chain of 20,000 nodes on two devices: its closure holds 2 x 20,000^2 / 2 bits (50 MB);
    under a bound of 8 MB it is refused before it is built whole. One device: no closure at
    all, whatever the size (a red team's 120,000-node chain took 6.8 GB through HETERO)."""
    from plugserve.plugins.hetero.partition import TooLargeError

    n = 20_000
    succ = [[v + 1] for v in range(n - 1)] + [[]]
    aff = ["A"] * (n // 2) + ["B"] * (n - n // 2)
    with pytest.raises(TooLargeError, match="8,000,000 bytes"):
        partition(succ, aff, ["A", "B"], max_bytes=8_000_000)
    split = partition(succ, aff, ["A", "B"], max_bytes=256 << 20)
    assert [(s.device, len(s.nodes)) for s in split] == [("A", n // 2), ("B", n - n // 2)]
    n = 200_000
    chain = [[v + 1] for v in range(n - 1)] + [[]]
    (whole,) = partition(chain, ["A"] * n, ["A", "B"], max_bytes=1 << 20)
    assert len(whole.nodes) == n
