"""Where torch is not installed (plugserve does not depend on it), TORCH and GPU are listed
unavailable saying why and how to install it, and every other device serves: runs with or
without torch (the child process hides it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_without_torch_both_devices_say_why_and_the_others_serve():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # import torch raises ImportError, as where it is absent
        from plugserve.server import Core
        core = Core()
        devices = {d.name: d for d in core.devices()}
        for name in ("TORCH", "GPU"):
            assert not devices[name].available
            assert "torch cannot be imported" in devices[name].reason, devices[name].reason
            assert "pip install torch" in devices[name].reason
        assert devices["NUMPY"].available
        print("OK")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
