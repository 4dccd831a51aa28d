"""The ``plugserve`` command: in-process verbs for now (``devices``, ``conformance``).

Server verbs (``serve``) and remote client verbs arrive with the server; each verb is a small
function that parses its own arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]


def _devices(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="plugserve devices", description="List device plugins and why any is unavailable."
    )
    parser.parse_args(argv)
    from plugserve.server.core import Core

    for info in Core().devices():
        state = info.full_name if info.available else f"unavailable: {info.reason}"
        print(f"{info.name:10} {state}")
    return 0


def _conformance(argv: Sequence[str]) -> int:
    from plugserve.server.conformance import main as conformance_main

    return conformance_main(argv)


VERBS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "devices": (_devices, "list device plugins (in-process)"),
    "conformance": (_conformance, "run the ONNX backend node tests on a device"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: plugserve VERB [options]\n\nverbs:")
        for verb, (_, help_text) in VERBS.items():
            print(f"  {verb:13} {help_text}")
        return 0 if args else 2
    verb = args[0]
    if verb not in VERBS:
        print(f"plugserve: unknown verb {verb!r}; try: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    return VERBS[verb][0](args[1:])


if __name__ == "__main__":
    sys.exit(main())
