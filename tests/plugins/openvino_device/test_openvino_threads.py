"""openvino from many threads at once, as the server's parallel model loads use it.

openvino's bindings set up their numpy bridge on first use inside a C++ static whose
initializer waits for the GIL; two threads converting their first arrays at once deadlocked (CI:
a server loading two OpenVINO models in parallel never became ready). Importing the plugin sets
the bridge up first. Without that, 15 of 40 processes below hung here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("openvino", reason="pip install -e '.[openvino]'")

#: a fresh process: the plugin imported as the server imports it, then eight threads released
#: together, each converting its first array (what openvino's infer does with its inputs)
_RACE = textwrap.dedent(
    """
    import threading
    import numpy as np
    import plugserve.plugins.openvino.plugin
    import openvino as ov

    start = threading.Barrier(8)

    def first_arrays():
        start.wait()
        ov.Type.f32.to_dtype()
        ov.Tensor(np.zeros(2, np.float32))

    threads = [threading.Thread(target=first_arrays) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done")
    """
)

PROCESSES = 12  # each hung with a chance of ~3/8 before: all 12 pass by luck 1 time in 300


def test_threads_converting_their_first_arrays_at_once_do_not_deadlock():
    runs = [
        subprocess.Popen([sys.executable, "-c", _RACE], stdout=subprocess.PIPE, text=True)
        for _ in range(PROCESSES)
    ]
    hung = 0
    deadline = time.monotonic() + 60  # ~4 s for all of them here; a deadlock never ends
    for run in runs:
        try:
            out, _ = run.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.kill()
            run.communicate()
            hung += 1
            continue
        assert run.returncode == 0 and out.strip() == "done"
    assert hung == 0, f"{hung} of {PROCESSES} processes deadlocked in openvino's numpy bridge"
