"""The bundled example applications (issue 36, item 7), as a user meets them: the example
repository served by a real server, ``text_sentiment`` (text in, label out) and ``image_color``
(PNG or JPEG bytes in, label out) called with tritonclient over gRPC and HTTP and with
``plugserve infer --text`` / ``--file``; each step counted on its own model; a file that is no
image refused as the client's error while the server keeps serving."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
Image = pytest.importorskip("PIL.Image", reason="pip install -e '.[image]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

PLUGSERVE = [sys.executable, "-m", "plugserve.server.process.cli"]

TEXTS = [
    b"I love this wonderful movie, the acting was brilliant!",
    b"What a terrible, boring film. A waste of time.",
]
COLORS = {"red": (230, 20, 25), "blue": (20, 30, 200), "yellow": (235, 220, 30)}


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from serving import RunningServer, examples_repository

    repository = examples_repository(tmp_path_factory.mktemp("examples"), pipelines=True)
    with RunningServer("--model-repository", str(repository)) as server:
        yield server


def _image(color: tuple[int, int, int], kind: str) -> bytes:
    buffer = io.BytesIO()
    picture = Image.new("RGB", (80, 60), color)
    picture.paste((128, 128, 128), (0, 0, 10, 10))  # a corner of another color
    picture.save(buffer, kind)
    return buffer.getvalue()


def _client(running, protocol):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(running.target)
    return httpclient, httpclient.InferenceServerClient(running.http_target)


def _count(client, model: str) -> int:
    stats = client.get_inference_statistics(model_name=model)
    if isinstance(stats, dict):  # tritonclient.http answers JSON
        return sum(int(s["inference_stats"]["success"]["count"]) for s in stats["model_stats"])
    return sum(int(s.inference_stats.success.count) for s in stats.model_stats)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_text_in_label_out(running, protocol):
    module, client = _client(running, protocol)
    try:
        steps = ("text_tokenizer", "text_encoder", "text_labels")
        before = [_count(client, m) for m in steps]
        tensor = module.InferInput("TEXT", [len(TEXTS)], "BYTES")
        tensor.set_data_from_numpy(np.array(TEXTS, dtype=object))
        result = client.infer("text_sentiment", [tensor])
        assert result.as_numpy("LABEL").tolist() == [b"positive", b"negative"]
        scores = result.as_numpy("SCORE")
        assert scores.dtype == np.float32 and np.all((scores > 0.5) & (scores <= 1))
        assert [_count(client, m) for m in steps] == [n + 1 for n in before]
    finally:
        client.close()


def test_a_texts_tail_past_its_tokens_is_not_read_and_a_request_holds_1024_texts(running):
    """The tokenizer kept a text's first 30 tokens after encoding all of it (a red team's
    megabyte of 100-letter words held its only instance 11-40 s), and each text of a request
    became ~8 KB of the encoder's tensors in the server (400,000 empty texts grew it 3.3 GB):
    now a text is read as far as its tokens go (its tail changes nothing), and a request of
    more than MAX_TEXTS texts is refused."""
    module, client = _client(running, "grpc")
    try:
        head = TEXTS[0] + b" and more words" * 20
        tail = head + b" " + b" ".join([b"q" + b"z" * 99] * 20_000)  # 2 MB of slow words
        tensor = module.InferInput("TEXT", [2], "BYTES")
        tensor.set_data_from_numpy(np.array([head, tail], dtype=object))
        scores = client.infer("text_sentiment", [tensor]).as_numpy("SCORE")
        assert scores[0] == scores[1]
        many = module.InferInput("TEXT", [1025], "BYTES")
        many.set_data_from_numpy(np.array([b""] * 1025, dtype=object))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("text_sentiment", [many])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "1025 texts; at most 1024" in refused.value.message()
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("kind", ["PNG", "JPEG"])
def test_image_bytes_in_label_out(running, protocol, kind):
    module, client = _client(running, protocol)
    try:
        for name, color in COLORS.items():
            data = np.frombuffer(_image(color, kind), np.uint8)
            tensor = module.InferInput("IMAGE", [len(data)], "UINT8")
            tensor.set_data_from_numpy(data)
            result = client.infer("image_color", [tensor])
            assert result.as_numpy("LABEL").tolist() == [name.encode()]
    finally:
        client.close()


def _png_header(width: int, height: int) -> bytes:
    """A PNG that says it is ``width`` x ``height`` (and holds a few bytes of it)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        return struct.pack(">I", len(data)) + kind + data + crc

    head = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return (
        b"\x89PNG\r\n\x1a\n"
        + head
        + chunk(b"IDAT", zlib.compress(bytes(100)))
        + chunk(b"IEND", b"")
    )


def test_bytes_that_are_no_image_are_the_clients_error(running):
    module, client = _client(running, "grpc")
    try:
        # (a header past Pillow's decompression-bomb size raised at open: a 500)
        for raw, words in (
            (b"GIF? no, just text", "no image format Pillow reads"),
            (_png_header(50_000, 50_000), "over 40000000 pixels"),
            (_png_header(10_000, 10_000), "over 40000000 pixels"),
        ):
            data = np.frombuffer(raw, np.uint8)
            tensor = module.InferInput("IMAGE", [len(data)], "UINT8")
            tensor.set_data_from_numpy(data)
            with pytest.raises(InferenceServerException) as refused:
                client.infer("image_color", [tensor])
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
            assert words in refused.value.message()
        assert client.is_model_ready("image_color")  # and it still answers
        data = np.frombuffer(_image(COLORS["red"], "PNG"), np.uint8)
        tensor.set_shape([len(data)])
        tensor.set_data_from_numpy(data)
        assert client.infer("image_color", [tensor]).as_numpy("LABEL").tolist() == [b"red"]
    finally:
        client.close()


def _infer(running, *args: str) -> str:
    done = subprocess.run(
        [*PLUGSERVE, "infer", *args, "--target", running.target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def test_plugserve_infer_on_both(running, tmp_path):
    text = _infer(running, "text_sentiment", "--text", TEXTS[0].decode(), "--text",
                  TEXTS[1].decode())  # fmt: skip
    assert "LABEL: object[2]" in text and "['positive' 'negative']" in text, text
    picture = tmp_path / "picture.jpg"
    picture.write_bytes(_image(COLORS["blue"], "JPEG"))
    image = _infer(running, "image_color", "--file", str(picture))
    assert "['blue']" in image, image
    named = _infer(running, "image_color", "--file", f"IMAGE={picture}")
    assert "['blue']" in named, named
