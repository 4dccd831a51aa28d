"""A Python model's configuration: the ``PYTHON`` device's keys (``parameters`` of its
``config.pbtxt`` with upper-case names: its Python, its process's bounds), the model's own
``config.pbtxt`` as Triton's message and as the JSON its ``args["model_config"]`` is, what its
``auto_complete_config`` may complete of it (checked as Triton's ModelConfig), its tensors'
specs, and the interpreter its processes run.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import ConfigKey, Configuration, InvalidModel, TensorSpec
from plugserve.plugins.configuration import parse_non_negative_int
from plugserve.server.control.triton_types import DTYPES

__all__ = ["PythonConfiguration", "completed", "interpreter", "model_config", "specs"]

log = logging.getLogger(__name__)


def parse_non_negative_seconds(value: str) -> float:
    number = float(str(value).strip())
    if not 0 <= number < 1e9:
        raise ValueError("expected a number of seconds >= 0")
    return number


def parse_niceness(value: str) -> int:
    number = int(str(value).strip())
    if not 0 <= number <= 19:
        raise ValueError("expected an integer from 0 to 19")
    return number


class PythonConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "EXECUTION_ENV_PATH",
            "",
            str,
            doc="the model's own Python: a virtual environment folder or an interpreter",
        ),
        ConfigKey(
            "MAX_PROCESS_BYTES",
            0,
            parse_non_negative_int,
            doc=(
                "memory one instance's process may hold (0: half of what the server may use): "
                "its allocations past it fail in the model, and a process found over it after "
                "a request is started again"
            ),
        ),
        ConfigKey(
            "MAX_SHM_BYTES",
            64 << 20,
            parse_non_negative_int,
            doc=(
                "size of each instance's own /dev/shm, a tmpfs gone with its process (0: the "
                "host's /dev/shm, unbounded): files past it fail to grow in the model"
            ),
        ),
        ConfigKey(
            "MAX_EXECUTE_SECONDS",
            300.0,
            parse_non_negative_seconds,
            doc=(
                "longest one execute may run (0: no bound): past it the model is taken as "
                "hung, its process killed and started again, its requests answered with an "
                "error; a client's deadline never stops a process"
            ),
        ),
        ConfigKey(
            "PROCESS_NICENESS",
            10,
            parse_niceness,
            doc=(
                "how far below the server's priority each instance's process runs (0-19, "
                "nice(2)): the server's threads, which answer every model's requests, take "
                "a core from a model busy on all of them at once"
            ),
        ),
    )


def model_config(path: Path) -> tuple[Any, dict[str, Any]]:
    """The entry's ``config.pbtxt`` as Triton's message and as the JSON models read (none:
    the name alone, and ``auto_complete_config`` may complete it)."""
    from google.protobuf import text_format

    from plugserve.server.control.triton_config import messages

    file = path.parent.parent / "config.pbtxt"
    message = messages().ModelConfig()
    if file.is_file():
        text_format.Parse(file.read_text(), message)
    if not message.name:
        message.name = path.parent.parent.name
    if not message.backend:
        message.backend = "python"  # Triton's auto-complete says so for a model.py
    return message, _as_json(message)


def _as_json(message: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    as_json = json_format.MessageToDict(message, preserving_proto_field_name=True)
    for kind in ("input", "output"):  # int64 dims are strings in protobuf's JSON: Triton's ints
        for entry in as_json.get(kind, []):
            entry["dims"] = [int(d) for d in entry.get("dims", [])]
            entry.setdefault("data_type", "TYPE_INVALID")
    as_json.setdefault("max_batch_size", 0)
    as_json.setdefault("input", [])
    as_json.setdefault("output", [])
    return as_json


#: what auto_complete_config may change (Triton's ModelConfig setters); the rest is the
#: repository's (instances, parameters, versions), and a change there is not acted on
_COMPLETABLE = ("input", "output", "max_batch_size", "dynamic_batching", "model_transaction_policy")


def completed(where: str, original: Any, returned: Any) -> dict[str, Any]:
    """What ``auto_complete_config`` returned, checked as Triton's ModelConfig: the model's
    configuration from now on (InvalidModel naming what is wrong)."""
    from google.protobuf import json_format

    from plugserve.server.control.triton_config import messages

    if not isinstance(returned, dict):
        raise InvalidModel(f"{where}: auto_complete_config gave {returned!r}, not a configuration")
    message = messages().ModelConfig()
    try:
        json_format.ParseDict(returned, message)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise InvalidModel(
            f"{where}: auto_complete_config returned a configuration that is not Triton's "
            f"ModelConfig: {exc}"
        ) from None
    final = messages().ModelConfig()
    final.CopyFrom(original)
    for field in _COMPLETABLE:
        final.ClearField(field)
        if field in ("input", "output"):
            getattr(final, field).extend(getattr(message, field))
        elif field == "max_batch_size":
            final.max_batch_size = message.max_batch_size
        elif message.HasField(field):
            getattr(final, field).CopyFrom(getattr(message, field))
    if final.max_batch_size < 0:
        raise InvalidModel(f"{where}: auto_complete_config set max_batch_size below 0")
    ignored = [
        f.name for f, _ in message.ListFields()
        if f.name not in _COMPLETABLE and f.name != "name" and getattr(original, f.name) != _
    ]  # fmt: skip
    if ignored:
        log.warning("%s: auto_complete_config changed %s: not acted on (the repository's)",
                    where, ", ".join(ignored))  # fmt: skip
    return _as_json(final)


def specs(config: dict[str, Any], kind: str, where: str) -> list[TensorSpec]:
    """The model's ``kind`` ("input", "output") tensors as the server checks them."""
    batched = int(config.get("max_batch_size", 0)) > 0
    found = []
    for entry in config.get(kind, []):
        dtype = DTYPES.get(entry.get("data_type", ""))
        if dtype is None:
            raise InvalidModel(
                f"{where}: {kind} {entry.get('name')!r} has data_type "
                f"{entry.get('data_type')!r}; use one of {', '.join(DTYPES)}"
            )
        dims = [None if d < 0 else d for d in entry["dims"]]
        shape = tuple(([None] if batched else []) + dims)
        # a Python model gets BYTES as Triton hands them over: the bytes, whatever they hold
        binary = np.dtype(dtype) == np.dtype(object)
        found.append(TensorSpec(entry["name"], np.dtype(dtype), shape, binary=binary))
    return found


def interpreter(setting: str, where: str) -> str:
    """The Python a model's processes run: the server's, or its EXECUTION_ENV_PATH's."""
    if not setting:
        return sys.executable
    path = Path(setting)
    candidate = path / "bin" / "python" if path.is_dir() else path
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        raise InvalidModel(
            f"{where}: EXECUTION_ENV_PATH {setting!r} is neither a virtual environment (with "
            "bin/python) nor a Python interpreter"
        )
    return str(candidate)
