"""A sequence that fails while its token is chosen leaves no frame in a reference cycle.

The sampler keeps a failed row's exception for the engine (``failures``), and the
exception's traceback keeps the sampler's frame, whose locals hold that dict and the step's
copy of the logits (rows x vocab): a cycle that held them until Python's cycle collector
next ran, which counts objects, not bytes. The engine now forgets the frames once it has
logged the failure.

The engine runs in a fresh Python process (``Engine.generate`` on a model folder made in
code), with the collector off and its log written to a stream as a server's is: pytest's own
log capture keeps every record, and with it the traceback, even on a logger that does not
propagate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

_SCRIPT = """
import gc, io, json, logging, sys, tempfile, types
from pathlib import Path
from conftest import FailingGrammar  # tests/generate's
from tiny_decoder import write
from plugserve.plugins.api import InferenceError
from plugserve.server import Core
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams
from plugserve.server.plane.errors import forget_frames

stream = io.StringIO()
logging.basicConfig(stream=stream, level=logging.WARNING)
with tempfile.TemporaryDirectory() as folder:
    net = Core().load_network(str(write(Path(folder) / "m", context=256)), "NUMPY", {})
    try:
        gc.collect()
        gc.disable()
        failed = 0
        for i in range(3):
            params = SamplingParams(max_tokens=8, constraint=FailingGrammar(2))
            try:
                list(net.engine.generate(GenerationRequest(f"broken-{i}", [5, 6, 7], params)))
            except InferenceError as exc:
                failed += "while sampling" in str(exc)
                forget_frames(exc)  # answered: what the server's faces do with it
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        frames = [
            f"{o.f_code.co_name} ({o.f_code.co_filename}:{o.f_lineno})"
            for o in gc.garbage
            if isinstance(o, types.FrameType) and "tests" not in Path(o.f_code.co_filename).parts
        ]
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    finally:
        net.close()
print(json.dumps({"failed": failed, "frames": frames, "log": stream.getvalue()}))
"""


def test_a_row_failing_in_the_sampler_leaves_no_frame_in_a_cycle():
    paths = [str(TESTS / "generate"), str(TESTS / "support")]
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path[:0] = {paths!r}\n{_SCRIPT}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["failed"] == 3, found
    assert found["frames"] == [], found["frames"]
    # each failure was logged whole before its frames were forgotten
    assert found["log"].count("the grammar's matcher broke") >= 3
    assert "Traceback" in found["log"]
