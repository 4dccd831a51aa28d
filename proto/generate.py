"""Regenerate the Python modules for the .proto files in this folder.

    python proto/generate.py            # writes proto/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python proto/generate.py --check    # exit 1 if the committed modules are stale

protoc is run by grpcio-tools on a temporary tree where the sources sit under
``plugserve/proto/``, so the generated modules import each other as ``plugserve.proto.X_pb2``
(protoc derives Python imports from proto paths; the sources import each other that way too).
The KServe modules are then changed to add their files to a pool of their own (``pools.py``).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the modules whose files go to a descriptor pool of their own (pools.py; not imported from
#: there: this script runs before the package may be importable)
PRIVATE = ("grpc_service", "model_config")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pkg = root / "plugserve" / "proto"
        pkg.mkdir(parents=True)
        sources = sorted(HERE.glob("*.proto"))
        for source in sources:
            shutil.copy(source, pkg / source.name)
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
        ]
        args += [f"plugserve/proto/{s.name}" for s in sources]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for path in sorted(pkg.glob("*_pb2*.py*")):
            target = out_dir / path.name
            text = path.read_text()
            if path.name in {f"{stem}_pb2.py" for stem in PRIVATE}:
                text = _in_private_pool(text)
            target.write_text(text)
            written.append(target)
        return written


def _in_private_pool(text: str) -> str:
    """A generated module that adds its file to ``pools.KSERVE`` instead of the default pool
    (``pools.py`` says why)."""
    for old, new in (
        (
            "from google.protobuf.internal import builder as _builder\n",
            "from google.protobuf.internal import builder as _builder\n"
            "from plugserve.proto import pools as _pools\n",
        ),
        (
            "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(",
            "DESCRIPTOR = _pools.KSERVE.AddSerializedFile(",
        ),
    ):
        if text.count(old) != 1:
            raise SystemExit(f"protoc's output changed: {old.strip()!r} is not there once")
        text = text.replace(old, new)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(HERE):
            print(f"wrote {path.relative_to(HERE.parent)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name
            for p in fresh
            if not (HERE / p.name).exists() or not filecmp.cmp(p, HERE / p.name, shallow=False)
        ]
    if stale:
        print(f"stale generated modules: {', '.join(stale)}; run: python proto/generate.py")
        return 1
    print("generated modules are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
