"""A config.pbtxt's sequence_batching read with bounds (a red team's admin loads): an
``oldest`` delay past ten minutes killed the gatherer's thread (OverflowError in its wait) and
the model's requests went unanswered; a state of dims [2^40, 2^40] (or [120000, 120000]) was
made while the configuration was read, a 500 (ValueError, MemoryError)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from plugserve.plugins.api import InvalidArgument
from plugserve.server.control.triton_config import messages
from plugserve.server.plane.sequence_config import read_sequence_batching


def _read(text: str, max_batch_size: int = 8):
    config = text_format.Parse(text, messages().ModelConfig())
    return read_sequence_batching(config.sequence_batching, max_batch_size, Path("."), "m")


@pytest.mark.parametrize("delay", ["600000001", "10000000000000000"])
def test_an_oldest_delay_past_ten_minutes_is_refused(delay):
    with pytest.raises(InvalidArgument, match="max_queue_delay_microseconds"):
        _read(f"sequence_batching {{ oldest {{ max_queue_delay_microseconds: {delay} }} }}")
    settings, _ = _read("sequence_batching { oldest { max_queue_delay_microseconds: 600000000 } }")
    assert settings.queue_delay == 600.0


@pytest.mark.parametrize(
    "state",
    [
        "dims: [ 1099511627776, 1099511627776 ]",
        "dims: [ 2147483648, 3 ]",
        "dims: [ 120000, 120000 ]",
        "dims: [ -1, -1 ] initial_state { data_type: TYPE_FP32 dims: [ 4294967296, 4294967296 ]"
        " zero_data: true }",
    ],
)
def test_a_state_past_its_bound_is_refused_before_it_is_made(state):
    text = (
        'sequence_batching { state [ { input_name: "S_IN" output_name: "S_OUT" '
        f"data_type: TYPE_FP32 {state} }} ] }}"
    )
    with pytest.raises(InvalidArgument, match="a state of more than 268,435,456 bytes"):
        _read(text)
    small = text.replace("1099511627776", "4").replace("2147483648", "4").replace("120000", "4")
    small = small.replace("4294967296", "4")
    settings, _ = _read(small)
    assert settings.states[0].initial.nbytes <= 64
