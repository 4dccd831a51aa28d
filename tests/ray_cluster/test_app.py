"""plugserve.ray's application builder and config, without a cluster: in the Ray venv
(tests/support/ray_cluster.py), as ``serve run`` calls the builder."""

from __future__ import annotations

import json
import subprocess

import pytest
import ray_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def python() -> str:
    try:
        return str(ray_cluster.ray_venv() / "bin" / "python")
    except ray_cluster.Unavailable as exc:
        pytest.skip(str(exc))


def _run(python: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=300, cwd="/"
    )


def test_the_builder_takes_serve_and_server_arguments_and_refuses_others(python):
    done = _run(
        python,
        "import json\n"
        "from plugserve.ray import app\n"
        "built = app({'model_repository': '/models', 'min_replicas': '1', 'max_replicas': '3',\n"
        "             'target_ongoing_requests': '4', 'default_device': 'ORT'})\n"
        "d = built._bound_deployment\n"
        "print(json.dumps({'scaling': d._deployment_config.autoscaling_config.min_replicas,\n"
        "  'max': d._deployment_config.autoscaling_config.max_replicas,\n"
        "  'settings': d.init_args[0]}))\n"
        "for bad in ({'no_such_knob': 1}, {'num_replicas': 'two'}, {'log_level': 'LOUD'}):\n"
        "    try:\n"
        "        app(bad)\n"
        "    except (ValueError, SystemExit) as exc:\n"
        "        print('REFUSED', str(exc).splitlines()[0][:200])\n",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    built = json.loads(lines[0])
    assert (built["scaling"], built["max"]) == (1, 3)
    settings = built["settings"]
    assert settings["model_repository"] == "/models" and settings["default_device"] == "ORT"
    assert settings["metrics_port"] == -1 and settings["model_control_mode"] == "none"
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 3, done.stdout
    assert "unknown argument 'no_such_knob'; known: " in refused[0]
    assert "num_replicas='two'" in refused[1]
    assert "invalid settings" in refused[2] and "LOUD" in refused[2]


def test_python_m_plugserve_ray_prints_a_config_with_the_ports_set(python):
    done = _run(
        python,
        "import runpy, sys; sys.argv = ['x', 'model_repository=/m', 'num_replicas=2']; "
        "runpy.run_module('plugserve.ray', run_name='__main__')",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads(done.stdout)
    assert config["http_options"]["port"] == 8000 and config["grpc_options"]["port"] == 9000
    assert config["grpc_options"]["grpc_servicer_functions"] == [ray_cluster.GRPC_SERVICER]
    (application,) = config["applications"]
    assert application["import_path"] == "plugserve.ray:app"
    assert application["args"] == {"model_repository": "/m", "num_replicas": "2"}


def test_prefix_routing_puts_the_ingress_before_replicas_with_our_router(python):
    done = _run(
        python,
        "import json\n"
        "from plugserve.ray import app\n"
        "from plugserve.ray.routing import PrefixAffinityRouter\n"
        "plain = app({'model_repository': '/m'})._bound_deployment\n"
        "built = app({'model_repository': '/m', 'num_replicas': '2', 'prefix_routing': 'true',\n"
        "             'prefix_routing_imbalance': '2'})._bound_deployment\n"
        "replicas = built.init_args[0]._bound_deployment\n"
        "config = replicas._deployment_config.request_router_config\n"
        "print(json.dumps({'plain': plain.name, 'ingress': built.name, 'replicas': replicas.name,\n"
        "  'num': replicas._deployment_config.num_replicas,\n"
        "  'ours': config.get_request_router_class() is PrefixAffinityRouter,\n"
        "  'kwargs': config.request_router_kwargs}))\n"
        "try:\n"
        "    app({'model_repository': '/m', 'prefix_routing': 'maybe'})\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    built = json.loads(lines[0])
    assert built["plain"] == "plugserve"  # off by default: one deployment, Serve's router
    assert (built["ingress"], built["replicas"], built["num"]) == (
        "ingress-plugserve",
        "plugserve",
        2,
    )
    assert built["ours"] and built["kwargs"] == {"imbalance": 2, "max_blocks": 100_000}
    assert lines[1].startswith("REFUSED") and "prefix_routing='maybe'" in lines[1], lines


def test_the_prefix_key_is_a_chain_stable_across_turns_and_split_by_tenant(python):
    done = _run(
        python,
        "import json\n"
        "from plugserve.ray.routing import BLOCK_CHARS, prefix_blocks\n"
        "talk = [{'role': 'system', 'content': 'tools and rules ' * 100},\n"
        "        {'role': 'user', 'content': 'first question'}]\n"
        "one = prefix_blocks(json.dumps({'model': 'm', 'messages': talk}).encode())\n"
        "talk += [{'role': 'assistant', 'content': 'an answer ' * 40},\n"
        "         {'role': 'user', 'content': 'second'}]\n"
        "body = json.dumps({'messages': talk, 'max_tokens': 9, 'model': 'm'}).encode()\n"
        "two = prefix_blocks(body)\n"
        "other = prefix_blocks(body, 'tenant-b')\n"
        "print(json.dumps({'one': len(one), 'two': len(two), 'common': one == two[:len(one)],\n"
        "  'tenant': len(set(other) & set(two)), 'bad': [prefix_blocks(b'[1]'),\n"
        "  prefix_blocks(b'{nope'), prefix_blocks(b'{\"prompt\": \"short\"}')]}))\n",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    # ~1,650 bytes of text: 6 full blocks; the next turn adds ~450 bytes: 8
    assert (found["one"], found["two"]) == (6, 8) and found["common"], found
    assert found["tenant"] == 0  # another tenant's chain shares no block
    assert found["bad"] == [[], [], []]


def test_a_multiplexed_model_is_loaded_for_a_caller_whose_token_may_infer_only(python, tmp_path):
    """With tokens the replica loaded a request's multiplexed model before the request's own
    token check: a caller without a token (or with a wrong one) made it load a model and
    unload another tenant's. It loads for an infer or admin token only (the headers as
    Serve's HTTP request and gRPC context give them)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("ray-infer-token-0001 infer\nray-admin-token-0001 admin\n")
    tokens.chmod(0o600)
    done = _run(
        python,
        "import json\n"
        "from plugserve.ray.replica import ReplicaBase, _metadata\n"
        "from plugserve.server.protocols.auth import AuthInterceptor, load_tokens\n"
        "class Replica: pass\n"
        "r = Replica()\n"
        f"r.auth = AuthInterceptor(load_tokens({str(tokens)!r}), True, False)\n"
        "may = lambda meta: ReplicaBase._may_load(r, meta)\n"
        "class Context:\n"
        "    def invocation_metadata(self):\n"
        "        return (('authorization', 'Bearer ray-infer-token-0001'),)\n"
        "seen = [may([]), may([('authorization', 'Bearer wrong-token-000001')]),\n"
        "        may([('authorization', 'Bearer ray-infer-token-0001')]),\n"
        "        may([('x-api-key', 'ray-admin-token-0001')]), may(_metadata(Context()))]\n"
        "r.auth = None\n"
        "print(json.dumps(seen + [may([])]))\n",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [False, False, True, True, True, True]
