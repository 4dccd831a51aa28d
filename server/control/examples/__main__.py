"""``python -m plugserve.server.control.examples [DIR]``: write the bundled examples into DIR
(default: the server's cache folder for them) and print where."""

from __future__ import annotations

import sys

from plugserve.server.control.examples import build_examples, default_examples_dir

print(build_examples(sys.argv[1] if len(sys.argv) > 1 else default_examples_dir()))
