"""The MULTI and AUTO virtual devices: one network on several devices, or the best one."""

from plugserve.plugins.multi.plugin import AutoPlugin, MultiPlugin

__all__ = ["AutoPlugin", "MultiPlugin"]
