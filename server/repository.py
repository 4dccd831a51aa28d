"""The model repository: ``DIR/<name>/<version>/model.onnx`` plus ``DIR/<name>/config.json``.

``config.json`` (optional) holds ``device``, ``config`` (device config keys) and
``max_batch_size``. Scanning never stops at a bad entry: each problem is reported with the file
and what is wrong, and the other models still load. Writes (networks loaded with ``persist``)
are atomic: the version folder is written under a temporary name, synced, then renamed into
place, so a crash leaves the whole model or none of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from plugserve.plugins.api import InvalidArgument, NotFound

__all__ = ["ModelEntry", "Repository", "check_name"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_VERSION = re.compile(r"[1-9][0-9]{0,17}")  # ASCII only: '²' and '٣' are digits to str.isdigit
_STAGING = re.compile(r"\.(trash\..+|.+\.[0-9]+\..+)")
MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.json"


def check_name(name: str) -> str:
    """Refuse a model name that could escape the repository or confuse a shell or a log."""
    # fullmatch, not match with '$': '$' also matches before a trailing newline
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"invalid model name {name!r}: use 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit (no '/', '..' or control characters)"
        )
    return name


def single_model_repository(source: str | os.PathLike, name: str) -> Path:
    """The repository to serve for ``--model-name NAME`` (KServe's storage layout).

    ``source`` naming one ``.onnx`` file, or a folder holding exactly one at its top: a
    repository in a fresh temporary folder (``$TMPDIR``) with that file linked as version 1 of
    ``name``, and a ``config.json`` beside the file linked as its config; the model files are
    read in place. A folder without a top-level ``.onnx`` file is a repository already and is
    served as it is. Several ``.onnx`` files: InvalidArgument, saying what to do instead.
    """
    check_name(name)
    source = Path(source)
    files = [source] if source.is_file() else sorted(source.glob("*.onnx"))
    if len(files) > 1:
        raise InvalidArgument(
            f"{source} holds several .onnx files ({', '.join(f.name for f in files)}); give "
            "one file, or the repository layout NAME/VERSION/model.onnx"
        )
    if not files:
        log.info("serving the model repository %s", source)
        return source
    model = files[0].resolve()
    root = Path(tempfile.mkdtemp(prefix="plugserve-models-"))
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / MODEL_FILE).symlink_to(model)
    if (model.parent / CONFIG_FILE).is_file():
        (root / name / CONFIG_FILE).symlink_to(model.parent / CONFIG_FILE)
    log.info("serving %s as model %s version 1", files[0], name)
    return root


def is_version(text: str) -> bool:
    """A version folder's name: a canonical integer > 0 ('1', '12'; not '0', '01' or '²')."""
    return _VERSION.fullmatch(text) is not None


@dataclasses.dataclass
class ModelEntry:
    name: str
    version: int
    path: Path
    device: str = ""
    config: dict[str, str] = dataclasses.field(default_factory=dict)
    max_batch_size: int = 0


@dataclasses.dataclass
class ModelSettings:
    device: str = ""
    config: dict[str, str] = dataclasses.field(default_factory=dict)
    max_batch_size: int = 0


class Repository:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def scan(self) -> tuple[list[ModelEntry], list[str]]:
        """Every model version found, and a message per problem (file and what is wrong)."""
        entries: list[ModelEntry] = []
        problems: list[str] = []
        if not self.root.is_dir():
            return [], [f"{self.root}: model repository folder does not exist"]
        try:
            folders = sorted(p for p in self.root.iterdir() if p.is_dir())
        except OSError as exc:
            return [], [f"{self.root}: cannot list the model repository ({exc})"]
        for folder in folders:
            if folder.name.startswith("."):
                continue  # our temporary folders, editors' droppings
            try:
                check_name(folder.name)
            except InvalidArgument as exc:
                problems.append(f"{folder}: {exc}")
                continue
            try:
                settings = self.read_settings(folder.name)  # its messages name the file
            except InvalidArgument as exc:
                problems.append(str(exc))
                continue
            try:
                versions = self._versions(folder, problems)
            except OSError as exc:
                problems.append(f"{folder}: cannot read this model folder ({exc})")
                continue
            if not versions:
                problems.append(f"{folder}: no version folder with a {MODEL_FILE}")
            for version in versions:
                entries.append(
                    ModelEntry(
                        folder.name,
                        version,
                        folder / str(version) / MODEL_FILE,
                        settings.device,
                        settings.config,
                        settings.max_batch_size,
                    )
                )
        return entries, problems

    @staticmethod
    def _versions(folder: Path, problems: list[str]) -> list[int]:
        versions = []
        for sub in sorted(folder.iterdir()):
            if not sub.is_dir() or sub.name.startswith("."):
                continue
            if not is_version(sub.name):
                problems.append(
                    f"{sub}: a version folder must be named by an integer > 0 "
                    "(digits, no leading zero)"
                )
                continue
            if not (sub / MODEL_FILE).is_file():
                problems.append(f"{sub}: no {MODEL_FILE} in this version folder")
                continue
            versions.append(int(sub.name))
        return sorted(versions)

    def read_settings(self, name: str) -> ModelSettings:
        path = self.root / check_name(name) / CONFIG_FILE
        if not path.is_file():
            return ModelSettings()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise InvalidArgument(f"{path}: expected a JSON object")
        unknown = set(raw) - {"device", "config", "max_batch_size"}
        if unknown:
            raise InvalidArgument(
                f"{path}: unknown key(s) {sorted(unknown)}; expected device, config, max_batch_size"
            )
        device = raw.get("device", "")
        config = raw.get("config", {})
        batch = raw.get("max_batch_size", 0)
        if not isinstance(device, str):
            raise InvalidArgument(f"{path}: 'device' must be a string")
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise InvalidArgument(f"{path}: 'config' must be an object of key: value")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
            raise InvalidArgument(f"{path}: 'max_batch_size' must be an integer >= 0")
        return ModelSettings(device, {k: str(v) for k, v in config.items()}, batch)

    def model_path(self, name: str, version: int = 0) -> Path:
        """The model file for ``name`` (latest version when 0); NotFound names what is missing."""
        folder = self.root / check_name(name)
        if version:
            path = folder / str(version) / MODEL_FILE
        else:
            versions = (
                sorted(
                    int(p.name)
                    for p in folder.iterdir()
                    if is_version(p.name) and (p / MODEL_FILE).is_file()
                )
                if folder.is_dir()
                else []
            )
            if not versions:
                raise NotFound(f"model {name!r} is not in the repository {str(self.root)!r}")
            path = folder / str(versions[-1]) / MODEL_FILE
        if not path.is_file():
            raise NotFound(f"model {name!r} version {version} is not in the repository")
        return path

    def next_version(self, name: str) -> int:
        folder = self.root / check_name(name)
        versions = (
            [int(p.name) for p in folder.iterdir() if is_version(p.name)] if folder.is_dir() else []
        )
        return max(versions, default=0) + 1

    def persist(
        self, name: str, version: int, model: bytes, device: str, config: dict[str, Any]
    ) -> Path:
        """Write a model version and its settings atomically; returns the model path."""
        check_name(name)
        folder = self.root / name
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / str(version)
        if final.exists():
            raise InvalidArgument(
                f"model {name!r} version {version} already exists in the repository"
            )
        settings_path = folder / CONFIG_FILE
        previous = settings_path.read_bytes() if settings_path.is_file() else None
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.{version}.", dir=self.root))
        try:
            # mkdtemp makes it 0700: give the version folder its model folder's permissions
            staging.chmod(folder.stat().st_mode & 0o7777)
            _write_synced(staging / MODEL_FILE, model)
            _fsync_dir(staging)
            # The settings go first, the version folder last: the rename is what publishes the
            # version, so a crash at any point leaves no version, or the version with its
            # settings (never a version on disk that would load without its device and config).
            settings = {"device": device, "config": {k: str(v) for k, v in config.items()}}
            self._write_settings(name, settings)
            os.replace(staging, final)
            _fsync_dir(folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if created:
                shutil.rmtree(folder, ignore_errors=True)
            elif previous is not None and not final.exists():
                with contextlib.suppress(OSError):
                    _write_synced(settings_path, previous)
            raise
        return final / MODEL_FILE

    def _write_settings(self, name: str, settings: dict[str, Any]) -> None:
        path = self.root / name / CONFIG_FILE
        if path.is_file():
            try:
                current = json.loads(path.read_text())
            except ValueError:
                current = {}
            if isinstance(current, dict) and current.get("max_batch_size"):
                settings["max_batch_size"] = current["max_batch_size"]
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{CONFIG_FILE}.", suffix=".tmp")
        try:
            os.fchmod(fd, path.parent.stat().st_mode & 0o666)  # mkstemp makes it 0600
            with os.fdopen(fd, "w") as f:
                json.dump(settings, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)

    def remove(self, name: str, version: int = 0) -> None:
        """Remove a persisted version (all versions when 0), renaming away before deleting."""
        folder = self.root / check_name(name)
        targets = [folder] if not version else [folder / str(version)]
        for target in targets:
            if not target.exists():
                continue
            trash = self.root / f".trash.{name}.{os.getpid()}.{uuid.uuid4().hex}"
            os.replace(target, trash)
            shutil.rmtree(trash, ignore_errors=True)
        if version and folder.is_dir() and not any(is_version(p.name) for p in folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)
        _fsync_dir(self.root)

    def clean_staging(self) -> list[Path]:
        """Remove what an interrupted write left behind (called at startup); returns it.

        That is a staging folder ``DIR/.<name>.<version>.<random>/``, a ``DIR/.trash.*``
        folder from an interrupted removal, and a ``DIR/<name>/.config.json.*.tmp`` file.
        """
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        try:
            leftovers = [
                p for p in self.root.iterdir() if p.is_dir() and _STAGING.fullmatch(p.name)
            ]
            for folder in self.root.iterdir():
                if folder.is_dir() and not folder.name.startswith("."):
                    leftovers += folder.glob(f".{CONFIG_FILE}.*.tmp")
        except OSError:
            return removed
        for leftover in leftovers:
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    leftover.unlink()
            if not leftover.exists():
                removed.append(leftover)
                log.warning("model repository: removed %s, left by an interrupted write", leftover)
        return removed


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
