"""The model repository: ``DIR/<name>/<version>/model.onnx`` plus optional ``config.json`` files.

``config.json`` holds ``device``, ``config`` (device config keys) and ``max_batch_size``. The
operator's ``DIR/<name>/config.json`` applies to every version of the model; a version's own
``DIR/<name>/<version>/config.json`` overrides the keys it sets for that version alone. A
network loaded with ``persist`` writes its settings there, beside its model, so persisting
version 2 on another device leaves version 1 as it was acknowledged. (Repositories written
before kept the settings of persisted loads only in the model's ``config.json``: their versions
go on using it, and it is never rewritten by a load any more.)

Scanning never stops at a bad entry: each problem is reported with the file and what is wrong,
and the other models still load. Writes (networks loaded with ``persist``) are atomic: the
version folder, model and settings, is written under a temporary name, synced, then renamed
into place, so a crash leaves the whole version or none of it.
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
from plugserve.server.versions import MAX_VERSION, is_version

__all__ = ["ModelEntry", "Repository", "check_name", "is_version"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
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
                self.read_settings(folder.name)  # its messages name the file
            except InvalidArgument as exc:
                problems.append(str(exc))
                continue
            try:
                versions = self._versions(folder, problems)
            except OSError as exc:
                problems.append(f"{folder}: cannot read this model folder ({exc})")
                continue
            if not versions:
                if _empty(folder):
                    # a persisted load interrupted before its version was published leaves its
                    # model folder empty: nothing to load, not an error to stop startup for
                    log.info("model repository: %s is empty; nothing to load there", folder)
                    continue
                problems.append(f"{folder}: no version folder with a {MODEL_FILE}")
            for version in versions:
                try:
                    own = self.read_settings(folder.name, version)
                except InvalidArgument as exc:
                    problems.append(str(exc))
                    continue
                entries.append(
                    ModelEntry(
                        folder.name,
                        version,
                        folder / str(version) / MODEL_FILE,
                        own.device,
                        own.config,
                        own.max_batch_size,
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

    def read_settings(self, name: str, version: int = 0) -> ModelSettings:
        """The model's settings; with ``version``, overridden by that version's own file."""
        folder = self.root / check_name(name)
        found = _read_settings_file(folder / CONFIG_FILE)
        if version:
            found.update(_read_settings_file(folder / str(version) / CONFIG_FILE))
        return ModelSettings(
            found.get("device", ""), found.get("config", {}), found.get("max_batch_size", 0)
        )

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
        self,
        name: str,
        version: int,
        model: bytes,
        device: str,
        config: dict[str, Any],
        max_batch_size: int = 0,
    ) -> Path:
        """Write a model version with its own settings atomically; returns the model path."""
        check_name(name)
        if not 1 <= version <= MAX_VERSION:  # the scan could not read such a folder back
            raise InvalidArgument(
                f"model {name!r}: version {version} cannot be persisted (1 to {MAX_VERSION})"
            )
        folder = self.root / name
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / str(version)
        if final.exists():
            raise InvalidArgument(
                f"model {name!r} version {version} already exists in the repository"
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.{version}.", dir=self.root))
        try:
            # mkdtemp makes it 0700: give the version folder its model folder's permissions
            staging.chmod(folder.stat().st_mode & 0o7777)
            _write_synced(staging / MODEL_FILE, model)
            # Everything a restart needs to load it as it was acknowledged, whatever the
            # model's config.json says then: device, config, and no batching added.
            settings = {
                "device": device,
                "config": {k: str(v) for k, v in config.items()},
                "max_batch_size": max_batch_size,
            }
            self._write_settings(staging, settings)
            _fsync_dir(staging)
            # The rename publishes the version: a crash leaves none, or all of it.
            os.replace(staging, final)
            _fsync_dir(folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if created:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        return final / MODEL_FILE

    def _write_settings(self, folder: Path, settings: dict[str, Any]) -> None:
        path = folder / CONFIG_FILE
        _write_synced(path, json.dumps(settings, indent=2, sort_keys=True).encode())
        os.chmod(path, folder.stat().st_mode & 0o666)

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


def _read_settings_file(path: Path) -> dict[str, Any]:
    """The keys a ``config.json`` sets, checked (none when there is no file)."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        json.dumps(raw, ensure_ascii=False).encode()  # no lone surrogates ("\ud800")
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{path}: expected a JSON object")
    unknown = set(raw) - {"device", "config", "max_batch_size"}
    if unknown:
        raise InvalidArgument(
            f"{path}: unknown key(s) {sorted(unknown)}; expected device, config, max_batch_size"
        )
    found: dict[str, Any] = {}
    if "device" in raw:
        if not isinstance(raw["device"], str):
            raise InvalidArgument(f"{path}: 'device' must be a string")
        found["device"] = raw["device"]
    if "config" in raw:
        config = raw["config"]
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise InvalidArgument(f"{path}: 'config' must be an object of key: value")
        found["config"] = {k: str(v) for k, v in config.items()}
    if "max_batch_size" in raw:
        batch = raw["max_batch_size"]
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
            raise InvalidArgument(f"{path}: 'max_batch_size' must be an integer >= 0")
        found["max_batch_size"] = batch
    return found


def _empty(folder: Path) -> bool:
    try:
        return next(folder.iterdir(), None) is None
    except OSError:
        return False


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
