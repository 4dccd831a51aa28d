"""The ``plugserve`` command: ``serve``, ``examples``, ``make-model`` and ``conformance`` (the
test runner in :mod:`plugserve.conformance`) run here; the user verbs (devices, load, infer,
...) talk to a server and live in :mod:`plugserve.client.cli`.

This module sits above every package (server, client, conformance); none of them imports it.
Each verb's module is imported when the verb runs, so ``plugserve devices`` does not load the
server or the plugins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]


def _conformance(argv: Sequence[str]) -> int:
    from plugserve.conformance.cli import main as conformance_main

    return conformance_main(argv)


def _examples(argv: Sequence[str]) -> int:
    """Where the bundled example models are, so README's commands can name a real file."""
    import argparse

    from plugserve.server.control.examples import build_examples, default_examples_dir

    parser = argparse.ArgumentParser(
        prog="plugserve examples",
        description="Build the bundled example models if needed and print their files.",
    )
    parser.add_argument("name", nargs="?", help="print only this model's file")
    args = parser.parse_args(argv)
    root = build_examples(default_examples_dir())
    models = {p.parts[-3]: p for p in sorted(root.glob("*/*/model.onnx"))}
    if args.name is not None:
        if args.name not in models:
            print(
                f"plugserve examples: no example {args.name!r}; examples: {', '.join(models)}",
                file=sys.stderr,
            )
            return 2
        print(models[args.name])
        return 0
    width = max(map(len, models), default=0)
    for name, path in models.items():
        print(f"{name:{width}}  {path}")
    return 0


def _make_model(argv: Sequence[str]) -> int:
    """A small model folder made offline (``server/control/examples/tiny_decoder.py``), for trying
    the generative routes where nothing can be downloaded."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="plugserve make-model",
        description="Make a small generative model folder offline (seeded random weights: its "
        "answers are nonsense) to try the OpenAI routes without downloading a model.",
    )
    parser.add_argument(
        "kind", choices=["tiny-llama"], help="tiny-llama: a Llama-style decoder, 0.23 M weights"
    )
    parser.add_argument("folder", help="where to write it; its name is the served model's name")
    args = parser.parse_args(argv)
    try:
        from plugserve.server.control.examples.tiny_decoder import make_tiny_llama
    except ImportError as exc:  # tokenizers
        print(f"plugserve make-model: {exc}: pip install 'plugserve[generate]'", file=sys.stderr)
        return 2
    from plugserve.client.progress import progress

    with progress(f"making {args.kind} in {args.folder}"):
        folder = make_tiny_llama(args.folder)
    print(folder)
    return 0


def _serve(argv: Sequence[str]) -> int:
    from plugserve.server.process.app import main as serve_main

    return serve_main(list(argv))


VERBS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "serve": (_serve, "run the server (with no arguments: on the bundled example models)"),
    "conformance": (_conformance, "run the ONNX backend node tests on a device"),
    "examples": (_examples, "print the bundled example models' files (plugserve examples mlp)"),
    "make-model": (_make_model, "make a small generative model folder offline (tiny-llama DIR)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run a verb; Ctrl-C ends any of them with one line (``plugserve VERB: interrupted``) and
    the shell's status for it, 130, never a traceback; nor does a closed pipe (``| head``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(args)
    except BrokenPipeError:  # `plugserve examples | head`: the reader left, nothing to add
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 141  # as a shell's command killed by SIGPIPE
    except KeyboardInterrupt:
        verb = f" {args[0]}" if args and not args[0].startswith("-") else ""
        newline = "\n" if sys.stderr.isatty() else ""  # after the ^C the terminal echoed
        sys.stderr.write(f"{newline}plugserve{verb}: interrupted\n")
        return 130


def _dispatch(args: list[str]) -> int:
    if args and args[0] in ("--version", "-V"):
        from plugserve.plugins.version import plugserve_version

        print(f"plugserve {plugserve_version()}")
        return 0
    if not args or args[0] in ("-h", "--help"):
        from plugserve.client.cli import VERBS as CLIENT_VERBS

        print(
            "usage: plugserve VERB [options]   "
            "(plugserve VERB --help for a verb's options; plugserve --version)"
        )
        print("\nverbs:")
        for verb, (_, help_text) in {**VERBS, **CLIENT_VERBS}.items():
            print(f"  {verb:13} {help_text}")
        return 0 if args else 2
    verb = args[0]
    # gRPC's own log lines (a failed TLS handshake's, say) would repeat what the verb says
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    if verb in VERBS:  # the server's own: a start does not load the client's modules
        return VERBS[verb][0](args[1:])
    from plugserve.client.cli import VERBS as CLIENT_VERBS
    from plugserve.client.cli import run as run_client

    if verb in CLIENT_VERBS:
        from plugserve.server.process.bench_inprocess import runner as inprocess_runner

        return run_client(verb, args[1:], inprocess=inprocess_runner)
    print(
        f"plugserve: unknown verb {verb!r}; try: {', '.join([*VERBS, *CLIENT_VERBS])}",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
