"""The ONNX backend node tests run on a device: how far a plugin conforms to the ONNX spec.

A test runner, not part of the server: ``cases`` (reading them), ``run`` (running and
comparing), ``report`` (the figure and docs/conformance.md), ``cli`` (``plugserve conformance``).
"""

from plugserve.conformance.cases import Case, load_cases
from plugserve.conformance.report import CaseResult, Report
from plugserve.conformance.run import run_conformance

__all__ = ["Case", "CaseResult", "Report", "load_cases", "run_conformance"]
