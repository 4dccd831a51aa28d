"""plugserve's server side: the Core (plugin registry, device names, model cache) and tools."""

from plugserve.server.control.core import Core, DeviceInfo
from plugserve.server.control.devices import DeviceName, parse_device

__all__ = ["Core", "DeviceInfo", "DeviceName", "parse_device"]
