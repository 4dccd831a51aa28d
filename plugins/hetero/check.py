"""HETERO checks its devices at load: each piece against the reference device, on made-up data.

QueryNetwork says a device *can* run a node, and OPENVINO's checks each op alone
(``openvino/verify.py``); a device can still compute a run of ops wrongly where each op alone
is right: openvino 2026.4 fuses ``ReduceSum(keepdims=0) -> Mul -> Sub`` into a wrong result,
and a scikit-learn GaussianNB pipeline on ``HETERO:OPENVINO,NUMPY`` answered the wrong class
with status OK. So every piece placed on another device than the reference (NUMPY, when it
is one of HETERO's devices) is also compiled on the reference and both are run on the same
made-up inputs; a piece whose outputs disagree is moved, whole, to the reference device, with
a warning naming the device, the piece's nodes and the difference.

One verdict per piece (its model's bytes, device, configuration), kept for the process: a
network loaded again is not checked again. A piece that cannot be checked (an input of
unknown rank or a string, data the reference refuses, a device that fails on made-up data)
keeps its device; at run time every value a piece hands on is still checked for its type
and shape (``plugins/outputcheck.py``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import TYPE_CHECKING, Any

from plugserve.plugins.api import CompiledNetwork, Devices, PlugserveError
from plugserve.plugins.hetero.split import Piece
from plugserve.plugins.outputcheck import compare_outputs, made_up_inputs

if TYPE_CHECKING:
    from plugserve.plugins.hetero.config import HeteroConfiguration

__all__ = ["REFERENCE", "wrong_piece"]

log = logging.getLogger(__name__)

#: the device every other one is checked against: plugserve's own kernels, ONNX's reference
REFERENCE = "NUMPY"
#: the reference's configuration: untuned, its kernels' choice changes nothing it computes
REFERENCE_CONFIG = {"KERNEL_TUNING": "NO"}
#: most verdicts remembered
_MOST = 4096

_verdicts: dict[bytes, str] = {}
_lock = threading.Lock()


def wrong_piece(
    devices: Devices, piece: Piece, network: CompiledNetwork, config: HeteroConfiguration
) -> str:
    """Why ``network`` (``piece`` compiled on its device with ``config.child(device)``)
    disagrees with the reference on made-up data ('' when it agrees or cannot be checked)."""
    if piece.device.split(".")[0] == REFERENCE or REFERENCE not in devices.available_devices:
        return ""
    try:
        return _verdict(devices, piece, network, config)
    except Exception:  # a check that cannot be made gives no verdict, never a failure
        log.debug("HETERO: checking a piece on %s failed", piece.device, exc_info=True)
        return ""


def _verdict(
    devices: Devices, piece: Piece, network: CompiledNetwork, config: HeteroConfiguration
) -> str:
    feeds = made_up_inputs(piece.model)
    if feeds is None:
        return ""
    data = piece.model.SerializeToString()
    settings = config.child_strings(piece.device)
    key = hashlib.blake2b(
        data + piece.device.encode() + repr(sorted(settings.items())).encode(), digest_size=20
    ).digest()
    with _lock:
        verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _compare(devices, piece, network, feeds, config)
        with _lock:
            if len(_verdicts) >= _MOST:
                _verdicts.clear()
            _verdicts[key] = verdict
    return verdict


def _compare(
    devices: Devices,
    piece: Piece,
    network: CompiledNetwork,
    feeds: dict[str, Any],
    config: HeteroConfiguration,
) -> str:
    try:  # the reference's configuration parsed once per load, whatever the pieces
        reference_config = config.device_config(REFERENCE, REFERENCE_CONFIG)
        reference = devices.load_network(piece.model, REFERENCE, reference_config)
        want = reference.infer(feeds)
    except PlugserveError:
        return ""  # the reference cannot run it on made-up data: no verdict
    try:
        got = network.infer(feeds)
    except Exception as exc:  # the device fails on made-up data the reference takes
        log.debug("HETERO: checking a piece on %s failed to run: %s", piece.device, exc)
        return ""
    return compare_outputs(got, want, network.precision)
