"""A third-party device package as source text: NUMPY under other names with faults built in
(SECOND, HELD, FAULTY, GONE, NOLOAD, PARTIAL, BROKEN, SLOW, WRONG...). MULTI/AUTO and BATCH tests
write it into a site folder with an entry-point dist-info, so the server discovers it as a
user's plugin."""

DEVICES = """
import os
import time

from plugserve.plugins.api import BackendUnavailable, InferenceError, Unsupported
from plugserve.plugins.numpy import NumpyPlugin
from plugserve.plugins.numpy.compiled import NumpyCompiledNetwork
from plugserve.plugins.numpy.request import NumpyInferRequest


class SecondPlugin(NumpyPlugin):
    name = "SECOND"


class WrappedPlugin(NumpyPlugin):
    # NUMPY whose requests are request_class: a fault built into the request
    request_class = NumpyInferRequest

    def load_network(self, model, config=None):
        network = super().load_network(model, config)
        request_class = self.request_class

        class Network(NumpyCompiledNetwork):
            def create_infer_request(self):
                return request_class(self)

        network.__class__ = Network
        return network


def wait_for_gate(name):
    path = os.path.join(os.environ["PLUGSERVE_TEST_GATES"], name)
    for _ in range(120_000):  # bounded: the test opens every gate it uses
        if os.path.exists(path):
            return
        time.sleep(0.001)
    raise TimeoutError(f"gate {name} never opened")


class HeldRequest(NumpyInferRequest):
    def _infer(self, arrays, run):
        wait_for_gate("held")
        return super()._infer(arrays, run)



class HeldPlugin(WrappedPlugin):
    name = "HELD"
    request_class = HeldRequest


class FaultyRequest(NumpyInferRequest):
    def _infer(self, arrays, run):
        super()._infer(arrays, run)
        raise InferenceError("node 'matmul0' (MatMul) failed: acme kernel failure")



class FaultyPlugin(WrappedPlugin):
    name = "FAULTY"
    request_class = FaultyRequest


class Faulty2Plugin(FaultyPlugin):
    name = "FAULTY2"


class GoneRequest(NumpyInferRequest):
    # its card is off the bus until the test opens the gate "back"
    def _infer(self, arrays, run):
        if not os.path.exists(os.path.join(os.environ["PLUGSERVE_TEST_GATES"], "back")):
            raise BackendUnavailable("the acme card fell off the bus")
        return super()._infer(arrays, run)



class GonePlugin(WrappedPlugin):
    name = "GONE"
    request_class = GoneRequest


class NoLoadPlugin(NumpyPlugin):
    name = "NOLOAD"

    def load_network(self, model, config=None):
        raise Unsupported(f"{self.name} cannot compile anything today")


class NoLoad2Plugin(NoLoadPlugin):
    name = "NOLOAD2"


class PartialPlugin(NumpyPlugin):
    name = "PARTIAL"

    def query_network(self, model, config=None):
        supported = super().query_network(model, config)
        return {k: v for k, v in supported.items() if not k.startswith("relu")}


class SlowRequest(NumpyInferRequest):
    def _infer(self, arrays, run):
        time.sleep(0.005)
        return super()._infer(arrays, run)



class SlowPlugin(WrappedPlugin):
    name = "SLOW"
    request_class = SlowRequest


class WrongRequest(NumpyInferRequest):
    def _infer(self, arrays, run):
        return {k: v + 1 for k, v in super()._infer(arrays, run).items()}



class WrongPlugin(WrappedPlugin):
    name = "WRONG"
    request_class = WrongRequest


class BrokenPlugin(NumpyPlugin):
    name = "BROKEN"

    def __init__(self):
        raise BackendUnavailable("the acme driver is not installed")
"""

CLASSES = {
    "SECOND": "SecondPlugin",
    "HELD": "HeldPlugin",
    "FAULTY": "FaultyPlugin",
    "FAULTY2": "Faulty2Plugin",
    "GONE": "GonePlugin",
    "NOLOAD": "NoLoadPlugin",
    "NOLOAD2": "NoLoad2Plugin",
    "PARTIAL": "PartialPlugin",
    "BROKEN": "BrokenPlugin",
    "SLOW": "SlowPlugin",
    "WRONG": "WrongPlugin",
}
