"""The Serve application builder: ``serve run plugserve.ray:app model_repository=DIR ...``.

``app(args)`` takes ``serve run``'s ``key=value`` arguments (or a ``serve deploy`` config's
``args:``) and returns the application: one deployment whose replicas each hold a plugserve
server (``replica.py``). Its arguments are of two kinds:

* the deployment's, Serve's own knobs: ``num_replicas`` (default 1), or autoscaling on
  ongoing requests with ``min_replicas`` / ``max_replicas`` / ``target_ongoing_requests``
  (default 2, Serve's) and ``upscale_delay_s`` / ``downscale_delay_s``;
  ``max_ongoing_requests`` (default 32: the most requests a replica is handed at once, and
  the threads its gRPC calls run on), ``max_replicas_per_node``, ``num_cpus`` per replica
  (default 1), ``models_per_replica`` (``serve.multiplexed``; 0, the default, loads the
  whole repository in every replica), ``name`` (default ``plugserve``);
* every other argument is a ``plugserve serve`` setting by its name with underscores
  (``model_repository``, ``default_device``, ``max_inflight_bytes``, ``auth_tokens``...),
  parsed and checked by the same :class:`Settings`; an unknown name is refused, naming the
  known ones. The ports are Serve's (HTTP 8000, gRPC 9000: see :func:`serve_config`); the
  replica opens none (``metrics_port`` is off unless given). Model control defaults to
  ``none``: a load by request would reach one replica of many;
* prefix routing's: ``prefix_routing`` (``true``/``false``, default false) puts an ingress
  before the replicas that sends a conversation's turns to the replica holding its prefix
  (``routing.py``, ``ingress.py``), within ``prefix_routing_imbalance`` (default 4) requests
  of the least loaded replica, remembering at most ``prefix_routing_blocks`` (default
  100,000) blocks. Its application serves HTTP only (KServe v2 REST and the OpenAI and
  Anthropic routes): deploy a second one without it for KServe v2 gRPC.

Nothing here routes, scales or distributes: Serve's proxies, router and autoscaler do (under
prefix routing, through Serve's request-router API with a policy of ours).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from plugserve.ray.ingress import PlugserveIngress
from plugserve.ray.replica import replica_class
from plugserve.ray.routing import PrefixAffinityRouter
from plugserve.server.process.settings import Settings

__all__ = ["GRPC_SERVICER", "app", "serve_config"]

#: what Serve's gRPC proxy registers (``grpc_options.grpc_servicer_functions``)
GRPC_SERVICER = "plugserve.proto.grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server"


def _flag(value: Any) -> bool:
    """``true``/``false`` as ``serve run`` passes them (strings), or a config's booleans."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


_DEPLOYMENT = {
    "name": str,
    "num_replicas": int,
    "min_replicas": int,
    "max_replicas": int,
    "target_ongoing_requests": float,
    "upscale_delay_s": float,
    "downscale_delay_s": float,
    "max_ongoing_requests": int,
    "max_replicas_per_node": int,
    "num_cpus": float,
    "models_per_replica": int,
    "prefix_routing": _flag,
    "prefix_routing_imbalance": int,
    "prefix_routing_blocks": int,
}
_SETTINGS = {f.name: f for f in dataclasses.fields(Settings)}
#: the replica's defaults where the server's do not fit a replica
_REPLICA_DEFAULTS = {"metrics_port": -1, "model_control_mode": "none"}


def _split(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    deployment: dict[str, Any] = {}
    settings: dict[str, Any] = dict(_REPLICA_DEFAULTS)
    for key, value in args.items():
        name = key.replace("-", "_")
        try:
            if name in _DEPLOYMENT:
                deployment[name] = _DEPLOYMENT[name](value)
            elif name in _SETTINGS:
                field = _SETTINGS[name]
                settings[name] = type(field.default)(value)
            else:
                known = sorted([*_DEPLOYMENT, *_SETTINGS])
                raise ValueError(
                    f"plugserve.ray:app: unknown argument {key!r}; known: {', '.join(known)}"
                )
        except (TypeError, ValueError) as exc:
            if "unknown argument" in str(exc):
                raise
            raise ValueError(f"plugserve.ray:app: argument {key}={value!r}: {exc}") from None
    if deployment.get("models_per_replica", 0) > 0 and "model_control_mode" not in args:
        settings["model_control_mode"] = "explicit"  # nothing loaded until it is asked for
    return deployment, settings


def app(args: dict[str, Any]) -> Application:
    """The application ``serve run plugserve.ray:app key=value ...`` deploys."""
    deployment, settings = _split(dict(args or {}))
    problems = Settings(**settings).problems()  # refused here, before any replica starts
    if problems:
        raise ValueError(f"plugserve.ray:app: invalid settings: {'; '.join(problems)}")
    ongoing = deployment.get("max_ongoing_requests", 32)
    options: dict[str, Any] = {
        "name": deployment.get("name", "plugserve"),
        "max_ongoing_requests": ongoing,
        "ray_actor_options": {"num_cpus": deployment.get("num_cpus", 1)},
        # a replica loads its repository in its constructor: give a large one time
        "health_check_timeout_s": 60,
    }
    if "max_replicas" in deployment or "min_replicas" in deployment:
        least = deployment.get("min_replicas", 1)
        scaling = {"min_replicas": least, "max_replicas": deployment.get("max_replicas", least)}
        for key in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
            if key in deployment:  # else Serve's defaults (2 ongoing, 30 s up, 600 s down)
                scaling[key] = deployment[key]
        options["autoscaling_config"] = scaling
    else:
        options["num_replicas"] = deployment.get("num_replicas", 1)
    if "max_replicas_per_node" in deployment:
        options["max_replicas_per_node"] = deployment["max_replicas_per_node"]
    cls = replica_class(deployment.get("models_per_replica", 0))
    if not deployment.get("prefix_routing", False):
        return serve.deployment(cls).options(**options).bind(settings, ongoing)
    options["request_router_config"] = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs={
            "imbalance": deployment.get("prefix_routing_imbalance", 4),
            "max_blocks": deployment.get("prefix_routing_blocks", 100_000),
        },
    )
    replicas = serve.deployment(cls).options(**options).bind(settings, ongoing)
    ingress = serve.deployment(PlugserveIngress).options(
        name=f"ingress-{options['name']}",
        # it holds every replica's requests while they run; it computes nothing
        max_ongoing_requests=ongoing * max(options.get("num_replicas", 1), _most(options)) * 2,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replicas, settings)


def _most(options: dict[str, Any]) -> int:
    return int(options.get("autoscaling_config", {}).get("max_replicas", 1))


def serve_config(
    args: dict[str, Any], http_port: int = 8000, grpc_port: int = 9000, host: str = "0.0.0.0"
) -> dict[str, Any]:
    """A ``serve deploy`` / ``serve run`` config for the application, with Serve's ports set
    explicitly (HTTP 8000, gRPC 9000) and plugserve's servicer on the gRPC proxy."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": http_port},
        "grpc_options": {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        "applications": [
            {
                "name": "plugserve",
                "route_prefix": "/",
                "import_path": "plugserve.ray:app",
                "args": {k: v for k, v in args.items()},
            }
        ],
    }
