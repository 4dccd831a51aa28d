"""The client package stands on the generated protocol code alone: importing it, every verb
module included, loads neither the server nor the plugins (a user installs it to talk to a
server, not to run one), and ``bench --inprocess``, which does load models, says where it runs
when called through the client package directly."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_client_loads_no_server_or_plugin_module():
    code = (
        "import sys\n"
        "import plugserve.client, plugserve.client.cli, plugserve.client.bench\n"
        "import plugserve.client.bench.verb, plugserve.client.inputs\n"
        "loaded = sorted(m for m in sys.modules\n"
        "                if m.startswith(('plugserve.server', 'plugserve.plugins')))\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bench_inprocess_through_the_client_package_alone_says_where_it_runs(tmp_path):
    code = (
        "from plugserve.client.cli import run\n"
        f"run('bench', ['--inprocess', {str(tmp_path / 'm.onnx')!r}, '--iterations', '1'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "plugserve bench --inprocess" in out.stderr
