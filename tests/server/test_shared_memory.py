"""Triton's system shared memory extension, driven by tritonclient's own shared memory utilities
over gRPC and HTTP against a real server: numbers and strings, offsets, status, unregistering
(one, all, during use), and what a hostile client may not do."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

shm = pytest.importorskip(
    "tritonclient.utils.shared_memory", reason="pip install 'tritonclient[grpc,http]'"
)
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import (  # noqa: E402
    InferenceServerException,
    serialize_byte_tensor,
    serialized_byte_size,
)

PROTOCOLS = ["grpc", "http"]


@pytest.fixture(params=PROTOCOLS)
def connected(request, server):
    """``(client module, client, protocol)`` for each protocol; every region the test
    registered is unregistered afterwards."""
    protocol = request.param
    if protocol == "grpc":
        module, client = grpcclient, grpcclient.InferenceServerClient(server.target)
    else:
        module, client = httpclient, httpclient.InferenceServerClient(server.http_target)
    yield module, client, protocol
    client.unregister_system_shared_memory()
    client.close()


def test_inputs_and_outputs_in_shared_memory_with_offsets(connected, regions):
    module, client, protocol = connected
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 0.5, dtype=np.float32)
    in_name, in_key, in_handle = regions(256)
    out_name, out_key, out_handle = regions(128)
    shm.set_shared_memory_region(in_handle, [a])
    shm.set_shared_memory_region(in_handle, [b], offset=128)  # b at an offset in the same region
    client.register_system_shared_memory(in_name, in_key, 256)
    client.register_system_shared_memory(out_name, out_key, 128)
    status = client.get_system_shared_memory_status()
    assert {in_name, out_name} <= set(_names(status))
    inputs = [module.InferInput("a", [16], "FP32"), module.InferInput("b", [16], "FP32")]
    inputs[0].set_shared_memory(in_name, 64)
    inputs[1].set_shared_memory(in_name, 64, offset=128)
    output = module.InferRequestedOutput("sum")
    output.set_shared_memory(out_name, 64, offset=32)
    result = client.infer("add", inputs, outputs=[output])
    got = shm.get_contents_as_numpy(out_handle, np.float32, [16], offset=32)
    np.testing.assert_array_equal(got, a + b)
    described = result.get_output("sum")
    if protocol == "http":  # described only, as Triton does
        assert described == {"name": "sum", "datatype": "FP32", "shape": [16]}
    else:
        assert described.parameters["shared_memory_region"].string_param == out_name
        assert not result.get_response().raw_output_contents[0]


def _names(status):
    if isinstance(status, list):  # HTTP: a list of regions
        return [r["name"] for r in status]
    return list(status.regions)  # gRPC: a map by name


def test_strings_in_shared_memory(connected, regions):
    module, client, _ = connected
    text = np.array([b"hello", b"\xff\x00\x80", b""], dtype=np.object_)
    serialized = serialize_byte_tensor(text)  # as Triton's simple_*_shm_string_client
    size = serialized_byte_size(serialized)
    in_name, in_key, in_handle = regions(size)
    out_name, out_key, out_handle = regions(size)
    shm.set_shared_memory_region(in_handle, [serialized])
    client.register_system_shared_memory(in_name, in_key, size)
    client.register_system_shared_memory(out_name, out_key, size)
    tensor = module.InferInput("text", [3], "BYTES")
    tensor.set_shared_memory(in_name, size)
    output = module.InferRequestedOutput("echo")
    output.set_shared_memory(out_name, size)
    client.infer("echo", [tensor], outputs=[output])
    got = shm.get_contents_as_numpy(out_handle, np.object_, [3])
    assert got.tolist() == text.tolist()


def test_status_and_unregister_one_then_all(connected, regions):
    _, client, _ = connected
    made = [regions(64) for _ in range(3)]
    for name, key, _ in made:
        client.register_system_shared_memory(name, key, 64, offset=0)
    one = client.get_system_shared_memory_status(region_name=made[0][0])
    assert _names(one) == [made[0][0]]
    client.unregister_system_shared_memory(made[0][0])
    assert set(_names(client.get_system_shared_memory_status())) >= {m[0] for m in made[1:]}
    assert made[0][0] not in _names(client.get_system_shared_memory_status())
    with pytest.raises(InferenceServerException, match="Unable to find"):
        client.get_system_shared_memory_status(region_name=made[0][0])
    client.unregister_system_shared_memory()
    assert not {m[0] for m in made} & set(_names(client.get_system_shared_memory_status()))


def test_hostile_keys_offsets_and_sizes_are_refused_clearly(connected, regions):
    module, client, _ = connected
    name, key, _ = regions(64)
    outside = shm.create_shared_memory_region("outside", f"/not-ours-{uuid.uuid4().hex}", 64)
    try:
        cases = [
            (("outside", shm_key(outside), 64), "start the server with --shared-memory-prefix"),
            ((name, "/plugserve/../../etc/passwd", 64), "expected '/' and then"),
            ((name, key, 65), "past the end"),  # bigger than the object
            ((name, key + "-missing", 64), "no shared memory object"),
        ]
        for (region, region_key, size), message in cases:
            with pytest.raises(InferenceServerException, match=message):
                client.register_system_shared_memory(region, region_key, size)
        with pytest.raises(InferenceServerException, match="past the end"):
            client.register_system_shared_memory(name, key, 32, offset=40)
        client.register_system_shared_memory(name, key, 64)
        with pytest.raises(InferenceServerException, match="already registered"):
            client.register_system_shared_memory(name, key, 64)
        a = module.InferInput("a", [16], "FP32")
        a.set_shared_memory(name, 64, offset=16)  # 16 + 64 > 64
        b = module.InferInput("b", [16], "FP32")
        b.set_shared_memory(name, 64)
        with pytest.raises(InferenceServerException, match="do not lie within"):
            client.infer("add", [a, b])
        a = module.InferInput("a", [16], "FP32")  # tritonclient keeps an old offset
        a.set_shared_memory("never-registered", 64)
        with pytest.raises(InferenceServerException, match="is not registered"):
            client.infer("add", [a, b])
        a = module.InferInput("a", [16], "FP32")
        a.set_shared_memory(name, 64)
        out = module.InferRequestedOutput("sum")
        out.set_shared_memory(name, 8)  # too small for 64 bytes
        with pytest.raises(InferenceServerException, match="too small"):
            client.infer("add", [a, b], outputs=[out])
        assert client.is_server_live()  # and it still serves
    finally:
        shm.destroy_shared_memory_region(outside)


def shm_key(handle) -> str:
    return handle._shm_key if hasattr(handle, "_shm_key") else handle.shm_key


def test_cuda_shared_memory_answers_as_triton_without_gpus(connected, regions):
    """Triton's shared memory example clients (simple_grpc_shm_client.py and its kin) begin by
    unregistering every CUDA region and reading the CUDA status; a Triton built without GPU
    support answers both with success and nothing registered, and refuses only a registration.
    Then the example goes on to system shared memory, as here."""
    module, client, protocol = connected
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("never-registered")
    status = client.get_cuda_shared_memory_status()
    assert (status == []) if protocol == "http" else not status.regions
    with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory"):
        client.get_cuda_shared_memory_status("never-registered")
    with pytest.raises(
        InferenceServerException,
        match="failed to register CUDA shared memory region: 'gpu0', GPUs not supported",
    ) as refused:
        client.register_cuda_shared_memory("gpu0", b"\0" * 64, 0, 64)
    assert "use system shared memory" in refused.value.message()  # and why: no CUDA here
    status = str(refused.value.status())
    assert ("INVALID_ARGUMENT" in status) if protocol == "grpc" else status == "400", status
    name, key, handle = regions(128)  # the example's next step: system shared memory
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.float32)])
    shm.set_shared_memory_region(handle, [np.ones(16, dtype=np.float32)], offset=64)
    client.register_system_shared_memory(name, key, 128)
    a = module.InferInput("a", [16], "FP32")
    a.set_shared_memory(name, 64)
    b = module.InferInput("b", [16], "FP32")
    b.set_shared_memory(name, 64, offset=64)
    got = client.infer("add", [a, b]).as_numpy("sum")
    np.testing.assert_array_equal(got, np.arange(16, dtype=np.float32) + 1)


def test_the_extension_can_be_turned_off(tmp_path):
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path / "repo")
    with RunningServer("--model-repository", str(repo), "--shared-memory", "off") as running:
        client = grpcclient.InferenceServerClient(running.target)
        try:
            with pytest.raises(InferenceServerException, match="shared memory is off"):
                client.register_system_shared_memory("x", "/plugserve-x", 64)
        finally:
            client.close()


def test_regions_count_against_the_memory_budget(tmp_path, regions):
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path / "repo")
    name, key, _ = regions(2 << 20)
    with RunningServer(
        "--model-repository", str(repo), "--max-inflight-bytes", str(1 << 20)
    ) as running:
        client = grpcclient.InferenceServerClient(running.target)
        try:
            with pytest.raises(InferenceServerException, match="max-inflight-bytes") as refused:
                client.register_system_shared_memory(name, key, 2 << 20)
            assert "RESOURCE_EXHAUSTED" in str(refused.value)
            client.register_system_shared_memory(name, key, 1 << 19)  # half of it fits
            client.unregister_system_shared_memory(name)
        finally:
            client.close()


def test_regions_unregistered_during_a_run_stay_mapped_for_it(tmp_path, regions):
    """A slow request (a Loop of M additions on NUMPY) reads its input from a region and
    writes its output into another, and another client unregisters both while it runs: it
    still reads the data it was given and writes its answer where it was asked to."""
    import threading

    import onnx
    from models import spin_loop
    from serving import RunningServer, wait_for
    from test_server_load import busy_streams

    model = tmp_path / "spin.onnx"
    onnx.save(spin_loop(), model)
    name, key, handle = regions(16)
    out_name, out_key, out_handle = regions(16)
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    shm.set_shared_memory_region(handle, [x])
    (tmp_path / "empty").mkdir()
    with RunningServer("--model-repository", str(tmp_path / "empty")) as running:
        from plugserve.client import Client

        with Client(running.target, timeout=120) as control:
            control.load("spin", model.read_bytes(), "NUMPY")
        client = grpcclient.InferenceServerClient(running.target)
        other = grpcclient.InferenceServerClient(running.target)
        try:
            client.register_system_shared_memory(name, key, 16)
            client.register_system_shared_memory(out_name, out_key, 16)
            tensor = grpcclient.InferInput("x", [4], "FP32")
            tensor.set_shared_memory(name, 16)
            trips = grpcclient.InferInput("M", [], "INT64")
            trips.set_data_from_numpy(np.array(200_000, np.int64))
            result = {}

            output = grpcclient.InferRequestedOutput("y")
            output.set_shared_memory(out_name, 16)

            def run():
                result["answer"] = client.infer("spin", [tensor, trips], outputs=[output])

            worker = threading.Thread(target=run)
            worker.start()
            # the run has started (and read the region at its admission)
            assert wait_for(lambda: busy_streams(running, "NUMPY")), "it did not start"
            other.unregister_system_shared_memory()  # every region, both in use
            assert not _names(other.get_system_shared_memory_status())
            worker.join(120)
            assert "answer" in result
            y = shm.get_contents_as_numpy(out_handle, np.float32, [4])
            np.testing.assert_allclose(y, x * 200_000, rtol=1e-4)
        finally:
            client.close()
            other.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_regions_belong_to_the_tenant_that_registered_them(tmp_path, regions, protocol):
    """With tokens a region is its tenant's: an infer token of the tenant whose admin token
    registered it reads from and writes to it; another tenant's infer token does not see it
    in the status, cannot name it as an input (it read the data back through an Identity-like
    model) nor as an output (it overwrote the data), and may register a region of the same
    name; unregistering every region unregisters only the caller's tenant's."""
    from serving import RunningServer, examples_repository

    tokens = {who: uuid.uuid4().hex for who in ("admin_a", "infer_a", "admin_b", "infer_b")}
    token_file = tmp_path / "tokens"
    token_file.write_text(
        "".join(f"{t} {who.split('_')[0]} tenant={who[-1]}\n" for who, t in tokens.items())
    )
    token_file.chmod(0o600)
    module = grpcclient if protocol == "grpc" else httpclient
    a = np.arange(16, dtype=np.float32)
    secret_name, secret_key, secret = regions(128)
    shm.set_shared_memory_region(secret, [a, a])
    out_name, out_key, out = regions(64)
    repo = examples_repository(tmp_path / "repo")
    with RunningServer("--model-repository", str(repo), "--auth-tokens", str(token_file)) as s:
        client = module.InferenceServerClient(s.target if protocol == "grpc" else s.http_target)

        def as_(who):
            return {"authorization": f"Bearer {tokens[who]}"}

        def add(who, source, target=None):
            inputs = [module.InferInput("a", [16], "FP32"), module.InferInput("b", [16], "FP32")]
            inputs[0].set_shared_memory(source, 64)
            inputs[1].set_shared_memory(source, 64, offset=64)
            output = module.InferRequestedOutput("sum")
            if target is not None:
                output.set_shared_memory(target, 64)
            return client.infer("add", inputs, outputs=[output], headers=as_(who))

        try:
            client.register_system_shared_memory(
                secret_name, secret_key, 128, headers=as_("admin_a")
            )
            client.register_system_shared_memory(out_name, out_key, 64, headers=as_("admin_a"))
            add("infer_a", secret_name, out_name)  # its own tenant's: served
            np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [16]), a + a)

            seen = client.get_system_shared_memory_status(headers=as_("infer_b"))
            assert _names(seen) == [], seen
            with pytest.raises(InferenceServerException, match="Unable to find"):
                client.get_system_shared_memory_status(
                    region_name=secret_name, headers=as_("infer_b")
                )
            with pytest.raises(InferenceServerException, match="is not registered") as read:
                add("infer_b", secret_name)
            assert "400" in str(read.value) or "INVALID_ARGUMENT" in str(read.value)
            with pytest.raises(InferenceServerException, match="is not registered"):
                plain = [module.InferInput("a", [16], "FP32"), module.InferInput("b", [16], "FP32")]
                for tensor in plain:
                    tensor.set_data_from_numpy(np.zeros(16, np.float32))
                output = module.InferRequestedOutput("sum")
                output.set_shared_memory(out_name, 64)
                client.infer("add", plain, outputs=[output], headers=as_("infer_b"))
            np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [16]), a + a)

            # nor may b register a's object under a name of its own (then read it as its own)
            with pytest.raises(InferenceServerException, match="another tenant's"):
                client.register_system_shared_memory(
                    "mine", secret_key, 128, headers=as_("admin_b")
                )
            # the same name in tenant b is a region of its own; b's "unregister all" is b's
            _, b_key, b_region = regions(128)
            shm.set_shared_memory_region(b_region, [np.ones(32, np.float32)])
            client.register_system_shared_memory(secret_name, b_key, 128, headers=as_("admin_b"))
            got = add("infer_b", secret_name).as_numpy("sum")
            np.testing.assert_array_equal(got, np.full(16, 2.0, np.float32))
            client.unregister_system_shared_memory(headers=as_("admin_b"))
            assert _names(client.get_system_shared_memory_status(headers=as_("infer_b"))) == []
            mine = client.get_system_shared_memory_status(headers=as_("infer_a"))
            assert set(_names(mine)) == {secret_name, out_name}, mine
            add("infer_a", secret_name, out_name)
        finally:
            client.unregister_system_shared_memory(headers=as_("admin_a"))
            client.close()


def test_a_tenant_prefix_gives_each_tenant_keys_of_its_own(tmp_path):
    """``--shared-memory-prefix /plugserve-test-{tenant}-``: tenant b's admin cannot register
    a key of tenant a's prefix, before a does or after. Without it the first tenant to
    register a key held its object: a red team's admin of tenant b registered the key a's
    client had made (the server opens it, not the client, so its 0600 mode did not matter)
    and read a's bytes through b's infer token."""
    from serving import RunningServer, examples_repository

    tokens = {"admin_a": uuid.uuid4().hex, "admin_b": uuid.uuid4().hex}
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{t} admin tenant={w[-1]}\n" for w, t in tokens.items()))
    token_file.chmod(0o600)
    key = f"/plugserve-test-a-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region("secret", key, 64)
    repo = examples_repository(tmp_path / "repo")
    args = ["--model-repository", str(repo), "--auth-tokens", str(token_file)]
    try:
        with RunningServer(*args, "--shared-memory-prefix", "/plugserve-test-{tenant}-") as s:
            client = grpcclient.InferenceServerClient(s.target)
            b = {"authorization": f"Bearer {tokens['admin_b']}"}
            a = {"authorization": f"Bearer {tokens['admin_a']}"}
            try:
                with pytest.raises(InferenceServerException, match=r"\(this tenant's\)"):
                    client.register_system_shared_memory("stolen", key, 64, headers=b)
                client.register_system_shared_memory("secret", key, 64, headers=a)
                client.unregister_system_shared_memory(headers=a)
            finally:
                client.close()
    finally:
        shm.destroy_shared_memory_region(handle)


def test_a_small_body_naming_large_regions_is_served_off_the_event_loop(server, regions):
    """A small REST body was decoded and run on the event loop, and the tensors it names in
    shared memory were read there too: a red team's 263-byte body reading a 512 MiB region
    held REST health 2-9 s. A body naming a region now goes to a worker, as a large body
    does; health holds within the attack bound meanwhile."""
    from attack import LATENCY_BOUND_S, Probe

    count = 16 << 20  # 64 MiB of FP32 each for a, b and sum
    size = 4 * count
    in_name, in_key, in_handle = regions(2 * size)
    out_name, out_key, out_handle = regions(size)
    client = httpclient.InferenceServerClient(server.http_target, connection_timeout=120,
                                              network_timeout=120)  # fmt: skip
    try:
        client.register_system_shared_memory(in_name, in_key, 2 * size)
        client.register_system_shared_memory(out_name, out_key, size)
        inputs = [httpclient.InferInput(n, [count], "FP32") for n in ("a", "b")]
        inputs[0].set_shared_memory(in_name, size)
        inputs[1].set_shared_memory(in_name, size, offset=size)
        output = httpclient.InferRequestedOutput("sum")
        output.set_shared_memory(out_name, size)
        shm.set_shared_memory_region(in_handle, [np.ones(count, np.float32)])
        shm.set_shared_memory_region(in_handle, [np.full(count, 2, np.float32)], offset=size)
        with Probe(server) as probe:
            for _ in range(3):
                client.infer("add", inputs, outputs=[output])
        # the attack tests' bound (before: REST health waited 0.8 s here, 2-9 s for 512 MiB)
        assert probe.rest and max(probe.rest) <= LATENCY_BOUND_S, probe.summary()
        got = shm.get_contents_as_numpy(out_handle, np.float32, [count])
        assert got[0] == got[-1] == 3.0
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_a_tenant_prefix_that_begins_another_tenants_stops_the_start(tmp_path):
    """``/plugserve-test-{tenant}-`` with tenants ``a`` and ``a-x``: a's keys
    (``/plugserve-test-a-``) begin a-x's, so a could register and read a-x's regions (a red
    team's): the server does not start, naming both."""
    import subprocess
    import sys

    token_file = tmp_path / "tokens"
    token_file.write_text("t1 admin tenant=a\nt2 admin tenant=a-x\n")
    token_file.chmod(0o600)
    done = subprocess.run(
        [sys.executable, "-m", "plugserve.server.process.cli", "serve", "--auth-tokens",
         str(token_file),
         "--shared-memory-prefix", "/plugserve-test-{tenant}-", "--grpc-port", "0",
         "--http-port", "-1", "--metrics-port", "-1", "--model-repository", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "tenant 'a'" in done.stderr and "tenant 'a-x'" in done.stderr, done.stderr[-2000:]
