"""What tokenizing charges to the memory budget (server/apps/generate/limits.py): a text whose
tokenizing takes more than UNCHARGED_TOKENIZING is charged before it starts, and refused when
the budget has no room; a smaller one is not charged (the threads that tokenize are few, and a
burst of small chats starved on a 40 KiB charge each: tests/generate/test_openai_refusals.py).
The served refusal of a large one is tests/server/test_attacks_generate.py's."""

from __future__ import annotations

import pytest

from plugserve.plugins.api import ResourceExhausted
from plugserve.server.apps.generate import limits
from plugserve.server.plane.budget import MemoryBudget


@pytest.fixture
def budget():
    """A 2 MiB budget as the server's, all but 1,000 bytes of it held; the settings restored."""
    saved = dict(vars(limits._limits))
    budget = MemoryBudget(2 << 20)
    limits.configure(budget)
    held = budget.charge(budget.limit - 1000, "others")
    try:
        yield budget
    finally:
        held.release()
        limits.configure(**saved)


def test_a_small_text_tokenizes_uncharged_and_a_larger_one_is_charged_first(budget):
    small = limits.UNCHARGED_TOKENIZING // limits.TOKENIZE_BYTES_PER_BYTE  # 3,276 bytes
    used = budget.used
    with limits.tokenizing(small, "the chat"):
        assert budget.used == used
    refused = pytest.raises(
        ResourceExhausted, match=r"tokenizing the chat would hold about 1\.0 MiB"
    )
    with refused, limits.tokenizing(small + 1, "the chat"):
        pytest.fail("tokenized without room for it")
    assert budget.used == used and budget.refused == 1
