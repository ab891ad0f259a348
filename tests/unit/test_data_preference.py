"""Unit tests of preference pairs (finetune/data/preference.py): which column a bad pair's error blames."""

from __future__ import annotations

import pytest

from finetune.data.preference import split_pair
from finetune.errors import UsageError

ANSWER = [{"role": "assistant", "content": "b"}]
QUESTION = [{"role": "user", "content": "q"}]


@pytest.mark.parametrize("row, words", [
    ({"prompt": "q", "chosen": "a", "rejected": ANSWER}, "chosen and rejected must be strings too, got chosen str and "
                                                         "rejected list"),
    ({"prompt": "q", "chosen": "a"}, "got chosen str and rejected missing"),
    ({"prompt": QUESTION, "chosen": "a", "rejected": "b"}, "with string chosen and rejected, the prompt must be a "
                                                           "string too, got list"),
    ({"prompt": "q", "chosen": "a", "rejected": " "}, "rejected must be non-empty strings"),
])
def test_a_bad_pair_is_blamed_on_the_column_at_fault(row, words):
    with pytest.raises(UsageError, match=f"^example 3: .*{words}"):
        split_pair(row, "example 3")


def test_good_pairs_of_either_kind_pass():
    assert split_pair({"prompt": "q", "chosen": "a", "rejected": "b"}, "example 1") == ("q", "a", "b")
    prompt, chosen, rejected = split_pair({"prompt": QUESTION, "chosen": ANSWER, "rejected": [
        {"role": "assistant", "content": "c"}]}, "example 1")
    assert prompt == QUESTION and chosen == ANSWER and rejected[0]["content"] == "c"
