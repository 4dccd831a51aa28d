"""HETERO's configuration: the device priority list and the user's node affinities."""

from __future__ import annotations

import json

from plugserve.plugins.api import ConfigKey, Configuration
from plugserve.plugins.virtual import VirtualConfiguration, check_device_list, device_list

__all__ = ["HeteroConfiguration"]


def _affinity(value: str) -> str:
    text = str(value).strip()
    if not text:
        return ""
    mapping = json.loads(text)
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise ValueError('expected a JSON object {"node name": "DEVICE"}')
    return json.dumps(mapping, sort_keys=True)


class HeteroConfiguration(VirtualConfiguration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "DEVICE_PRIORITIES",
            "",
            check_device_list,
            doc="devices in priority order (HETERO:A,B sets it)",
        ),
        ConfigKey("AFFINITY", "", _affinity, doc='JSON {"node": "DEVICE"}: pin nodes to devices'),
    )

    OWN_KEYS = frozenset({"DEVICE_PRIORITIES", "AFFINITY"})

    def child_strings(self, device: str) -> dict[str, str]:
        """The per-call settings a child understands (PERF_COUNT, hints), none of HETERO's."""
        known = set(self._devices().plugin(device).config_class.keys())
        child = {
            k: str(v) for k, v in self.overrides.items() if k in known and k not in self.OWN_KEYS
        }
        if "PERF_COUNT" in known:
            child["PERF_COUNT"] = self.to_strings()["PERF_COUNT"]
        return child

    def priorities(self) -> list[str]:
        return device_list(self.get("DEVICE_PRIORITIES"))

    def affinity(self) -> dict[str, str]:
        text = self.get("AFFINITY")
        return json.loads(text) if text else {}
