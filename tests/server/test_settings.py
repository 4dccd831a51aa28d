"""Server settings (flags, PLUGSERVE_* variables, defaults) and the ``--plugins`` file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from models import with_custom_op
from serving import RunningServer

from plugserve.client import Client
from plugserve.server.process.settings import Settings

FIELDS = dataclasses.fields(Settings)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PLUGSERVE_"):
            monkeypatch.delenv(name)


def _values(field: dataclasses.Field) -> tuple[str, str]:
    """Two valid values for a field, as text: (for the flag, for the env variable)."""
    if field.name == "log_level":
        return "ERROR", "DEBUG"
    if field.name == "log_format":
        return "json", "text"
    if field.name == "model_control_mode":
        return "poll", "explicit"
    if field.name == "shared_memory":
        return "off", "system"
    if field.name == "shared_memory_prefix":
        return "/", "/mine"
    if field.name == "tool_call_parser":
        return "hermes", "none"
    if field.name == "reasoning_parser":
        return "none", "think"
    if field.name == "trace_config":
        return "rate=7", "level=TIMESTAMPS,opentelemetry,url=127.0.0.1:4318/v1/traces"
    if field.name == "served_model_name":
        return "org/a=a", "org/b=b,c=d"
    if field.name == "generate_warmup":
        return "off", '{"batch_sizes": [1, 2]}'
    if field.name == "kv_events_config":  # vLLM's --kv-events-config JSON
        return '{"enable_kv_cache_events": false}', '{"publisher": "null", "topic": "t"}'
    if field.name == "metrics_interval_ms":  # 50 ms at least
        return "100", "250"
    if field.name in (
        "gpu_metrics",
        "exit_on_error",
        "strict_readiness",
        "reuse_grpc_port",
        "allow_remote_control",
        "allow_code_from_clients",
        "enable_prefix_caching",
        "async_scheduling",
        "model_load_on_demand",
    ):  # 0 or 1
        return str(1 - field.default), str(field.default)
    if isinstance(field.default, float):
        return "2.5", "4.0"
    if isinstance(field.default, int):
        return "7", "9"
    return "from-flag", "from-env"


def _flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


@pytest.mark.parametrize("field", FIELDS, ids=[f.name for f in FIELDS])
def test_every_setting_has_a_flag_and_an_env_variable(field, monkeypatch):
    kind = type(field.default)
    flag_value, env_value = _values(field)
    if field.name == "load_model":  # valid only with the explicit mode
        monkeypatch.setenv("PLUGSERVE_MODEL_CONTROL_MODE", "explicit")
    if field.name in ("models_max", "model_idle_unload_seconds"):  # only when loading on demand
        monkeypatch.setenv("PLUGSERVE_MODEL_LOAD_ON_DEMAND", "1")
    env = f"PLUGSERVE_{field.name.upper()}"
    assert Settings.env_name(field.name) == env
    assert getattr(Settings.from_argv([]), field.name) == field.default
    assert getattr(Settings.from_argv([_flag(field), flag_value]), field.name) == kind(flag_value)
    monkeypatch.setenv(env, env_value)
    assert getattr(Settings.from_argv([]), field.name) == kind(env_value)
    assert getattr(Settings.from_argv([_flag(field), flag_value]), field.name) == kind(flag_value)


def test_help_names_each_flag_its_variable_and_default(capsys):
    with pytest.raises(SystemExit):
        Settings.from_argv(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for field in FIELDS:
        assert _flag(field) in text
        assert f"env PLUGSERVE_{field.name.upper()}, default {field.default!r}" in text


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        ("PLUGSERVE_GRPC_PORT", "abc", "PLUGSERVE_GRPC_PORT='abc' is not a valid int"),
        ("PLUGSERVE_EXIT_TIMEOUT", "soon", "PLUGSERVE_EXIT_TIMEOUT='soon' is not a valid float"),
        ("PLUGSERVE_GRPC_PORT", "70000", "grpc_port=70000 must be between 0 and 65535"),
        ("PLUGSERVE_GRPC_WORKERS", "0", "grpc_workers=0 must be >= 1"),
        ("PLUGSERVE_STREAM_INTERVAL", "0", "stream_interval=0 must be between 1 and 1024"),
        ("PLUGSERVE_STREAM_INTERVAL", "1025", "stream_interval=1025 must be between 1 and 1024"),
        ("PLUGSERVE_LOG_LEVEL", "LOUD", "log_level='LOUD' must be one of DEBUG, INFO"),
        ("PLUGSERVE_SERVED_MODEL_NAME", "org/a", "'org/a' is not NAME=MODEL"),
        ("PLUGSERVE_SERVED_MODEL_NAME", "org/a=", "'org/a=' is not NAME=MODEL"),
        ("PLUGSERVE_KV_EVENTS_CONFIG", "{", "kv_events_config='{': not JSON"),
        ("PLUGSERVE_KV_EVENTS_CONFIG", '{"buffer": 1}', "unknown key 'buffer'"),
        ("PLUGSERVE_KV_EVENTS_CONFIG", '{"hwm": "1"}', "hwm has the wrong type"),
        (
            "PLUGSERVE_KV_EVENTS_CONFIG",
            '{"max_queue_size": 0}',
            "max_queue_size must be at least 1",
        ),
        ("PLUGSERVE_KV_EVENTS_CONFIG", '{"publisher": "kafka"}', "publisher must be zmq or null"),
    ],
)
def test_a_bad_env_value_is_a_clear_error(monkeypatch, env, value, message):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as info:
        Settings.from_argv([])
    assert message in str(info.value) and env in str(info.value)


def _serve(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``plugserve serve`` that is expected to refuse to start."""
    command = [sys.executable, "-m", "plugserve.server.process.cli", "serve", "--host", "127.0.0.1"]
    command += ["--grpc-port", "0", "--metrics-port", "-1", *args]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
        check=False,
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert "listening" not in result.stderr
    return result


def test_the_server_refuses_a_bad_env_value():
    result = _serve(PLUGSERVE_QUEUE_SIZE="eighty")
    assert result.returncode == 1
    assert result.stderr.strip() == "plugserve: PLUGSERVE_QUEUE_SIZE='eighty' is not a valid int"


def test_active_grpc_workers_default_to_the_usable_cores_at_least_two():
    cores = len(os.sched_getaffinity(0))
    assert Settings().active_grpc_workers() == min(64, max(2, cores))
    assert Settings(grpc_active_workers=3).active_grpc_workers() == 3
    assert Settings(grpc_workers=2, grpc_active_workers=8).active_grpc_workers() == 2


def _plugins(tmp_path, content) -> str:
    path = tmp_path / "plugins.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_plugins_file_config_shows_in_get_config(tmp_path):
    plugins = {"plugins": {"NUMPY": {"config": {"NUM_STREAMS": "2", "PERF_COUNT": "YES"}}}}
    repo = tmp_path / "models"
    repo.mkdir()
    with (
        RunningServer(
            "--plugins", _plugins(tmp_path, plugins), "--model-repository", str(repo)
        ) as server,
        Client(server.target, timeout=60) as client,
    ):
        config = client.get_config("NUMPY")
        assert config["NUM_STREAMS"] == "2" and config["PERF_COUNT"] == "YES"
        assert client.get_config("NUMPY", "NUM_STREAMS") == {"NUM_STREAMS": "2"}
        assert [d.name for d in client.devices()] == ["NUMPY"]


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        (
            {"plugins": {"NUMPY": {"config": {"NOPE": "1"}}}},
            "device NUMPY: unsupported config key 'NOPE'",
        ),
        ({"plugins": {"NUMPY": {"config": {"NUM_STREAMS": "many"}}}}, "NUM_STREAMS"),
        ({"plugins": {"NUMPY": {"confg": {}}}}, "plugin 'NUMPY': unknown key(s) ['confg']"),
        ({"plugins": {"NUMPI": {}}}, "unknown device(s) NUMPI; known devices: "),
        ({"plugins": {"NUMPY": {}}, "extra": 1}, 'expected {"plugins": {NAME: {...}}}'),
        ({"plugins": {"NUMPY": {"extensions": ["no_colon"]}}}, '"module:attribute"'),
        (
            {"plugins": {"NUMPY": {"extensions": ["no_such_module_here:ext"]}}},
            "extension 'no_such_module_here:ext' cannot be loaded: ModuleNotFoundError",
        ),
        (
            {"plugins": {"NUMPY": {"extensions": ["json:no_such_attribute"]}}},
            "extension 'json:no_such_attribute' cannot be loaded: AttributeError",
        ),
        (
            {"plugins": {"NUMPY": {"extensions": ["json:dumps"]}}},
            "extension 'json:dumps': add_extension takes a plugserve.plugins.numpy.Extension",
        ),
        ("{not json", "Expecting property name"),
    ],
    ids=["key", "value", "entry", "device", "top", "ref", "module", "attr", "type", "json"],
)
def test_a_bad_plugins_file_stops_startup_with_a_clear_message(tmp_path, plugins, message):
    path = _plugins(tmp_path, plugins)
    result = _serve("--plugins", path, "--model-repository", str(tmp_path))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"plugserve: --plugins {path}: ") and message in last, result.stderr


EXTENSION = """
import numpy as np

from plugserve.plugins.numpy import Extension


def _build(ctx):
    factor = np.float32(ctx.attr("factor"))
    return lambda x: x * factor


scale = Extension("com.example", "Scale", _build, builder=True, infer=lambda x: (x[0], x[1]))
"""


def test_plugins_file_extensions_make_a_custom_op_loadable(tmp_path):
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "my_scale_ext.py").write_text(textwrap.dedent(EXTENSION))
    repo = tmp_path / "models"
    repo.mkdir()
    plugins = {"plugins": {"NUMPY": {"extensions": ["my_scale_ext:scale"]}}}
    path = os.pathsep.join(p for p in [str(tmp_path / "ext"), os.environ.get("PYTHONPATH")] if p)
    model = with_custom_op().SerializeToString()
    server = RunningServer(
        "--plugins",
        _plugins(tmp_path, plugins),
        "--model-repository",
        str(repo),
        env={"PYTHONPATH": path},
    )
    with server, Client(server.target, timeout=60) as client:
        assert "device NUMPY: extension my_scale_ext:scale added" in server.log
        query = client.query(model, "NUMPY")
        assert set(query.supported) == {"relu", "scale", "add"} and not query.unsupported
        client.load("custom", model)
        x = np.array([[-1, 0, 1], [2, -3, 4]], np.float32)
        out = client.infer("custom", {"x": x})["y"]
        np.testing.assert_allclose(out, np.maximum(x, 0) * np.float32(2.5) + 1)
