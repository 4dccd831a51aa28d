"""The HETERO device: one network split across devices by node affinity (seed 000)."""

from plugserve.plugins.hetero.plugin import HeteroPlugin

__all__ = ["HeteroPlugin"]
