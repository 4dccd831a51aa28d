"""config.pbtxt read with bounds (a red team's admin loads with overrides): a thousand outputs
each naming a label file read it a thousand times (the server grew 400 MB a load, kept), the
parse cache kept every override's text (256 of up to --max-message-bytes each), and a config
of a million ignored parameter names wrote one 22 MB log line."""

from __future__ import annotations

import logging

import pytest

from plugserve.plugins.api import InvalidArgument
from plugserve.server.control import triton_config
from plugserve.server.control.triton_config import MAX_LABEL_BYTES, read_triton


def _config(outputs: list[tuple[str, str]], extra: str = "") -> str:
    listed = ", ".join(
        f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "{labels}" }}'
        for name, labels in outputs
    )
    return 'name: "m"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n' + (
        f"output [ {listed} ]\n{extra}"
    )


def test_outputs_naming_one_label_file_share_one_read(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "labels.txt").write_text("\n".join(f"class {i}" for i in range(1000)))
    path = folder / "config.pbtxt"
    path.write_text(_config([(f"y{i}", "labels.txt") for i in range(1000)]))
    settings = read_triton(path)
    assert len(settings.labels) == 1000
    assert len({id(labels) for labels in settings.labels.values()}) == 1  # one tuple


def test_label_files_together_are_bounded(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    half = "x" * (MAX_LABEL_BYTES // 2 + 10)
    (folder / "a.txt").write_text(half)
    (folder / "b.txt").write_text(half)
    path = folder / "config.pbtxt"
    path.write_text(_config([("y0", "a.txt"), ("y1", "b.txt")]))
    with pytest.raises(InvalidArgument, match="label files are over"):
        read_triton(path)


def test_a_large_configuration_is_not_kept_and_its_log_line_is_short(tmp_path, caplog):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "labels.txt").write_text("a\nb\n")
    names = "".join(
        f'parameters {{ key: "p{i}" value: {{ string_value: "v" }} }}\n' for i in range(20_000)
    )
    path = folder / "config.pbtxt"
    path.write_text(_config([("y", "labels.txt")], names))
    kept = len(triton_config._parsed)
    with caplog.at_level(logging.WARNING, logger=triton_config.log.name):
        read_triton(path)
    assert len(triton_config._parsed) == kept
    assert max(len(r.getMessage()) for r in caplog.records) < 4000, "a long log line"
