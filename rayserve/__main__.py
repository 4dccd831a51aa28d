"""``python -m plugserve.ray key=value ...``: print a ``serve deploy`` config (JSON, which is
YAML) for the application with those arguments, Serve's ports set explicitly (HTTP 8000, gRPC
9000) and plugserve's KServe servicer on the gRPC proxy."""

from __future__ import annotations

import json
import sys

from plugserve.ray.app import serve_config


def main(argv: list[str]) -> int:
    args = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"expected key=value, got {item!r}", file=sys.stderr)
            return 2
        args[key] = value
    print(json.dumps(serve_config(args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
