"""Where an ORT network reads its model again after load, instead of holding it in memory.

A loaded network runs on its sessions alone; the model bytes are wanted again only for an
export, a profiling session (PERF_COUNT) or the names of profiled nodes, all rare. Holding the
bytes cost a network as much memory again as its session's weights (an 11 MB MLP: 28 MB RSS
per network against 14 MB for a bare InferenceSession), so a network keeps where they came
from instead: a model file is read again (and must still be what was loaded, checked by its
digest), and bytes handed to the load, which have no file, are spilled to an unnamed temporary
file that goes with the network.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from plugserve.plugins.api import FailedPrecondition

__all__ = ["FileSource", "ModelSource", "SpilledSource", "digest"]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ModelSource:
    """The validated model bytes a network was made from, read again on demand."""

    def read(self) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        """Give back what the source holds (a spilled file); reading afterwards fails."""


class FileSource(ModelSource):
    """A model file read again through the plugin's own reader (``read_file``: validation,
    external data, locales), refused when it no longer gives the bytes that were loaded:
    an export must be the network that runs, not a newer file in the repository."""

    def __init__(self, path: Path, read_file: Callable[[Path], bytes], data: bytes) -> None:
        self.path = path
        self._read_file = read_file
        self._digest = digest(data)

    def read(self) -> bytes:
        try:
            data = self._read_file(self.path)
        except Exception as exc:
            raise FailedPrecondition(
                f"model file {str(self.path)!r} the network was loaded from cannot be read "
                f"again ({exc}); reload the network"
            ) from None
        if digest(data) != self._digest:
            raise FailedPrecondition(
                f"model file {str(self.path)!r} changed since the network was loaded from it; "
                "reload the network to export or profile it"
            )
        return data


class SpilledSource(ModelSource):
    """Bytes with no file behind them (a LoadNetwork request's, an imported blob's payload),
    kept in a temporary file without a name: no other process can open it, and it is gone
    with the network or the process, however that ends (named ones outlived killed servers)."""

    def __init__(self, data: bytes) -> None:
        # it lives as long as the network, not a block: closed by close() or when collected
        self._file = tempfile.TemporaryFile(prefix="plugserve-ort-")  # noqa: SIM115
        try:
            self._file.write(data)
            self._file.flush()
        except BaseException:
            self._file.close()
            raise
        self._lock = threading.Lock()  # one reader at a time: reading moves the offset

    def read(self) -> bytes:
        try:
            with self._lock:
                self._file.seek(0)
                return self._file.read()
        except (OSError, ValueError) as exc:  # ValueError: closed with its network
            raise FailedPrecondition(
                f"the network's copy of its model cannot be read ({exc}); reload it"
            ) from None

    def close(self) -> None:
        self._file.close()
