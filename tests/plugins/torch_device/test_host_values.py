"""Shape values held on the host (``plugins/torch/hostvalues.py``, review finding 17): a
network whose shapes are computed in the graph (Shape -> Gather -> Concat -> Reshape, as every
transformer the TorchScript exporter writes) reads nothing of the device on the host, so a
CUDA graph can capture it; and it computes what it did.

"Reads nothing of the device" is shown on torch's ``meta`` device, which holds no data: a
converted program run there fails on any ``.tolist()``/``.item()`` of a device tensor, and a
dispatch mode records every scalar read (``aten._local_scalar_dense``) and every copy between
the host and the device, either way (on CUDA each synchronises the stream, which a capture
cannot contain). The guard is shown not blind: a Reshape to a shape read from the data trips
it, and the load-time scan (``hostreads.host_reads``) lists that node.
"""

from __future__ import annotations

import numpy as np
import pytest
from models import shape_floats, shaped_encoder
from onnx import TensorProto, helper, numpy_helper

from plugserve.plugins.ir import load_model

torch = pytest.importorskip(
    "torch",
    reason="the TORCH device needs torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from plugserve.plugins.torch import hostvalues  # noqa: E402
from plugserve.plugins.torch.hostreads import host_reads  # noqa: E402
from plugserve.plugins.torch.ops import bounds  # noqa: E402
from plugserve.plugins.torch.ops.registry import held_dtype  # noqa: E402
from plugserve.plugins.torch.program import Program  # noqa: E402

META = torch.device("meta")
CPU = torch.device("cpu")


class _Syncs(TorchDispatchMode):
    """Records the ops that would synchronise a CUDA stream: a scalar read of a device tensor
    and a copy between the host and the device (the meta device standing for the card)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        kinds = {t.device.type for t in tensors}
        if func is torch.ops.aten._local_scalar_dense.default and "meta" in kinds:
            self.found.append("scalar read of a device tensor")
        elif func is torch.ops.aten._to_copy.default and tensors:
            target = kwargs.get("device")
            if target is not None and {tensors[0].device.type, torch.device(target).type} == {
                "cpu", "meta"}:  # fmt: skip
                self.found.append(f"copy {tensors[0].device.type} -> {torch.device(target).type}")
        elif (
            func is torch.ops.aten.copy_.default and len(tensors) == 2 and kinds == {"cpu", "meta"}
        ):
            self.found.append("copy_ between host and device")
        return func(*args, **kwargs)


def _on_meta(graph, feeds: dict[str, np.ndarray], monkeypatch) -> tuple[Program, list[str]]:
    """The program on the meta device over ``feeds``' shapes as a lane captures one: an eager
    warm-up run (it may copy the host values it moves: each once), then the run a capture
    records: what that one would have synchronised (a read the meta device cannot answer
    raises)."""
    monkeypatch.setattr(bounds, "FLAGGED", frozenset({"cuda", "meta"}))  # indices: flagged
    program = Program(graph, torch, META, torch.float32)
    tensors = [
        torch.empty(np.shape(feeds[s.name]), device=META,
                    dtype=held_dtype(torch, np.asarray(feeds[s.name]).dtype, torch.float32))
        for s in graph.inputs
    ]  # fmt: skip
    with bounds.active(bounds.BoundsFlag(torch, META)), _Syncs() as warm:
        program.compute_tensors(tensors)
    assert len(warm.found) <= len(program.plan.to_device), warm.found  # copies of moved values
    assert all(w.startswith("copy cpu") for w in warm.found), warm.found
    monkeypatch.setattr(hostvalues, "capturing", lambda torch, device: True)
    with bounds.active(bounds.BoundsFlag(torch, META)), _Syncs() as syncs:
        outputs = program.compute_tensors(tensors)
    monkeypatch.setattr(hostvalues, "capturing", lambda torch, device: False)
    assert all(o.device == META for o in outputs), [o.device for o in outputs]
    return program, syncs.found


IDS = np.array([[3, 4, 0, 0, 0], [1, 2, 3, 4, 5]], np.int64)


def test_a_shape_chain_reads_nothing_of_the_device(monkeypatch):
    graph = load_model(shaped_encoder())
    # with every value on the device (as before this change) these nodes read it on the host
    before = host_reads(graph, frozenset())
    assert [r.split(" ")[0] for r in before] == [
        "position_ids", "position_batch", "b_u", "s_u", "q_split", "k_split", "v_split",
        "keep_u", "ones", "keep_expanded", "merge_heads"]  # fmt: skip
    program, syncs = _on_meta(graph, {"ids": IDS}, monkeypatch)
    assert program.host_reads == [] and syncs == []
    plan = program.plan
    hosted = {graph.nodes[i].name for i in plan.nodes}
    # the shape arithmetic and the exporter's Expand pattern on the host; the position ids'
    # Range feeds an embedding's Gather: on the device (its bounds read on the host)
    assert {
        "ids_shape",
        "split_shape",
        "merge_shape",
        "head_dim",
        "root",
        "ones",
        "expand_to",
    } <= hosted
    assert not hosted & {"position_ids", "keep_expanded", "token_embedding", "q_split"}
    assert plan.to_device == {"root"}  # the Sqrt of the head size divides the scores


def test_a_shape_read_from_the_data_still_reads_and_is_listed(monkeypatch):
    graph = load_model(helper.make_model(helper.make_graph(
        [helper.make_node("Cast", ["n"], ["dims"], name="dims", to=TensorProto.INT64),
         helper.make_node("Reshape", ["x", "dims"], ["y"], name="data_shape")],
        "data_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
         helper.make_tensor_value_info("n", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
    ), opset_imports=[helper.make_opsetid("", 17)]))  # fmt: skip
    assert host_reads(graph, hostvalues.plan(graph).host) == ["data_shape (Reshape)"]
    with pytest.raises(Exception, match="meta"):  # .tolist() of a device tensor
        _on_meta(graph, {"x": np.zeros(6, np.float32), "n": np.zeros(2, np.float32)},
                 monkeypatch)  # fmt: skip


def test_the_values_are_unchanged(core):
    """TORCH (with its graph cache's CPU twin) and HETERO:TORCH,NUMPY give NUMPY's answers
    for shapes seen again and again."""
    model = shaped_encoder()
    numpy = core.load_network(model, "NUMPY")
    torch_net = core.load_network(model, "TORCH", {"CUDA_GRAPHS": "4"})
    hetero = core.load_network(model, "HETERO:TORCH,NUMPY")
    request = torch_net.create_infer_request()
    rng = np.random.default_rng(3)
    for batch, seq in [(2, 5), (1, 7), (2, 5), (2, 5), (1, 7)]:
        ids = rng.integers(0, 50, (batch, seq)).astype(np.int64)
        ids[0, -2:] = 0  # padding, masked
        want = numpy.infer({"ids": ids})["y"]
        np.testing.assert_allclose(request.infer({"ids": ids})["y"], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(hetero.infer({"ids": ids})["y"], want, rtol=1e-5, atol=1e-5)
    assert torch_net.graph_statistics()["replayed"] > 0


def test_moves_to_the_device_by_fills_keep_every_value(monkeypatch):
    """The fill path (what CUDA and meta take) gives back the value itself, -0.0 and NaN
    included; a program whose moves take it on the CPU computes what NUMPY does."""
    for value in (torch.tensor(2.5), torch.tensor([3, 3, 3]), torch.tensor([[1, -2], [7, 0]]),
                  torch.tensor([0.0, -0.0, float("nan"), 1.5]), torch.tensor([True, False]),
                  torch.tensor([1.5, 2.0], dtype=torch.bfloat16), torch.zeros((0, 2))):  # fmt: skip
        moved = hostvalues.filled(torch, value, CPU)
        assert moved.dtype == value.dtype and moved.shape == value.shape
        assert torch.equal(moved.view(-1).to(torch.float64).isnan(),
                           value.view(-1).to(torch.float64).isnan())  # fmt: skip
        same = moved.view(-1).to(torch.float64), value.view(-1).to(torch.float64)
        assert all(str(a) == str(b) for a, b in zip(same[0].tolist(), same[1].tolist()))
    move = hostvalues.to_device(torch, META)
    with _Syncs() as syncs:  # outside a capture: filled once (no copy), then the kept copy
        first = move(torch.tensor([2, 3]))
        assert move(torch.tensor([2, 3])) is first and move(torch.tensor([3, 2])) is not first
        large = move(torch.arange(hostvalues.FILLS + 1))  # past FILLS: copied (pinned on CUDA)
    assert syncs.found == ["copy cpu -> meta"]  # (the guard sees copies)
    monkeypatch.setattr(hostvalues, "capturing", lambda torch, device: True)
    with _Syncs() as syncs:  # in a capture, a value not seen: filled, or past FILLS refused
        move(torch.arange(hostvalues.FILLS))
        with pytest.raises(RuntimeError, match="before the capture"):
            move(torch.arange(hostvalues.FILLS + 1) * 2)
        assert move(torch.tensor([2, 3])) is first  # kept
        assert move(torch.arange(hostvalues.FILLS + 1)) is large
    assert syncs.found == []
    monkeypatch.undo()
    monkeypatch.setattr(
        hostvalues, "to_device", lambda torch, device: lambda v: hostvalues.filled(torch, v, device)
    )
    graph = load_model(shaped_encoder())
    program = Program(graph, torch, CPU, torch.float32)
    got = program.run([IDS])[0]
    model = shaped_encoder()
    from plugserve.server import Core

    want = Core().load_network(model, "NUMPY").infer({"ids": IDS})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_shape_arithmetic_over_constants_is_computed_once_at_load(monkeypatch):
    """Nodes whose inputs are all small constants (Unsqueeze of a constant, a ConstantOfShape
    of a constant shape) are computed at load: constants for the steps after them, nothing to
    move per request."""
    n = helper.make_node
    init = numpy_helper.from_array
    graph = load_model(helper.make_model(helper.make_graph(
        [n("Unsqueeze", ["four", "axes"], ["four_u"], name="four_u"),
         n("Shape", ["x"], ["xs"], name="xs"),
         n("Slice", ["xs", "start", "stop"], ["lead"], name="lead"),
         n("Concat", ["lead", "four_u", "minus1"], ["shape"], name="shape", axis=0),
         n("Reshape", ["x", "shape"], ["r"], name="reshape"),
         n("ConstantOfShape", ["bias_shape"], ["bias"], name="bias",
           value=init(np.array([0.5], np.float32))),
         n("Add", ["r", "bias"], ["y"], name="add")],
        "folding",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 2])],
        [init(np.array(4, np.int64), "four"), init(np.array([0], np.int64), "axes"),
         init(np.array([0], np.int64), "start"), init(np.array([1], np.int64), "stop"),
         init(np.array([-1], np.int64), "minus1"), init(np.array([4, 2], np.int64), "bias_shape")],
    ), opset_imports=[helper.make_opsetid("", 17)]))  # fmt: skip
    x = np.arange(24, dtype=np.float32).reshape(3, 8)
    program, syncs = _on_meta(graph, {"x": x}, monkeypatch)
    assert program.host_reads == [] and syncs == []
    assert [graph.nodes[i].name for i in program.plan.folded] == ["four_u", "bias"]
    assert not program.plan.to_device  # the folded bias is a device constant already
    got = Program(graph, torch, CPU, torch.float32).run([x])[0]
    np.testing.assert_array_equal(got, x.reshape(3, 4, 2) + np.float32(0.5))


#: real exporters' models (tests/zoo) that read on the host with every value on the device
#: (each was run eagerly on the GPU: never captured) and now read nothing of it there
CAPTURABLE = [
    "bert_script", "bert_dynamo", "bert_int8_qdq", "bert_fp16_io", "vit_script", "vit_dynamo",
    "vit_int8_qdq", "vit_fp16", "whisper_encoder_script", "whisper_encoder_dynamo",
    "t5_encoder_script", "t5_encoder_dynamo", "wav2vec2_script", "gpt2_past_script",
    "llama_past_dynamo", "lstm_script", "lstm_state_dynamo", "gru_script", "gru_state_script",
    "minilm_int8", "resnet_dynamo", "bert_int8_dynamic", "wav2vec2_int8_dynamic",
    "gpt2_past_dynamo", "gpt2_past_int8_dynamic", "llama_past_script", "llama_past_opset23",
    "llama_past_int8_dynamic", "lstm_dynamo", "gru_dynamo", "lstm_state_script",
    "gru_state_dynamo", "wav2vec2_dynamo", "vit_fp16_io", "whisper_encoder_fp16",
    "whisper_encoder_fp16_io", "yolo_script", "yolo_dynamo", "crnn_ocr_script", "crnn_ocr_dynamo",
]  # fmt: skip


#: every value on the device, as before this change
_DEVICE_ONLY = hostvalues.HostPlan(frozenset(), (), frozenset(), frozenset(), frozenset(),
                                   frozenset())  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", CAPTURABLE)
def test_real_models_read_nothing_of_the_device_and_answer_as_before(core, name, monkeypatch):
    """Each reads on the host with every value on the device, and reads nothing of it now;
    its outputs equal, bit for bit, the program's with every value on the device; TORCH (its
    graph cache's CPU twin, a shape replayed) and HETERO:TORCH,NUMPY agree with onnxruntime
    within the model's tolerance (the fused-int8 exports round as onnxruntime's optimizer
    does, on every device: tests/zoo judges them; here they are held to the program before)."""
    from reference import ort_outputs
    from zoo import load_all

    model = load_all()[name]
    path = str(model.path())
    graph = load_model(path)
    assert host_reads(graph, frozenset()), "this model read nothing on the host before"
    feeds = model.feeds(np.random.default_rng(0))
    program, syncs = _on_meta(graph, feeds, monkeypatch)
    assert program.host_reads == [] and syncs == [], (program.host_reads, syncs)
    monkeypatch.undo()
    now = Program(graph, torch, CPU, torch.float32).run([feeds[s.name] for s in graph.inputs])
    monkeypatch.setattr(hostvalues, "plan", lambda graph, unfolded=frozenset(): _DEVICE_ONLY)
    before = Program(graph, torch, CPU, torch.float32)
    assert before.host_reads  # the scan with nothing on the host: what made it eager
    for got, want in zip(now, before.run([feeds[s.name] for s in graph.inputs])):
        np.testing.assert_array_equal(got, want)
    monkeypatch.undo()
    if model.fused_int8:
        return
    want = ort_outputs(model, feeds)
    request = core.load_network(path, "TORCH", {"CUDA_GRAPHS": "2"}).create_infer_request()
    hetero = core.load_network(path, "HETERO:TORCH,NUMPY")
    for got in [request.infer(feeds) for _ in range(3)] + [hetero.infer(feeds)]:
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=model.rtol, atol=model.atol,
                                       err_msg=f"{name} {key}")  # fmt: skip


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
def test_pad_by_index_makes_its_positions_on_the_device(mode, monkeypatch):
    """Pad's reflect, edge and wrap modes pick source positions: made on the device, not
    copied from the host (which synchronised, so such a network was never captured)."""
    graph = load_model(helper.make_model(helper.make_graph(
        [helper.make_node("Pad", ["x", "pads"], ["y"], name="pad", mode=mode)],
        "pad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 9])],
        [numpy_helper.from_array(np.array([0, 3, 0, 1], np.int64), "pads")],
    ), opset_imports=[helper.make_opsetid("", 17)]))  # fmt: skip
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    program, syncs = _on_meta(graph, {"x": x}, monkeypatch)
    assert program.host_reads == [] and syncs == []
    got = Program(graph, torch, CPU, torch.float32).run([x])[0]
    np.testing.assert_array_equal(got, np.pad(x, ((0, 0), (3, 1)), mode=mode))


def test_a_shape_the_graph_outputs_is_moved_to_the_device(core, monkeypatch):
    n = helper.make_node
    model = helper.make_model(helper.make_graph(
        [n("Shape", ["x"], ["s"], name="shape"),
         n("Concat", ["s", "tail"], ["dims"], name="dims", axis=0),
         n("Relu", ["x"], ["y"], name="relu")],
        "outputs_a_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b"])],
        [helper.make_tensor_value_info("dims", TensorProto.INT64, [3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
        [numpy_helper.from_array(np.array([7], np.int64), "tail")],
    ), opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip
    program, syncs = _on_meta(load_model(model), {"x": np.zeros((2, 3), np.float32)},
                              monkeypatch)  # fmt: skip
    assert syncs == [] and program.plan.to_device == {"dims"}
    monkeypatch.undo()
    request = core.load_network(model, "TORCH", {"CUDA_GRAPHS": "2"}).create_infer_request()
    for _ in range(3):
        np.testing.assert_array_equal(request.infer({"x": np.ones((4, 5), np.float32)})["dims"],
                                      [4, 5, 7])  # fmt: skip


def _masked(dims: list[int], name: str) -> object:
    """y = x + ConstantOfShape(dims): the mask's shape is a constant (folded at load when
    small)."""
    return helper.make_model(helper.make_graph(
        [helper.make_node("ConstantOfShape", ["dims"], ["mask"], name="mask",
                          value=numpy_helper.from_array(np.array([0.5], np.float32))),
         helper.make_node("Add", ["x", "mask"], ["y"], name="add")],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
        [numpy_helper.from_array(np.array(dims, np.int64), "dims")],
    ), opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip


def test_a_large_sized_node_is_not_folded_but_runs_per_request():
    """Review2 finding 3: a ConstantOfShape of constant dims is folded at load (held on the
    device for the program's life, charged in ``device_nbytes``) only up to FOLDED_ELEMENTS;
    a [1, 1, 512, 512] mask is a step of each request, and its values are unchanged."""
    small = Program(load_model(_masked([4, 4], "small")), torch, CPU, torch.float32)
    assert small.plan.folded == (0,)
    assert [what for *_, what, _ in small.steps] == ["add (Add)"]
    on_meta = Program(load_model(_masked([4, 4], "small")), torch, META, torch.float32)
    assert on_meta.device_nbytes == 16 * 4  # the folded mask's device copy (no value moved)
    dims = [1, 1, 512, 512]
    assert np.prod(dims) > hostvalues.FOLDED_ELEMENTS
    big = Program(load_model(_masked(dims, "big")), torch, CPU, torch.float32)
    assert big.plan.folded == () and not big.plan.nodes
    assert [what for *_, what, _ in big.steps] == ["mask (ConstantOfShape)", "add (Add)"]
    assert all(t is None or t.numel() < 100 for t in big.template)  # no mask held
    x = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    np.testing.assert_array_equal(big.run([x])[0], x + np.float32(0.5))
    np.testing.assert_array_equal(small.run([x[0, 0, :4, :4]])[0], x[0, 0, :4, :4] + 0.5)
    big_meta = Program(load_model(_masked(dims, "big")), torch, META, torch.float32)
    assert big_meta.device_nbytes == 0
    moving = Program(load_model(shaped_encoder()), torch, META, torch.float32)  # moves "root"
    assert moving.device_nbytes >= hostvalues.KEPT_BYTES  # the kept copies' bound, charged


def test_moves_keeps_within_its_bounds_and_never_evicts():
    """Review2 finding 1's bound: kept copies stop at ``kept`` values and ``kept_bytes`` (each
    counted as an allocator block of 512 bytes); a kept value is the same copy at every hit
    (a live graph reads it), and nothing kept is dropped to make room."""
    moves = hostvalues.Moves(torch, META, kept=3, kept_bytes=1 << 20)
    first = moves(torch.tensor([1, 2], dtype=torch.int64))
    assert first.device == META and first.shape == (2,)
    for i in range(10):
        moves(torch.tensor([i, 100], dtype=torch.int64))
    assert len(moves) == 3 and moves.nbytes == 3 * hostvalues.BLOCK
    assert moves(torch.tensor([1, 2], dtype=torch.int64)) is first  # kept, not evicted
    assert moves(torch.tensor([9, 100], dtype=torch.int64)) is not moves(
        torch.tensor([9, 100], dtype=torch.int64)
    )  # past the bound: copied each time
    by_bytes = hostvalues.Moves(torch, META, kept=100, kept_bytes=3 * hostvalues.BLOCK)
    for n in range(1, 10):
        by_bytes(torch.arange(n * 100, dtype=torch.int64))  # 800 bytes and more: 2 blocks+
    assert len(by_bytes) == 1 and by_bytes.nbytes == 2 * hostvalues.BLOCK
    large = torch.arange(hostvalues.KEPT_ELEMENTS + 1)
    assert by_bytes(large).shape == large.shape and len(by_bytes) == 1  # too large: not kept


def test_inside_a_capture_a_large_value_not_moved_is_refused_before_any_copy(monkeypatch):
    """Review2 finding 2: inside a capture, a value over FILLS elements with no kept copy
    raises RuntimeError before anything reaches the device (a copy from the host would
    invalidate the capture); a small one is filled, a kept one is its copy."""
    moves = hostvalues.Moves(torch, META)
    kept_value = torch.arange(hostvalues.FILLS + 1)
    kept = moves(kept_value)  # the warm-up, outside the capture
    monkeypatch.setattr(hostvalues, "capturing", lambda torch, device: True)
    with _Syncs() as syncs:
        with pytest.raises(RuntimeError, match="not moved to the device before the capture"):
            moves(torch.arange(hostvalues.FILLS + 1) + 1)
        assert moves(kept_value.clone()) is kept
        small = moves(torch.arange(hostvalues.FILLS))
    assert syncs.found == [] and small.shape == (hostvalues.FILLS,) and small.device == META
    assert len(moves) == 1  # nothing kept inside the capture
    with pytest.raises(RuntimeError, match="this shape runs eagerly"):
        hostvalues.refuse_in_capture(torch.zeros(100))


def test_a_sized_nodes_output_is_counted_before_it_is_computed():
    """The folding bound is judged from the inputs, before a sized node allocates: a 180-byte
    model asking for a [65536, 65536] mask costs the load nothing."""
    t = torch.tensor
    count = hostvalues.sized_elements
    assert count("ConstantOfShape", [t([65536, 65536])]) == 1 << 32
    assert count("Expand", [torch.zeros(3, 1), t([2, 1, 5])]) == 30
    assert count("Tile", [torch.zeros(2, 3), t([4, 5])]) == 120
    assert count("Range", [t(0), t(10), t(3)]) == 4 and count("Range", [t(5), t(0), t(1)]) == 0
    assert count("Range", [t(0), t(1), t(0)]) is None  # its step says why
    assert count("Add", [t(1), t(2)]) is None
    graph = load_model(_masked([65536, 65536], "huge"))
    program = Program(graph, torch, META, torch.float32)  # folded, it would take 16 GiB
    assert program.plan.folded == () and program.device_nbytes == 0


@pytest.mark.parametrize("hint", ["f16", "bf16"])
def test_float_shape_arithmetic_keeps_f32_at_a_reduced_precision(core, hint, monkeypatch):
    """Issue 49: at f16/bf16 a shape cast to FLOAT is computed on the host in float32, the type
    the graph names (the host costs nothing), so sizes made from it are exact above 2,048
    (f16: 3,001 was 3,000, and ``ceil(3001 * 0.5)`` 1,500) and 256 (bf16: 3,008, so 1,504);
    a float the graph outputs is rounded to the device's precision once, at its move to the
    device, as every output computed there is (``3001 / 7`` in f16 is 428.75, where 3,000 / 7
    computed in f16 gave 428.5; bf16: 428, where 3,008 / 7 gave 430)."""
    model = shape_floats()
    x = np.zeros((1, 3001), np.float32)
    numpy = core.load_network(model, "NUMPY").infer({"x": x})
    assert numpy["zeros"].shape == (1501,)
    for config in ({}, {"CUDA_GRAPHS": "2"}):
        net = core.load_network(model, "TORCH", {"INFERENCE_PRECISION_HINT": hint, **config})
        got = net.infer({"x": x})
        assert got["zeros"].shape == (1501,) and got["zeros"].dtype == np.int64
        rounded = np.float32(3001 / 7).astype(np.float16 if hint == "f16" else np.float32)
        if hint == "bf16":
            rounded = np.float32(428.0)
        assert got["ratio"].dtype == np.float32
        np.testing.assert_array_equal(got["ratio"], [np.float32(rounded)])
        assert got["ramp"].shape == (1, 3001)  # 3,000 (f16) or 3,008 (bf16) positions before
        np.testing.assert_allclose(got["ramp"], numpy["ramp"], rtol=1e-2)
    # and where the host value is moved to the device, it is held in the device's precision
    graph = load_model(model)
    monkeypatch.setattr(bounds, "FLAGGED", frozenset({"cuda", "meta"}))
    compute = torch.float16 if hint == "f16" else torch.bfloat16
    program = Program(graph, torch, META, compute)
    out = program.compute_tensors([torch.empty((1, 3001), device=META, dtype=compute)])
    assert [o.dtype for o in out] == [torch.int64, compute, compute]
    assert [o.device for o in out] == [META, META, META]
    assert out[2].shape == (1, 3001)
