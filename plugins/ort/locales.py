"""StringNormalizer's locale on onnxruntime.

onnxruntime builds a C++ ``std::locale`` from a StringNormalizer node's ``locale`` attribute
(``en_US.UTF-8`` when the node has none, off Windows) as it creates the session, and the
whole load fails when the machine has not generated that locale: a fresh Debian or Ubuntu
image has only ``C``, ``C.UTF-8`` and ``POSIX``, so every scikit-learn text pipeline failed to
load there. The locale only decides case mapping, which ``C.UTF-8`` does for all of Unicode
(glibc >= 2.35; measured with onnxruntime 1.32: "ÉCOLE", "ΑΒΓ" lower to "école", "αβγ", as under
en_US.UTF-8), and differs from a language's own only for Turkish and Azeri dotted/dotless i.
So a node whose locale the machine lacks runs with ``C.UTF-8`` and the load logs it, with the
line that installs the real one; without ``C.UTF-8`` either, the load is refused with that line.
NUMPY's StringNormalizer uses Python's locale-independent case mapping and needs none of this.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import onnx

from plugserve.plugins.api import Unsupported

__all__ = ["DEFAULT", "FALLBACK", "INSTALL", "available", "missing", "settle"]

log = logging.getLogger(__name__)

#: onnxruntime's locale for a StringNormalizer without the attribute (string_normalizer.cc)
DEFAULT = "en_US.UTF-8"
FALLBACK = "C.UTF-8"
INSTALL = (
    "install it: apt-get install locales, then uncomment en_US.UTF-8 in /etc/locale.gen and run "
    "locale-gen (Ubuntu: locale-gen en_US.UTF-8)"
)
_LC_ALL = 6  # glibc's; libstdc++ asks newlocale(1 << LC_ALL, name), which means every category


@functools.cache
def available(name: str) -> bool:
    """Whether ``std::locale(name)`` can be made here, asked the way libstdc++ asks glibc.
    Outside Linux the answer is left to onnxruntime (True)."""
    if not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None)
    libc.newlocale.restype = ctypes.c_void_p
    libc.newlocale.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p]
    libc.freelocale.argtypes = [ctypes.c_void_p]
    handle = libc.newlocale(1 << _LC_ALL, name.encode(), None)
    if not handle:
        return False
    libc.freelocale(handle)
    return True


def _normalizers(graph: onnx.GraphProto):
    for node in graph.node:
        if node.op_type == "StringNormalizer" and node.domain in ("", "ai.onnx"):
            yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _normalizers(attr.g)
            for sub in attr.graphs:
                yield from _normalizers(sub)


def _locale(node: onnx.NodeProto) -> tuple[onnx.AttributeProto | None, str]:
    for attr in node.attribute:
        if attr.name == "locale":
            return attr, attr.s.decode("utf-8", "replace")
    return None, DEFAULT


def missing(model: onnx.ModelProto) -> list[str]:
    """The locales the model's StringNormalizer nodes ask for that this machine lacks."""
    names = {_locale(node)[1] for node in _normalizers(model.graph)}
    return sorted(name for name in names if name and not available(name))


def settle(model: onnx.ModelProto, what: str) -> bool:
    """Point every StringNormalizer whose locale is missing at ``C.UTF-8`` (see above); True
    when the model was changed. Refuses the model when ``C.UTF-8`` is missing too."""
    changed = False
    for node in _normalizers(model.graph):
        attr, name = _locale(node)
        if not name or available(name):
            continue
        if not available(FALLBACK):
            raise Unsupported(
                f"{what}: node {node.name!r} (StringNormalizer) needs the {name} locale, which "
                f"this machine does not have (nor {FALLBACK}); {INSTALL}"
            )
        log.warning(
            "%s: node %r (StringNormalizer) asks for the %s locale, which this machine does not "
            "have; it runs with %s (the same case mapping except Turkish/Azeri i); to use %s, %s",
            what, node.name, name, FALLBACK, name, INSTALL,
        )  # fmt: skip
        if attr is None:
            node.attribute.append(onnx.helper.make_attribute("locale", FALLBACK))
        else:
            attr.s = FALLBACK.encode()
        changed = True
    return changed
