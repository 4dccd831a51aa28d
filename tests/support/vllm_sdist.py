"""vLLM's own files from its source distribution on PyPI, at one pinned release.

Some tests run vLLM's code unchanged against plugserve (its example KV-events subscriber,
``tests/generate/test_kv_events.py``). vLLM's wheel holds no examples, but its sdist does; PyPI is
a registry every machine here reaches, where GitHub's raw files are not (CI's run could not
resolve them). The sdist (~47 MB) is fetched once through PyPI's simple index, checked against
the pinned sha256, and only :data:`FILES` are kept, under ``~/.cache/plugserve-tests``.

    python tests/support/vllm_sdist.py      # prints the folder, or why it could not be made
"""

from __future__ import annotations

import hashlib
import io
import re
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

VERSION = "0.33.0"
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
INDEX = "https://pypi.org/simple/vllm/"
#: the files kept, relative to the sdist's top folder
FILES = ("examples/features/kv_events/kv_events_subscriber.py",)
ROOT = Path.home() / ".cache" / "plugserve-tests" / f"vllm-sdist-{VERSION}"


def fetch(root: Path = ROOT) -> Path:
    """The folder holding :data:`FILES` (fetched on the first call)."""
    if all((root / f).is_file() for f in FILES):
        return root
    page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
    name = re.escape(f"vllm-{VERSION}.tar.gz")
    found = re.search(rf'href="([^"]*{name})(?:#[^"]*)?"', page)
    if found is None:
        raise RuntimeError(f"PyPI's index lists no vllm-{VERSION}.tar.gz")
    data = urllib.request.urlopen(urllib.parse.urljoin(INDEX, found.group(1)), timeout=300).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"vllm-{VERSION}.tar.gz: sha256 {digest}, expected {SHA256}")
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for file in FILES:
            member = archive.extractfile(f"vllm-{VERSION}/{file}")
            assert member is not None, file
            target = root / file
            target.parent.mkdir(parents=True, exist_ok=True)
            scratch = target.with_suffix(".part")
            scratch.write_bytes(member.read())
            scratch.replace(target)
    return root


if __name__ == "__main__":
    try:
        print(fetch())
    except Exception as exc:  # printed: the tests that need the files skip with the reason
        print(f"vLLM's sdist could not be fetched: {exc}", file=sys.stderr)
        sys.exit(1)
