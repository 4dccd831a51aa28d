"""The model repository: ``DIR/<name>/<version>/model.onnx`` plus optional ``config.json`` files.

``config.json`` holds ``device``, ``config`` (device config keys) and ``max_batch_size``. The
operator's ``DIR/<name>/config.json`` applies to every version of the model; a version's own
``DIR/<name>/<version>/config.json`` overrides the keys it sets for that version alone. A
network loaded with ``persist`` writes its settings there, beside its model, so persisting
version 2 on another device leaves version 1 as it was acknowledged. (Repositories written
before kept the settings of persisted loads only in the model's ``config.json``: their versions
go on using it, and it is never rewritten by a load any more.)

A model's folder (or its version folder) holding a Hugging Face model's files, a
``config.json`` with ``model_type`` (transformers') or onnxruntime-genai's ``genai_config.json``
beside a decoder graph, is a generative model (``server/apps/generate/``): its entry's path is the
folder, served as version 1 when the files are in the model's folder itself. Its
``config.json`` is transformers', so plugserve's settings for such a model go in
``DIR/<name>/config.json`` beside a version folder ``1/`` holding the files.

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
from plugserve.server.control.formats import format_of
from plugserve.server.control.model_names import check_name
from plugserve.server.control.triton_config import (
    MODEL_FILE,
    OVMS_KEYS,
    PYTHON_MODEL_FILE,
    TRITON_FILE,
    VERSION_FOLDER,
    ModelSettings,
    OvmsModel,
    VersionPolicy,
    python_settings,
    read_ovms,
    read_sequence_json,
    read_triton,
)
from plugserve.server.control.warmup import WARMUP_FOLDER
from plugserve.server.plane.versions import MAX_VERSION, is_version

__all__ = ["ModelEntry", "Repository", "single_model_repository"]

log = logging.getLogger(__name__)

_STAGING = re.compile(r"\.(trash\..+|.+\.[0-9]+\..+)")
CONFIG_FILE = "config.json"


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
    settings: ModelSettings = dataclasses.field(default_factory=ModelSettings)

    @property
    def device(self) -> str:
        return self.settings.device

    @property
    def config(self) -> dict[str, str]:
        return self.settings.config

    @property
    def max_batch_size(self) -> int:
        return self.settings.max_batch_size


class Repository:
    """``root``: a folder of models, a Triton repository (``config.pbtxt`` files), or an
    OpenVINO Model Server ``config.json`` (the file, or a folder holding it) whose
    ``model_config_list`` names each model's ``base_path``."""

    def __init__(self, root: str | os.PathLike) -> None:
        root = Path(root)
        self.ovms_file: Path | None = None
        if root.is_file() and root.suffix == ".json":
            self.ovms_file, root = root, root.parent
        elif (root / CONFIG_FILE).is_file() and _is_ovms(root / CONFIG_FILE):
            self.ovms_file = root / CONFIG_FILE
        self.root = root

    def _ovms(self) -> dict[str, OvmsModel]:
        if self.ovms_file is None:
            return {}
        return {m.name: m for m in read_ovms(self.ovms_file)}

    def _pipelines(self) -> tuple[dict[str, ModelSettings], list[str]]:
        """An OVMS config.json's pipelines, as ENSEMBLE entries' settings, and one message
        per pipeline refused."""
        if self.ovms_file is None:
            return {}, []
        from plugserve.server.control.ovms_pipelines import read_pipelines  # OVMS's only

        models = self._ovms()
        try:
            raw = json.loads(self.ovms_file.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{self.ovms_file}: not valid JSON ({exc})") from None
        found, problems = read_pipelines(raw, self.ovms_file, models)
        settings = {
            d.name: ModelSettings(
                "ENSEMBLE",
                dynamic_batching=False,
                policy=VersionPolicy("latest", 1),
                model_file=VERSION_FOLDER,
                pipeline=d,
            )
            for d in found
        }
        return settings, problems

    def folder(self, name: str) -> Path:
        """Where model ``name``'s version folders are."""
        check_name(name)
        ovms = self._ovms().get(name)
        return ovms.base_path if ovms else self.root / name

    def _model_folders(self) -> list[Path] | dict[str, Path]:
        if self.ovms_file is not None:
            return {name: m.base_path for name, m in self._ovms().items()}
        return sorted(p for p in self.root.iterdir() if p.is_dir())

    def scan(self) -> tuple[list[ModelEntry], list[str]]:
        """Every model version found, and a message per problem (file and what is wrong)."""
        entries: list[ModelEntry] = []
        problems: list[str] = []
        if not self.root.is_dir():
            return [], [f"{self.root}: model repository folder does not exist"]
        try:
            found = self._model_folders()
        except OSError as exc:
            return [], [f"{self.root}: cannot list the model repository ({exc})"]
        except InvalidArgument as exc:
            return [], [str(exc)]
        named = found.items() if isinstance(found, dict) else [(f.name, f) for f in found]
        for name, folder in named:
            if name.startswith("."):
                continue  # our temporary folders, editors' droppings
            try:
                check_name(name)
            except InvalidArgument as exc:
                problems.append(f"{folder}: {exc}")
                continue
            try:
                settings = self.read_settings(name)  # its messages name the file
            except InvalidArgument as exc:
                problems.append(str(exc))
                continue
            if format_of(folder):  # a model's files as people have them (formats.py)
                entries.append(ModelEntry(name, 1, folder, settings))
                continue
            try:
                versions = self._versions(folder, problems, settings.model_file)
            except OSError as exc:
                problems.append(f"{folder}: cannot read this model folder ({exc})")
                continue
            versions = settings.policy.select(versions)
            if not versions:
                if _empty(folder):
                    # a persisted load interrupted before its version was published leaves its
                    # model folder empty: nothing to load, not an error to stop startup for
                    log.info("model repository: %s is empty; nothing to load there", folder)
                    continue
                problems.append(f"{folder}: no version folder with a {MODEL_FILE}")
            for version in versions:
                try:
                    own = self.read_settings(name, version)
                except InvalidArgument as exc:
                    problems.append(str(exc))
                    continue
                path = model_in(folder / str(version), own.model_file)
                entries.append(ModelEntry(name, version, path, own))  # type: ignore[arg-type]
        try:
            pipelines, refused = self._pipelines()
        except InvalidArgument as exc:
            pipelines, refused = {}, [str(exc)]
        problems += refused
        for name, settings in pipelines.items():  # OVMS pipelines are version 1, unversioned
            entries.append(ModelEntry(name, 1, self.ovms_file, settings))  # type: ignore[arg-type]
        return entries, problems

    @staticmethod
    def _versions(folder: Path, problems: list[str], model_file: str = MODEL_FILE) -> list[int]:
        versions = []
        for sub in sorted(folder.iterdir()):
            if not sub.is_dir() or sub.name.startswith(".") or sub.name == WARMUP_FOLDER:
                continue  # (warmup/: Triton's model_warmup data files, beside the versions)
            if not is_version(sub.name):
                problems.append(
                    f"{sub}: a version folder must be named by an integer > 0 "
                    "(digits, no leading zero)"
                )
                continue
            if model_in(sub, model_file) is None:
                problems.append(f"{sub}: no {model_file or '.onnx file'} in this version folder")
                continue
            versions.append(int(sub.name))
        return sorted(versions)

    def read_settings(self, name: str, version: int = 0) -> ModelSettings:
        """The model's settings; with ``version``, overridden by that version's own file."""
        folder = self.folder(name)
        base = ModelSettings()
        ovms = self._ovms().get(name)
        if ovms is None and self.ovms_file is not None:
            pipeline = self._pipelines()[0].get(name)
            if pipeline is not None:
                return dataclasses.replace(pipeline)
        if ovms is not None:
            base = ModelSettings(
                ovms.device,
                dict(ovms.config),
                policy=ovms.policy,
                model_file="",
                sequence=ovms.sequence,
            )
        elif (folder / TRITON_FILE).is_file():
            base = read_triton(folder / TRITON_FILE)
            if not base.device and base.model_file == MODEL_FILE and _python_model(folder):
                base.device, base.model_file = "PYTHON", PYTHON_MODEL_FILE
        elif not (folder / CONFIG_FILE).is_file() and _python_model(folder):
            base = python_settings()
        found = {} if ovms else _read_settings_file(folder / CONFIG_FILE)
        if version:
            found.update(_read_settings_file(folder / str(version) / CONFIG_FILE))
        settings = dataclasses.replace(
            base,
            device=found.get("device", base.device),
            config={**base.config, **found.get("config", {})},
            max_batch_size=found.get("max_batch_size", base.max_batch_size),
        )
        if "sequence_batching" in found:  # Triton's, as JSON: no dynamic batching beside it
            raw, path = found["sequence_batching"]
            settings.sequence = read_sequence_json(raw, settings.max_batch_size, folder, path)
            settings.dynamic_batching = False
        return settings

    def model_path(self, name: str, version: int = 0) -> Path:
        """The model file for ``name`` (latest version when 0); NotFound names what is missing."""
        folder = self.folder(name)
        if self.ovms_file is not None and name in self._pipelines()[0]:
            if version not in (0, 1):
                raise NotFound(f"pipeline {name!r} has no version {version} (pipelines are 1)")
            return self.ovms_file
        if not folder.is_dir():
            raise NotFound(f"model {name!r} is not in the repository {str(self.root)!r}")
        if version in (0, 1) and format_of(folder):
            return folder
        model_file = self.read_settings(name).model_file
        if not version:
            versions = sorted(
                int(p.name)
                for p in folder.iterdir()
                if is_version(p.name) and model_in(p, model_file) is not None
            )
            if not versions:
                raise NotFound(f"model {name!r} is not in the repository {str(self.root)!r}")
            version = versions[-1]
        path = model_in(folder / str(version), model_file)
        if path is None:
            raise NotFound(f"model {name!r} version {version} is not in the repository")
        return path

    @staticmethod
    def version_of(model: Path) -> int:
        """The version a stored model path (``model_path``'s answer) is: its version folder's
        number; a transformers folder is itself the version folder (``NAME/VERSION/`` holding
        the files) or, served as it is (``NAME/`` holding them), version 1."""
        if format_of(model):
            return int(model.name) if is_version(model.name) else 1
        for part in (model.parent.name, model.name):  # NAME/VERSION/<file>, or an ensemble's
            if is_version(part):  # version folder, which is its model itself
                return int(part)
        return 1

    def stamp(self, name: str, model: Path) -> tuple:
        """What a version was loaded from, to see it changed: the model file's and the
        settings files' sizes and modification times."""
        folder = self.folder(name)
        files = [model, folder / TRITON_FILE, folder / CONFIG_FILE, model.parent / CONFIG_FILE]
        if self.ovms_file is not None:
            files.append(self.ovms_file)
        stamps = []
        for path in files:
            try:
                info = path.stat()
                stamps.append((info.st_size, info.st_mtime_ns))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

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


def model_in(version_folder: Path, model_file: str) -> Path | None:
    """The model file of a version folder: ``model_file``, or ("") its one .onnx file, or
    (``VERSION_FOLDER``) the folder itself (an ensemble's); a folder an application serves (a
    generative model's files: ``formats.py``) is the folder itself too."""
    if format_of(version_folder):
        return version_folder
    if model_file == VERSION_FOLDER:
        return version_folder if version_folder.is_dir() else None
    if model_file:
        path = version_folder / model_file
        return path if path.is_file() else None
    found = sorted(version_folder.glob("*.onnx")) if version_folder.is_dir() else []
    return found[0] if len(found) == 1 else None


def _python_model(folder: Path) -> bool:
    """Whether a model folder is a Python model's by its files alone (as Triton's auto-complete
    tells a backend from them): a version folder holds model.py and no .onnx file."""
    try:
        versions = [p for p in folder.iterdir() if is_version(p.name) and p.is_dir()]
    except OSError:
        return False
    return any((v / PYTHON_MODEL_FILE).is_file() and not any(v.glob("*.onnx")) for v in versions)


def _is_ovms(path: Path) -> bool:
    try:
        return OVMS_KEYS in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _read_settings_file(path: Path) -> dict[str, Any]:
    """The keys a ``config.json`` sets, checked (none when there is no file)."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        json.dumps(raw, ensure_ascii=False).encode()  # no lone surrogates ("\ud800")
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:  # (nested 100,000 deep: a 500 before)
        raise InvalidArgument(f"{path}: not valid JSON (nested too deep)") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{path}: expected a JSON object")
    if "model_type" in raw:  # transformers' config.json of a model folder, not ours
        return {}
    unknown = set(raw) - {"device", "config", "max_batch_size", "sequence_batching"}
    if unknown:
        raise InvalidArgument(
            f"{path}: unknown key(s) {sorted(unknown)}; expected device, config, "
            "max_batch_size, sequence_batching"
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
    if "sequence_batching" in raw:
        if not isinstance(raw["sequence_batching"], dict):
            raise InvalidArgument(f"{path}: 'sequence_batching' must be an object")
        found["sequence_batching"] = (raw["sequence_batching"], path)
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
