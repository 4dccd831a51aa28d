"""NUMPY's load-time kernel tuning (plugins/numpy/tuning.py) and the channel-last conv kernels
it chooses among (kernels/conv_nhwc.py).

Every candidate of a conv's tuning site is forced in turn on real models and checked against
onnxruntime, in both input layouts, so whichever one this machine's timing picks is right; the
tuning itself is checked end to end: choices made at load, exported and imported without timing
again (through the Core's CACHE_DIR as a user caches), timed again on another machine, bounded
per site, and a channel-last network returning ordinary C-ordered outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from plugserve.plugins.numpy import tuning
from plugserve.plugins.numpy.kernels.conv_nhwc import is_channel_last

ort = pytest.importorskip("onnxruntime")

F32 = TensorProto.FLOAT
BOUND = 1e-4  # relative to the largest output, as test_numpy_conv_fast.py (Winograd F(4, 3))


def _model(nodes, x_shape, inits, out="y", out_shape=("N", "M", "H", "W")):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F32, x_shape)],
        [helper.make_tensor_value_info(out, F32, list(out_shape))],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _conv(rng, c, m, k, bias=True, **attrs):
    inits = {"w": (rng.standard_normal((m, c, k, k)) * (2 / (c * k * k)) ** 0.5).astype("f4")}
    if bias:
        inits["b"] = rng.standard_normal(m).astype("f4")
    node = helper.make_node("Conv", ["x", *inits], ["y"], name="conv", **attrs)
    return node, inits


def _ort(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _close(ours, ref):
    assert ours.shape == ref.shape
    assert float(np.max(np.abs(ours - ref))) <= BOUND * (float(np.max(np.abs(ref))) or 1.0)


def _channel_last(x):
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


CONVS = [
    # c, m, k, x shape, attributes
    (16, 24, 3, (1, 16, 20, 20), {"pads": [1, 1, 1, 1]}),
    (16, 16, 3, (2, 16, 13, 11), {"pads": [1, 1, 1, 1]}),  # batch 2, odd sizes: cropped tiles
    (8, 12, 3, (1, 8, 17, 15), {"pads": [0, 2, 1, 0]}),  # asymmetric pads
    (8, 8, 3, (1, 8, 12, 12), {"auto_pad": "SAME_UPPER"}),
    (8, 8, 3, (1, 8, 15, 15), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (8, 8, 3, (1, 8, 15, 15), {"dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    (8, 16, 1, (1, 8, 9, 9), {}),  # pointwise: the image is the GEMM operand
    (8, 16, 1, (1, 8, 9, 9), {"strides": [2, 2]}),
    (3, 8, 7, (1, 3, 30, 30), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),  # a stem
    # a stem large enough that the NCHW path copies its columns in slabs on both threads
    (3, 32, 7, (2, 3, 64, 64), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
]


@pytest.mark.parametrize(("c", "m", "k", "shape", "attrs"), CONVS)
@pytest.mark.parametrize("bias", [True, False])
def test_every_candidate_of_a_conv_site_matches_onnxruntime(
    numpy_plugin, c, m, k, shape, attrs, bias
):
    rng = np.random.default_rng(c * m + k + len(attrs))
    node, inits = _conv(rng, c, m, k, bias, **attrs)
    model = _model([node], list(shape), inits)
    net = numpy_plugin.load_network(model)
    site = net.tuner.sites["conv"]
    x = rng.standard_normal(shape).astype(np.float32)
    ref = _ort(model, x)
    tried = set()
    for layout, value in (("nchw", x), ("nhwc", _channel_last(x))):
        key = tuning.input_key(value, layout)
        net.infer({"x": value})  # times this key if the load did not
        names = list(_candidates_of(net))
        assert "nchw" in names and "nhwc-gemm" in names
        for name in names:
            site.choices[key] = name
            ours = net.infer({"x": value})["y"]
            assert ours.flags.c_contiguous
            _close(ours, ref)
            tried.add(name)
    winograd = k == 3 and "strides" not in attrs and "dilations" not in attrs
    assert {"nhwc-wino2", "nhwc-wino4"} <= tried if winograd else "nhwc-wino2" not in tried


def _candidates_of(net):
    """The candidate names the conv's site timed (its log: {name: best ms})."""
    return next(times for site, times in reversed(net.tuner.log) if site == "conv")


def _resnet_block_model(rng, batch="N"):
    """conv-bn-relu, conv-bn, residual add, relu, then a 1x1 conv, pooling and a classifier
    (Flatten reads the channel-last activations in NCHW order)."""
    nodes, inits = [], {}

    def conv(x, c, m, k, name):
        inits[f"{name}_w"] = (rng.standard_normal((m, c, k, k)) * (2 / (c * k * k)) ** 0.5).astype(
            "f4"
        )
        inits[f"{name}_b"] = (rng.standard_normal(m) * 0.1).astype("f4")
        pads = [k // 2] * 4
        nodes.append(
            helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [name], name=name, pads=pads)
        )
        return name

    y = conv("x", 3, 32, 3, "stem")
    nodes.append(helper.make_node("Relu", [y], ["r0"], name="r0"))
    a = conv("r0", 32, 32, 3, "c1")
    nodes.append(helper.make_node("Relu", [a], ["r1"], name="r1"))
    b = conv("r1", 32, 32, 3, "c2")
    nodes.append(helper.make_node("Add", [b, "r0"], ["sum"], name="add"))
    nodes.append(helper.make_node("Relu", ["sum"], ["r2"], name="r2"))
    p = conv("r2", 32, 48, 1, "proj")
    nodes.append(helper.make_node("AveragePool", [p], ["pool"], name="pool", kernel_shape=[2, 2],
                                  strides=[2, 2]))  # fmt: skip
    nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="flat"))
    inits["fc"] = (rng.standard_normal((48 * 8 * 8, 10)) * 0.02).astype("f4")
    nodes.append(helper.make_node("MatMul", ["flat", "fc"], ["logits"], name="fc"))
    return _model(nodes, [batch, 3, 16, 16], inits, out="logits", out_shape=("N", 10))


def test_a_network_is_tuned_at_load_and_serves_the_same_results(numpy_plugin):
    rng = np.random.default_rng(0)
    model = _resnet_block_model(rng)
    net = numpy_plugin.load_network(model)
    assert net.tuner.timed >= 4  # every conv timed once, at load, on a batch of 1
    assert set(net.tuner.sites) >= {"stem", "c1", "c2", "proj"}
    for batch in (1, 3):  # batch 3: timed on this first request
        x = rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)
        out = net.infer({"x": x})["logits"]
        assert out.flags.c_contiguous
        _close(out, _ort(model, x))


def test_fixed_rules_time_nothing(numpy_plugin):
    model = _resnet_block_model(np.random.default_rng(1))
    net = numpy_plugin.load_network(model, {"KERNEL_TUNING": "NO"})
    x = np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32)
    _close(net.infer({"x": x})["logits"], _ort(model, x))
    assert net.tuner.timed == 0 and not net.tuner.log


def test_a_channel_last_network_keeps_its_activations_channel_last(numpy_plugin):
    model = _resnet_block_model(np.random.default_rng(3))
    net = numpy_plugin.load_network(model)
    x = np.random.default_rng(4).standard_normal((1, 3, 16, 16)).astype(np.float32)
    for name, shape in [("stem", (1, 3, 16, 16))] + [
        (n, (1, 32, 16, 16)) for n in ("c1", "c2", "proj")
    ]:
        dummy = np.empty(shape, np.float32)
        for layout in ("nchw", "nhwc"):
            net.tuner.sites[name].choices[tuning.input_key(dummy, layout)] = "nhwc-gemm"
    seen = []
    plan = net.plan
    for step in plan.steps:
        if step.node.name in ("add", "r2"):
            original = step.fn
            step.fn = lambda *a, f=original: seen.append(f(*a)) or seen[-1]
    plan._flat = [(s.fn, s.inputs, s.outputs[0], s.outputs, s.free) for s in plan.steps]
    _close(net.infer({"x": x})["logits"], _ort(model, x))
    assert len(seen) == 2 and all(is_channel_last(v) for v in seen)


def test_choices_travel_with_the_export_and_are_not_timed_again(numpy_plugin):
    model = _resnet_block_model(np.random.default_rng(5))
    net = numpy_plugin.load_network(model)
    imported = numpy_plugin.import_network(net.export())
    assert imported.tuner.timed == 0
    assert {k: s.choices for k, s in imported.tuner.sites.items() if s.choices} == {
        k: s.choices for k, s in net.tuner.sites.items() if s.choices
    }
    assert imported.tuner.channel_last == net.tuner.channel_last
    x = np.random.default_rng(6).standard_normal((1, 3, 16, 16)).astype(np.float32)
    _close(imported.infer({"x": x})["logits"], _ort(model, x))
    assert imported.tuner.timed == 0


def test_a_second_load_from_the_cache_dir_does_not_tune(tmp_path):
    from plugserve.server import Core

    model = _resnet_block_model(np.random.default_rng(7))
    config = {"CACHE_DIR": str(tmp_path)}
    first = Core().load_network(model, "NUMPY", config)
    second = Core().load_network(model, "NUMPY", config)
    assert not first.loaded_from_cache and first.tuner.timed > 0
    assert second.loaded_from_cache and second.tuner.timed == 0 and not second.tuner.log
    assert second.tuner.threading == first.tuner.threading


def test_who_splits_the_gemms_is_timed_at_load_and_cached(tmp_path):
    """A network without conv sites (an MLP) still times OpenBLAS's threads against NUMPY's
    split at load when it has threads to split over, keeps the faster, and a second load
    from the cache times nothing; both ways compute the same."""
    from plugserve.server import Core

    rng = np.random.default_rng(9)
    inits = {
        "w1": rng.standard_normal((256, 512)).astype("f4"),
        "w2": rng.standard_normal((512, 64)).astype("f4"),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
    ]
    model = _model(nodes, ["N", 256], inits, out_shape=("N", 64))
    config = {"CACHE_DIR": str(tmp_path), "PERFORMANCE_HINT": "LATENCY"}
    first = Core().load_network(model, "NUMPY", config)
    if first.gemm_threads < 2:
        pytest.skip("one core: nothing to split")
    assert [site for site, _ in first.tuner.log] == ["threading"]
    assert first.tuner.threading[((1, 256),)] in ("split", "openblas")  # the load's batch 1
    second = Core().load_network(model, "NUMPY", config)
    assert second.loaded_from_cache and not second.tuner.log
    assert second.tuner.threading == first.tuner.threading
    x = rng.standard_normal((64, 256)).astype(np.float32)
    ref = _ort(model, x)
    runs = 2 * (tuning.THREADING_SKIP + tuning.THREADING_RUNS)
    for _ in range(runs):  # a new batch: both ways, then a choice
        _close(second.infer({"x": x})["y"], ref)
    assert second.tuner.threading[((64, 256),)] in ("split", "openblas")
    assert [site for site, _ in second.tuner.log] == ["threading"]
    for mode in ("split", "openblas"):
        second.tuner.threading[((64, 256),)] = mode
        _close(second.infer({"x": x})["y"], ref)


def test_choices_from_another_machine_are_timed_again():
    stored = {"machine": "another CPU | OpenBLAS Haswell | threads 2", "sites": {"c": {}}}
    assert tuning.Tuner(2, stored=stored).stored == {}
    mine = tuning.Tuner(2)
    assert tuning.Tuner(2, stored={**mine.export(), "sites": {"c": {"1x8 <f4 nchw": "a"}}}).stored
    broken = {**mine.export(), "sites": {"c": {"not a key": "a"}}}
    assert tuning.Tuner(2, stored=broken).stored == {}  # malformed: time again, not fail


def _counting(calls, name, fails=False):
    def run(x):
        calls[name] = calls.get(name, 0) + 1
        if fails:
            raise ValueError("cannot take this shape")
        return x + 1

    return run


def test_at_load_a_site_times_every_candidate_for_a_bounded_number_of_keys():
    tuner = tuning.Tuner(1)
    tuner.eager = True
    site = tuner.site("s")
    calls: dict[str, int] = {}
    candidates = {
        "broken": _counting(calls, "broken", fails=True),
        "slow": _counting(calls, "slow"),
        "fast": _counting(calls, "fast"),
    }
    for i in range(tuning.MAX_KEYS_PER_SITE + 10):
        assert site.run((i,), candidates, i) == i + 1
    assert len(site.choices) == tuning.MAX_KEYS_PER_SITE
    assert set(site.choices.values()) <= {"slow", "fast"}  # the failing one is dropped
    timed = tuning.MAX_KEYS_PER_SITE * (1 + tuning.TIMED_RUNS)  # each of both, for each key
    assert calls["slow"] + calls["fast"] == 2 * timed + 10  # + the first choice for 10 more
    before = sum(calls.values())
    site.run((0,), candidates, 0)  # a key it chose for: one call of the choice
    site.run((10**6,), candidates, 0)  # a new key past the bound: the first choice, untimed
    assert sum(calls.values()) == before + 2
    with pytest.raises(ValueError, match="cannot take"):
        tuning.Tuner(1).site("t").run((0,), {"a": candidates["broken"]} | {"b": _counting(
            calls, "b", fails=True)}, 0)  # fmt: skip


def test_on_requests_a_new_key_runs_one_candidate_per_request_until_decided():
    site = tuning.Tuner(1).site("s")  # not eager: a request's new key
    calls: dict[str, int] = {}
    candidates = {
        "broken": _counting(calls, "broken", fails=True),
        "a": _counting(calls, "a"),
        "b": _counting(calls, "b"),
    }
    for request in range(2 * tuning.EXPLORE_RUNS):
        assert site.run((7,), candidates, 1) == 2
        assert calls.get("a", 0) + calls.get("b", 0) == request + 1  # one run each request
    assert site.choices[(7,)] in ("a", "b")
    assert calls["a"] == calls["b"] == tuning.EXPLORE_RUNS
    assert calls["broken"] == 1  # tried once, dropped
    chosen = site.choices[(7,)]
    site.run((7,), candidates, 1)
    assert calls[chosen] == tuning.EXPLORE_RUNS + 1


@pytest.mark.parametrize("channel_last", [False, True])
def test_a_large_stem_pools_in_parts_in_either_layout(numpy_plugin, channel_last):
    """Conv -> Relu -> MaxPool fused (FusedConvPool) on a map large enough to be pooled by
    channel stretches on the request's threads, written NCHW or channel-last."""
    rng = np.random.default_rng(11)
    node, inits = _conv(rng, 3, 64, 7, strides=[2, 2], pads=[3, 3, 3, 3])
    node.output[0] = "c"
    nodes = [
        node,
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[3, 3],
                         strides=[2, 2], pads=[1, 1, 1, 1]),
    ]  # fmt: skip
    model = _model(nodes, ["N", 3, 224, 224], inits)
    net = numpy_plugin.load_network(model)
    net.tuner.channel_last = channel_last
    x = rng.standard_normal((2, 3, 224, 224)).astype(np.float32)
    ours = net.infer({"x": x})["y"]
    _close(ours, _ort(model, x))
