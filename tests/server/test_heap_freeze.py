"""The serving process freezes its start's heap out of the cyclic collector; an embedded server
does not (``server/control/allocator.py``'s ``freeze_heap``).

A full collection scanned everything the start made (~220k objects with tests' tiny-llama):
90-100 ms of GIL on whichever thread allocated then, about once per 100k streamed tokens, the
HTTP thread's or the engine's (issue 60, BENCHMARKS.md). ``plugserve serve``'s ``main`` sets
``Server.freeze_heap``, which freezes that heap at ready; a server embedded in an application
leaves the application's heap as it is. Each case runs in a fresh process (a freeze would
reach pytest's own heap). That a frozen server's reloads still give their networks' memory
back (``control/retire.py`` lets the collector in for them) is test_reload_memory.py's.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from serving import examples_in_a_fresh_process

_SERVE = """
import gc, sys
from plugserve.server.process.app import Server
from plugserve.server.process.settings import Settings
server = Server(Settings(model_repository=sys.argv[2], host="127.0.0.1", grpc_port=0,
                         http_port=-1, metrics_port=-1, health_port=-1))
server.freeze_heap = sys.argv[1] == "served"
server.start()
try:
    print(gc.get_freeze_count())
finally:
    server.stop(0)
"""


@pytest.mark.parametrize("how", ["served", "embedded"])
def test_the_serving_process_freezes_its_start_and_an_embedded_server_does_not(how, tmp_path):
    frozen = int(examples_in_a_fresh_process(_SERVE, how, tmp_path).split("\n")[0])
    if how == "served":
        assert frozen > 10_000  # modules, the examples' networks
    else:
        assert frozen == 0


_HELD = """
import gc, weakref
from plugserve.server.control import allocator, retire

class Network:  # a retired network's graph: a cycle, as a compiled network's objects make
    def __init__(self):
        self.me = self

allocator.freeze_heap()
held = Network()  # a request running past --model-unload-timeout still holds it
retire._give_back(weakref.ref(held), within=0.05)
print(gc.get_freeze_count())
del held  # the request ended: garbage the thawed collector sees
gone = Network()
ref = weakref.ref(gone)
del gone
retire._give_back(ref, within=0.05)
print(gc.get_freeze_count())
"""


def test_a_retired_network_still_held_is_not_frozen_again():
    """A reload thaws the frozen heap so that the old network can go; one still held when its
    retirement ends must not be frozen with the heap (its cycles would never be freed): the
    heap stays thawed until every retired network is gone, then is frozen again."""
    done = subprocess.run(
        [sys.executable, "-c", _HELD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    while_held, after = (int(line) for line in done.stdout.split())
    assert while_held == 0, "a held network was frozen with the heap"
    assert after > 1_000, "the heap is frozen again once every retired network is gone"


_AFTER = """
import gc, weakref
from plugserve.server.control import allocator, retire

class Network:  # a retired network's graph: a cycle
    def __init__(self):
        self.me = self

old = Network()  # loaded before the start's freeze: in the frozen heap
kept = Network()  # made before the freeze, garbage after it (frozen: the collector skips it)
allocator.freeze_heap()
freezes = allocator.freezes()  # one more each time the heap is frozen again after a thaw
new = Network()  # loaded after it: none of it frozen
ref = weakref.ref(new)
del new
retire._give_back(ref, freezes, within=2.0)
print(ref() is None, allocator.freezes() == freezes)  # freed, the heap never thawed
ref = weakref.ref(old)
del old
retire._give_back(ref, 0, within=2.0)  # made before the freeze: the heap thawed for it
print(ref() is None, allocator.freezes() == freezes + 1)
tied = Network()  # made after the last freeze, held in a cycle through a frozen object
kept.tied, tied.kept = tied, kept
ref = weakref.ref(tied)
made = allocator.freezes()
del tied, kept
retire._give_back(ref, made, within=0.4)  # not freed without the heap: thawed half way
print(ref() is None, allocator.freezes() == made + 1)
"""


def test_a_network_made_after_the_freeze_is_freed_without_thawing_the_heap():
    """Thawing made each unload's collections scan the whole start heap (~220k objects,
    90-100 ms of GIL each): a gRPC health probe beside three loads and unloads waited
    100-250 ms. A network begun after the last freeze holds nothing frozen and is collected
    with the heap frozen; one made before is thawed for as before; one tied to a frozen
    object by a cycle is thawed for once the first half of the wait has not freed it."""
    done = subprocess.run(
        [sys.executable, "-c", _AFTER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"] * 3, done.stdout
