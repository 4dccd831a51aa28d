"""Configuration: keys, their parsers, and a device's parsed configuration.

A :class:`Configuration` is made once per load from strings (a CLI flag, ``config.json``,
``config.pbtxt`` parameters, a load's config) and then passed down typed: a plugin, and a
virtual device's children, read its values without parsing them again (see
docs/architecture.md, "How a config value reaches the device"). Below the Plugin API: it
imports only the typed errors.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from plugserve.plugins.errors import InvalidArgument

__all__ = [
    "BOOL",
    "ConfigKey",
    "Configuration",
    "available_cores",
    "cpu_name",
    "format_bool",
    "parse_bool",
    "parse_hint",
    "parse_mode",
    "parse_non_negative_int",
]


def parse_bool(value: str) -> bool:
    text = str(value).strip().upper()
    if text in ("YES", "TRUE", "1", "ON"):
        return True
    if text in ("NO", "FALSE", "0", "OFF"):
        return False
    raise ValueError("expected YES or NO")


def format_bool(value: bool) -> str:
    return "YES" if value else "NO"


def parse_non_negative_int(value: str) -> int:
    number = int(str(value).strip())
    if number < 0:
        raise ValueError("expected an integer >= 0")
    return number


def parse_hint(value: str) -> str:
    text = str(value).strip().upper()
    if text not in ("LATENCY", "THROUGHPUT", ""):
        raise ValueError("expected LATENCY or THROUGHPUT")
    return text


def parse_mode(value: str) -> str:
    text = str(value).strip().upper()
    if text not in ("PERFORMANCE", "ACCURACY"):
        raise ValueError("expected PERFORMANCE or ACCURACY")
    return text


def _shown(value: Any, show: Callable[[Any], str] = repr, most: int = 200) -> str:
    """``value`` for an error message, at most ``most`` characters of it: a client's value
    (a megabyte of config) is not sent back whole."""
    text = show(value)
    return text if len(text) <= most else f"{text[:most]}... ({len(text):,} characters)"


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One configuration key: how its string form is parsed, shown and defaulted."""

    name: str
    default: Any
    parse: Callable[[str], Any] = str
    format: Callable[[Any], str] = str
    doc: str = ""


BOOL = {"parse": parse_bool, "format": format_bool}


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU's model name, for a device's FULL_DEVICE_NAME."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


class Configuration:
    """A plugin's configuration: every key parsed once, unknown keys refused.

    Like the template plugin's ``Configuration(config, defaultCfg, throwOnUnsupported)``: a new
    configuration starts from ``defaults`` (the plugin's current one) and overrides key by key,
    which is how per-call config beats the plugin's own (seed note on LoadExeNetworkImpl).
    Subclasses extend ``KEYS`` with their own keys.
    """

    KEYS: ClassVar[tuple[ConfigKey, ...]] = (
        ConfigKey("DEVICE_ID", "", doc="which device of this plugin's kind"),
        ConfigKey("PERF_COUNT", False, **BOOL, doc="collect per-node timings"),
        ConfigKey("PERFORMANCE_HINT", "LATENCY", parse_hint, doc="LATENCY or THROUGHPUT"),
        ConfigKey(
            "EXECUTION_MODE_HINT",
            "PERFORMANCE",
            parse_mode,
            doc=(
                "PERFORMANCE (default): the device's fastest precision (openvino: bf16 on CPUs "
                "with it); ACCURACY: the model's own precision on every device"
            ),
        ),
        ConfigKey("NUM_STREAMS", 0, parse_non_negative_int, doc="0: derived from the hint"),
        ConfigKey("INFERENCE_NUM_THREADS", 0, parse_non_negative_int, doc="0: all cores"),
        ConfigKey("CACHE_DIR", "", doc="folder for compiled networks; empty: no cache"),
    )

    def __init__(
        self,
        values: Mapping[str, Any] | None = None,
        defaults: Configuration | None = None,
        throw_on_unsupported: bool = True,
    ) -> None:
        keys = self.keys()
        self._values: dict[str, Any] = (
            dict(defaults._values)
            if defaults is not None
            else {k.name: k.default for k in keys.values()}
        )
        for name, raw in (values or {}).items():
            key = keys.get(name)
            if key is None:
                if throw_on_unsupported:
                    raise InvalidArgument(
                        f"unsupported config key {name!r}; supported keys: {', '.join(keys)}"
                    )
                continue
            try:
                if isinstance(raw, str) or key.parse is str:
                    value = key.parse(str(raw))
                else:
                    value = raw
                    key.parse(key.format(raw))
            # (RecursionError: a JSON value of 100,000 '[' was an INTERNAL with a traceback)
            except (TypeError, ValueError, RecursionError) as exc:
                raise InvalidArgument(
                    f"config key {name!r}: bad value {_shown(raw)} ({_shown(exc, str)})"
                ) from None
            self._values[name] = value

    @classmethod
    def keys(cls) -> dict[str, ConfigKey]:
        return {k.name: k for k in cls.KEYS}

    def get(self, name: str) -> Any:
        """The parsed value of ``name``; an unknown key raises (seed: GetConfig must throw)."""
        if name not in self._values:
            raise InvalidArgument(
                f"unsupported config key {name!r}; supported keys: {', '.join(self.keys())}"
            )
        return self._values[name]

    def get_string(self, name: str) -> str:
        return self.keys()[name].format(self.get(name)) if name in self._values else self.get(name)

    def to_strings(self) -> dict[str, str]:
        """All keys in their string form, as exported and shown to users."""
        return {name: self.keys()[name].format(value) for name, value in self._values.items()}

    def __getitem__(self, name: str) -> Any:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._values == self._values  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_strings()})"

    def streams(self, cores: int | None = None) -> int:
        """How many streams to run: NUM_STREAMS if set, else from PERFORMANCE_HINT."""
        if self.get("NUM_STREAMS"):
            return int(self.get("NUM_STREAMS"))
        if self.get("PERFORMANCE_HINT") == "THROUGHPUT":
            return max(1, cores or available_cores())
        return 1

    def threads_per_stream(self, cores: int | None = None) -> int:
        """Backend threads each stream's request runs with, so that streams x threads stays
        within the cores (INFERENCE_NUM_THREADS, when set, is the total budget instead)."""
        total = int(self.get("INFERENCE_NUM_THREADS") or 0) or cores or available_cores()
        return max(1, total // self.streams(cores))
