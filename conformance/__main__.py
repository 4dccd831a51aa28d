"""``python -m plugserve.conformance``: the same as ``plugserve conformance``."""

import sys

from plugserve.conformance.cli import main

sys.exit(main())
