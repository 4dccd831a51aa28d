"""A conformance run's results: the one-line figure, failures grouped by op, and the Markdown
docs/conformance.md keeps."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx

__all__ = ["KNOWN_GAPS", "CaseResult", "Report"]

#: Why an op's cases fail, where the reason is a decision rather than missing work.
KNOWN_GAPS = {
    "ImageDecoder": "Decoding JPEG/PNG/WebP needs Pillow, an optional dependency: "
    "pip install 'plugserve[image]'. Without it the op is reported unsupported.",
    "Bernoulli": "Random output: the expected values were drawn from numpy's global random "
    "generator when the case was made; shapes and types match.",
    "RandomUniformLike": "Random output (Bernoulli's function body): see Bernoulli.",
}


@dataclasses.dataclass
class CaseResult:
    name: str
    op_types: tuple[str, ...]
    status: str  # passed, failed
    detail: str = ""


@dataclasses.dataclass
class Report:
    device: str
    results: list[CaseResult]
    seconds: float

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def passed(self) -> int:
        return self.count("passed")

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def summary(self) -> str:
        return (
            f"PASS {self.passed} / TOTAL {self.total} = {100 * self.fraction:.1f}% on {self.device}"
        )

    def failures_by_op(self) -> dict[str, list[CaseResult]]:
        groups: dict[str, list[CaseResult]] = collections.defaultdict(list)
        for r in self.results:
            if r.status == "failed":
                groups[r.op_types[0] if r.op_types else "?"].append(r)
        return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))

    def markdown(self) -> str:
        """The report as docs/conformance.md keeps it: the figure, then what fails and why."""
        import platform

        lines = [
            "# Conformance: ONNX backend node tests",
            "",
            "Produced by `plugserve conformance --device "
            f"{self.device} --write-doc docs/conformance.md` (onnx {onnx.__version__}, "
            f"numpy {np.__version__}, Python {platform.python_version()}).",
            "",
            f"**{self.summary()}**",
            "",
            "Every case the suite builds is counted, whatever its element types (bfloat16, "
            "the float8 family, float4e2m1, int4/uint4, int2/uint2 and complex included): "
            "nothing is skipped.",
            "",
            "## Not supported yet",
            "",
            "Each failing case, grouped by the op it tests, with the first line of its error. A "
            "node that NUMPY cannot run is refused at load time and reported unsupported by "
            "QueryNetwork; it never returns wrong numbers silently.",
            "",
        ]
        for op, cases in self.failures_by_op().items():
            lines.append(f"### {op} ({len(cases)})")
            lines.append("")
            if op in KNOWN_GAPS:
                lines.extend([KNOWN_GAPS[op], ""])
            for case in cases:
                detail = case.detail.replace("|", "\\|")[:240]
                lines.append(f"- `{case.name}`: {detail}")
            lines.append("")
        return "\n".join(lines)

    def render(self, verbose: bool = False) -> str:
        lines = [self.summary()]
        for op, cases in self.failures_by_op().items():
            lines.append(f"  {op}: {len(cases)} failed")
            if verbose:
                lines.extend(f"    {c.name}: {c.detail[:300]}" for c in cases)
        return "\n".join(lines)
