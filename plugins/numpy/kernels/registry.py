"""The kernel registry: one builder per (domain, op type, schema version).

A *builder* runs once, at load time, with a :class:`KernelContext` describing the node
(attributes, input and output types and shapes, constant inputs, subgraphs). It returns the
*kernel*: a plain callable taking the node's input arrays (``None`` for an absent optional
input) and returning the output array, or a tuple of outputs for ops registered with
``multi_output=True``. Everything that can be decided from the node is decided in the builder,
so a request only calls kernels.

Versions are ONNX schema ``since_version`` numbers: a kernel registered for ``(1, 6, 13)``
serves models whose opset resolves the op to one of those schema versions and nothing else, so a
newer op version with changed semantics is reported unsupported rather than computed wrongly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx

from plugserve.plugins.api import Unsupported
from plugserve.plugins.numpy.kernels import narrow

__all__ = [
    "REQUIRED",
    "KernelContext",
    "KernelEntry",
    "Registry",
    "build_kernel",
    "default_registry",
    "register",
]

Kernel = Callable[..., Any]
Builder = Callable[["KernelContext"], Kernel]

REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    domain: str
    op_type: str
    versions: frozenset[int]
    build: Builder
    multi_output: bool = False
    # For extensions: (ctx) -> list of (dtype, shape) for outputs, used by shape propagation.
    infer: Callable[..., Any] | None = None


class Registry:
    """Builders by (domain, op type); resolves a node's schema version to a builder."""

    def __init__(self, parent: Registry | None = None) -> None:
        self._entries: dict[tuple[str, str], list[KernelEntry]] = {}
        self._parent = parent

    def add(self, entry: KernelEntry) -> None:
        self._entries.setdefault((entry.domain, entry.op_type), []).append(entry)

    def register(
        self,
        op_type: str,
        *versions: int,
        domain: str = "",
        multi_output: bool = False,
    ) -> Callable[[Builder], Builder]:
        """Decorator: ``@register("Relu", 6, 13, 14)`` registers a builder for those versions."""

        def wrap(build: Builder) -> Builder:
            self.add(KernelEntry(domain, op_type, frozenset(versions or (1,)), build, multi_output))
            return build

        return wrap

    def child(self) -> Registry:
        """A registry that adds entries (extensions) on top of this one without changing it."""
        return Registry(parent=self)

    def ops(self) -> list[tuple[str, str]]:
        keys = set(self._entries)
        if self._parent is not None:
            keys |= set(self._parent.ops())
        return sorted(keys)

    def _candidates(self, domain: str, op_type: str) -> list[KernelEntry]:
        own = self._entries.get((domain, op_type), [])
        inherited = self._parent._candidates(domain, op_type) if self._parent else []
        return own + inherited

    def lookup(self, domain: str, op_type: str, opset: int) -> KernelEntry | None:
        """The entry for this op at the model's opset of its domain, or None."""
        domain = "" if domain == "ai.onnx" else domain
        candidates = self._candidates(domain, op_type)
        if not candidates:
            return None
        version = schema_version(domain, op_type, opset)
        if version is None:  # not an ONNX-defined op: a custom domain's kernel serves any opset
            return candidates[0]
        for entry in candidates:
            if version in entry.versions:
                return entry
        return None

    def why_unsupported(self, domain: str, op_type: str, opset: int) -> str:
        candidates = self._candidates("" if domain == "ai.onnx" else domain, op_type)
        if not candidates:
            return f"no kernel for op {op_type!r}" + (f" of domain {domain!r}" if domain else "")
        have = sorted({v for e in candidates for v in e.versions})
        version = schema_version(domain, op_type, opset)
        return (
            f"op {op_type!r} version {version} (opset {opset}) has no kernel; "
            f"implemented versions: {have}"
        )


def schema_version(domain: str, op_type: str, opset: int) -> int | None:
    """The since_version of the schema that ``opset`` selects, or None for non-ONNX ops."""
    key = (domain, op_type, opset)
    cached = _SCHEMA_CACHE.get(key)
    if cached is not None or key in _SCHEMA_CACHE:
        return cached
    try:
        version: int | None = onnx.defs.get_schema(op_type, opset, domain).since_version
    except onnx.defs.SchemaError:
        version = None
    _SCHEMA_CACHE[key] = version
    return version


_SCHEMA_CACHE: dict[tuple[str, str, int], int | None] = {}


class KernelContext:
    """What a builder may know about its node at load time."""

    def __init__(
        self,
        node: Any,
        opset: int,
        input_specs: list[Any],
        output_specs: list[Any],
        constants: dict[str, np.ndarray],
        subgraph_factory: Callable[[str], Any] | None = None,
        tuner: Any = None,
    ) -> None:
        self.node = node
        self.op_type: str = node.op_type
        self.domain: str = node.domain
        self.name: str = node.name
        self.opset = opset
        self.version = schema_version(node.domain, node.op_type, opset) or opset
        self._input_specs = input_specs
        self._output_specs = output_specs
        self._constants = constants
        self._subgraph_factory = subgraph_factory
        self._tuner = tuner

    def site(self) -> Any:
        """This node's tuning site (``tuning.Site``: a choice among kernels, timed on this
        machine), or None where the plan is compiled without a tuner (constant folding)."""
        return None if self._tuner is None else self._tuner.site(self.name)

    # --- attributes

    def attr(self, name: str, default: Any = REQUIRED) -> Any:
        """Decoded attribute (ints, floats, str, lists, np.ndarray for tensors)."""
        if name in self.node.attrs:
            return self.node.attr(name)
        if default is REQUIRED:
            raise Unsupported(
                f"node {self.name!r} ({self.op_type}): attribute {name!r} is required"
            )
        return default

    def has_attr(self, name: str) -> bool:
        return name in self.node.attrs

    # --- inputs and outputs

    @property
    def num_inputs(self) -> int:
        return len(self.node.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.node.outputs)

    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and bool(self.node.inputs[i])

    def has_output(self, i: int) -> bool:
        return i < len(self.node.outputs) and bool(self.node.outputs[i])

    def input_dtype(self, i: int) -> np.dtype | None:
        spec = self._input_specs[i] if i < len(self._input_specs) else None
        return spec.dtype if spec is not None else None

    def input_shape(self, i: int) -> tuple | None:
        spec = self._input_specs[i] if i < len(self._input_specs) else None
        return spec.shape if spec is not None else None

    def output_dtype(self, i: int = 0) -> np.dtype | None:
        spec = self._output_specs[i] if i < len(self._output_specs) else None
        return spec.dtype if spec is not None else None

    def output_shape(self, i: int = 0) -> tuple | None:
        spec = self._output_specs[i] if i < len(self._output_specs) else None
        return spec.shape if spec is not None else None

    def constant(self, i: int) -> np.ndarray | None:
        """The value of input ``i`` when it is an initializer or folded constant, else None."""
        if not self.has_input(i):
            return None
        return self._constants.get(self.node.inputs[i])

    # --- control flow

    def subgraph(self, attr_name: str) -> Any:
        """A compiled subgraph: ``sub.run(inputs, captured) -> list`` (see engine.Subgraph)."""
        if self._subgraph_factory is None:
            raise Unsupported(f"node {self.name!r}: subgraphs are not available here")
        return self._subgraph_factory(attr_name)

    def derive(
        self, op_type: str, domain: str, opset: int, drop_attrs: Iterable[str] = ()
    ) -> KernelContext:
        """A context for the same node seen as another op (fused kernels build their base)."""
        import dataclasses as _dc

        dropped = set(drop_attrs)
        node = _dc.replace(
            self.node,
            op_type=op_type,
            domain=domain,
            attrs={k: v for k, v in self.node.attrs.items() if k not in dropped},
        )
        return KernelContext(
            node,
            opset,
            self._input_specs,
            self._output_specs,
            self._constants,
            self._subgraph_factory,
            self._tuner,
        )

    def unsupported(self, why: str) -> Unsupported:
        """An error for the builder to raise: the node is refused at load with the reason."""
        return Unsupported(f"node {self.name!r} ({self.op_type}): {why}")


def build_kernel(entry: KernelEntry, ctx: KernelContext) -> Kernel:
    """The entry's kernel for the node; arithmetic on bfloat16, float8, float4, int4 or int2
    values is computed widened (see :mod:`narrow`), so each op need not know those types."""
    if entry.op_type not in narrow.EXACT_OPS and any(
        s is not None and narrow.is_narrow(s.dtype) for s in (*ctx._input_specs, *ctx._output_specs)
    ):
        return narrow.widened(entry.build, ctx, entry.multi_output)
    return entry.build(ctx)


default_registry = Registry()
register = default_registry.register


def registered_ops(registry: Registry | None = None) -> Iterable[tuple[str, str]]:
    return (registry or default_registry).ops()
