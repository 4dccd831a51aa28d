"""The user verbs of the ``plugserve`` command, against a running server.

    plugserve devices | metric DEVICE NAME | config DEVICE [KEY[=VALUE]...] | list
    plugserve load NAME MODEL.onnx [--device D] [--config K=V] [--persist] | unload NAME [--remove]
    plugserve load NAME --repository [--version N]   (a model of the server's own repository)
    plugserve query MODEL.onnx --device D | infer NAME [--input x=file.npy] [--output-dir DIR]
    plugserve infer text_sentiment --text "a wonderful film" | infer image_color --file cat.png
    plugserve export NAME FILE | import NAME FILE --device D

``--target`` (env ``PLUGSERVE_TARGET``, default 127.0.0.1:8001) picks the server;
``--tls-ca``/``--token`` (env ``PLUGSERVE_TLS_CA``/``PLUGSERVE_TOKEN``) secure the connection.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from plugserve.client.client import DEFAULT_TARGET, Client
from plugserve.client.inputs import bytes_inputs, make_inputs, spec_dtype
from plugserve.client.progress import progress
from plugserve.client.reach import explain

__all__ = ["VERBS", "run"]


def _config(items: Sequence[str]) -> dict[str, str]:
    config = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"plugserve: --config {item!r}: expected KEY=VALUE")
        config[key] = value
    return config


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


def _devices(client: Client, args: argparse.Namespace) -> int:
    """STOPS: how soon a cancelled run (its deadline, its client gone) stops on the device."""
    rows = [
        [
            d.name,
            "available" if d.available else "unavailable",
            d.full_name if d.available else d.reason,
            _cancellation(client, d.name) if d.available else "",
        ]
        for d in client.devices()
    ]
    print(_table(rows, ["DEVICE", "STATE", "DETAIL", "STOPS"]))
    return 0


def _cancellation(client: Client, device: str) -> str:
    """The device's CANCELLATION metric ('' from a server too old to have it)."""
    try:
        return str(client.get_metric(device, "CANCELLATION"))
    except Exception:
        return ""


def _metric(client: Client, args: argparse.Namespace) -> int:
    print(json.dumps(client.get_metric(args.device, args.name, args.network), indent=2))
    return 0


def _configure(client: Client, args: argparse.Namespace) -> int:
    sets = [i for i in args.keys if "=" in i]
    if sets:
        client.set_config(_config(sets), args.device)
    current = client.get_config(args.device)
    for key in [i.partition("=")[0] for i in args.keys] or sorted(current):
        value = current.get(key)
        if value is None:  # ask for it alone: the server's error names the supported keys
            value = client.get_config(args.device, key).get(key, "")
        print(f"{key}={value}")
    return 0


def _describe(network) -> str:
    def spec(s) -> str:
        dims = ",".join(n or ("?" if d < 0 else str(d)) for d, n in zip(s.shape, s.dim_names))
        return f"{s.name}:{s.dtype}[{dims}]"

    precision = f" ({network.precision})" if network.precision else ""
    return (
        f"{network.name} v{network.version} on {network.device}{precision}: "
        f"inputs {' '.join(spec(s) for s in network.inputs)} -> "
        f"outputs {' '.join(spec(s) for s in network.outputs)}"
    )


def _load(client: Client, args: argparse.Namespace) -> int:
    if not args.model:
        if not args.repository:
            raise SystemExit("plugserve load: name the model's .onnx file (or --repository)")
        args.model = args.name
    with progress(f"loading {args.name} on {args.device or 'the default device'}"):
        response = client.load(
            args.name,
            None if args.repository else args.model,
            args.device,
            _config(args.config),
            args.persist,
            args.version,
            repository_path=args.model if args.repository else None,
            timeout=args.timeout,
        )
    print(_describe(response.network) + (" (from cache)" if response.loaded_from_cache else ""))
    return 0


def _unload(client: Client, args: argparse.Namespace) -> int:
    client.unload(args.name, args.version, remove=args.remove)
    print(
        f"unloaded {args.name}"
        + (f" version {args.version}" if args.version else "")
        + (" and removed it from the repository" if args.remove else "")
    )
    return 0


def _list(client: Client, args: argparse.Namespace) -> int:
    for network in client.networks():
        print(_describe(network))
    return 0


def _query(client: Client, args: argparse.Namespace) -> int:
    with progress(f"querying {args.device}"):
        response = client.query(args.model, args.device, _config(args.config))
    if args.graph:
        import onnx

        from plugserve.client.graph import render, to_dot

        try:
            model = onnx.load(args.model, load_external_data=False)
        except Exception:  # a PyTorch program (one node), or not a model at all
            raise SystemExit(
                f"plugserve query: --graph draws ONNX graphs; {args.model} is not one"
            ) from None
        splits = [(s.device, list(s.nodes)) for s in response.subgraphs]
        try:
            path = render(to_dot(model, dict(response.supported), splits), args.graph)
        except (RuntimeError, ValueError) as exc:
            raise SystemExit(f"plugserve query: {exc}") from None
        print(f"graph -> {path}", file=sys.stderr)
    print(_table(_query_rows(response), ["NODE", "DEVICE", "WHY NOT"]))
    if len(response.subgraphs) > 1:
        import onnx

        from plugserve.client.graph import copies

        model = onnx.load(args.model, load_external_data=False)
        splits = [(s.device, list(s.nodes)) for s in response.subgraphs]
        crossing = copies(model, splits)
        print(
            f"{len(response.subgraphs)} subgraphs, {len(crossing)} copies between them"
            + (": " + ", ".join(f"{v} ({a}->{b})" for v, a, b in crossing) if crossing else ""),
            file=sys.stderr,  # the table on stdout stays rows only (scripts read it)
        )
    return 0


def _query_rows(response) -> list[list[str]]:
    """One row per node: where it runs ("-": nowhere) and why not elsewhere. For HETERO the
    reasons are per device of the priority list (``OPENVINO: ...; ORT: ...``); a server
    without ``refusals`` gives only the unsupported nodes' reasons."""
    why: dict[str, list[str]] = {}
    for refusal in getattr(response, "refusals", ()):
        why.setdefault(refusal.node, []).append(f"{refusal.device}: {refusal.reason}")
    for node, reason in response.unsupported.items():
        why.setdefault(node, []).append(reason)
    nodes = sorted({*response.supported, *why})
    return [[n, response.supported.get(n, "-"), "; ".join(why.get(n, []))] for n in nodes]


def _infer(client: Client, args: argparse.Namespace) -> int:
    versions = [n for n in client.networks() if n.name == args.name]
    if args.version:
        versions = [n for n in versions if n.version == args.version]
    # the latest version, as the server picks; when none, the server's NOT_FOUND says so
    network = max(versions, key=lambda n: n.version, default=None)
    specs = (
        [(s.name, spec_dtype(s.dtype), list(s.shape)) for s in network.inputs]
        if network is not None
        else []
    )
    given = bytes_inputs(args.text, args.file, specs)
    rest = [s for s in specs if s[0] not in given]
    inputs = {**given, **make_inputs(rest, 1, args.input, args.seed, verb="infer")}
    outputs = client.infer(args.name, inputs, version=args.version)
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    for name, array in outputs.items():
        if args.output_dir:
            path = Path(args.output_dir) / f"{name}.npy"
            if array.dtype == object and all(isinstance(v, str) for v in array.flat):
                array = array.astype(np.str_)  # strings: an .npy that loads without pickle
            np.save(path, array, allow_pickle=array.dtype == object)
            print(f"{name}: {array.dtype}{list(array.shape)} -> {path}")
        else:
            print(f"{name}: {array.dtype}{list(array.shape)}")
            print(np.array2string(_readable(array), threshold=64))
    return 0


def _readable(array: np.ndarray) -> np.ndarray:
    """BYTES elements that are UTF-8 text, printed as text (``positive``, not
    ``b'positive'``)."""
    if array.dtype != object:
        return array
    try:
        return np.vectorize(lambda v: v.decode("utf-8") if isinstance(v, bytes) else v,
                            otypes=[object])(array)  # fmt: skip
    except UnicodeDecodeError:
        return array


def _export(client: Client, args: argparse.Namespace) -> int:
    with progress(f"exporting {args.name}"):
        blob = client.export(args.name, args.version)
    Path(args.file).write_bytes(blob)
    print(f"{args.name}: {len(blob)} bytes -> {args.file}")
    return 0


def _import(client: Client, args: argparse.Namespace) -> int:
    with progress(f"importing {args.name} on {args.device}"):
        response = client.import_network(
            args.name, Path(args.file).read_bytes(), args.device, _config(args.config)
        )
    print(_describe(response.network))
    return 0


#: The security options that default to an environment variable: flag, variable, metavar, help
_SECURITY = [
    ("--tls-ca", "PLUGSERVE_TLS_CA", "PEM", "use TLS, trusting the CA in this file (env {env})"),
    (
        "--client-cert",
        "PLUGSERVE_CLIENT_CERT",
        "PEM",
        "client certificate for mutual TLS (env {env})",
    ),
    ("--client-key", "PLUGSERVE_CLIENT_KEY", "PEM", "private key of --client-cert (env {env})"),
    (
        "--token",
        "PLUGSERVE_TOKEN",
        "TOKEN",
        "sent as 'authorization: Bearer TOKEN' (env {env}; prefer the variable: a flag shows in "
        "the process list)",
    ),
]


def _parser(verb: str, help_text: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"plugserve {verb}", description=help_text)
    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="server address host:port or dns:///name:port (env PLUGSERVE_TARGET)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per call")
    security = parser.add_argument_group("security (docs/security.md)")
    security.add_argument(
        "--tls",
        action="store_true",
        help="use TLS with the system's trusted CAs (implied by --tls-ca and --client-cert)",
    )
    for flag, variable, metavar, text in _SECURITY:
        security.add_argument(
            flag,
            default=os.environ.get(variable) or None,
            metavar=metavar,
            help=text.format(env=variable),
        )
    return parser


def _arguments(verb: str, parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    if verb == "metric":
        add("device")
        add("name")
        add("--network", default="", help="a loaded network's metric instead of the device's")
    elif verb == "config":
        add("device")
        add("keys", nargs="*", metavar="KEY[=VALUE]")
    elif verb in ("load", "query"):
        if verb == "load":
            add("name")
        add(
            "model",
            **({"nargs": "?", "default": ""} if verb == "load" else {}),
            help="an .onnx file (or with --repository: NAME[/VERSION] in the server's "
            "repository, NAME itself when left out)",
        )
        add("--device", default="" if verb == "load" else "NUMPY")
        add("--config", action="append", default=[], metavar="KEY=VALUE")
        if verb == "load":
            add("--persist", action="store_true", help="write into the model repository")
            add("--version", type=int, default=0)
            add("--repository", action="store_true", help="MODEL names a repository model")
        else:
            add(
                "--graph",
                metavar="FILE",
                help="draw the model colored by device (.svg, .png, .pdf via graphviz, or .dot)",
            )
    elif verb in ("unload", "export", "infer"):
        add("name")
        add("--version", type=int, default=0)
        if verb == "unload":
            add(
                "--remove",
                action="store_true",
                help="also delete it from the server's model repository (else files stay)",
            )
        if verb == "export":
            add("file")
        if verb == "infer":
            add(
                "--input",
                action="append",
                default=[],
                help="NAME=file.npy or file.npz; missing inputs are random from the metadata",
            )
            add(
                "--text",
                action="append",
                default=[],
                metavar="[NAME=]TEXT",
                help="one element of a BYTES (string) input; repeat for several rows",
            )
            add(
                "--file",
                action="append",
                default=[],
                metavar="[NAME=]PATH",
                help="a file's bytes: the whole of a UINT8 input (an encoded image) or one "
                "element of a BYTES input",
            )
            add("--output-dir", default="", help="save outputs as .npy instead of printing")
            add("--seed", type=int, default=0)
    elif verb == "bench":
        from plugserve.client.bench import add_arguments

        add_arguments(parser)
    elif verb == "import":
        add("name")
        add("file")
        add("--device", required=True)
        add("--config", action="append", default=[], metavar="KEY=VALUE")


def _bench(client: Client, args: argparse.Namespace) -> int:
    from plugserve.client.bench import bench

    return bench(client, args, args.inprocess_factory)


VERBS: dict[str, tuple[Callable[[Client, argparse.Namespace], int], str]] = {
    "devices": (_devices, "list the server's devices, and why any is unavailable"),
    "metric": (_metric, "show a device (or network) metric"),
    "config": (_configure, "show or set a device's configuration"),
    "load": (_load, "load a network from an ONNX file or the repository"),
    "unload": (_unload, "unload a network"),
    "list": (_list, "list loaded networks"),
    "query": (_query, "which device can run each node of a model"),
    "infer": (_infer, "run one inference (inputs from .npy/.npz or random)"),
    "export": (_export, "save a compiled network to a file"),
    "import": (_import, "load a network from an exported file"),
    "bench": (_bench, "measure throughput and latency (a server's network, or --inprocess)"),
}


def run(verb: str, argv: Sequence[str], inprocess: Callable[..., Any] | None = None) -> int:
    """A client verb. ``inprocess`` is ``bench --inprocess``'s runner factory
    (``plugserve.client.bench.InprocessFactory``), given by the ``plugserve`` command."""
    function, help_text = VERBS[verb]
    parser = _parser(verb, help_text)
    _arguments(verb, parser)
    args = parser.parse_args(argv)
    args.inprocess_factory = inprocess
    try:
        client = Client(
            args.target,
            timeout=args.timeout,
            tls=args.tls,
            tls_ca=args.tls_ca,
            token=args.token,
            client_cert=args.client_cert,
            client_key=args.client_key,
        )
    except (ValueError, OSError) as exc:  # --client-cert without --client-key, unreadable PEM
        print(f"plugserve {verb}: {exc}", file=sys.stderr)
        return 2
    try:
        with client:
            return function(client, args)
    except grpc.RpcError as exc:
        details = exc.details() or ""
        print(f"plugserve {verb}: {exc.code().name}: {details}", file=sys.stderr)
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in details:
            secure = bool(args.tls or args.tls_ca or args.client_cert)
            print(f"plugserve {verb}: {explain(args.target, secure)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader left (| head): the command ends quietly
        raise
    except OSError as exc:  # a model, blob or output file that cannot be read or written
        print(f"plugserve {verb}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"plugserve {verb}: interrupted", file=sys.stderr)
        return 130
