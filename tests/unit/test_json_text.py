"""Every JSON file a run writes is valid JSON (finetune/json_text.py)."""

from __future__ import annotations

import json
import math

from finetune import json_text


def test_non_finite_numbers_become_null_and_strict_readers_take_the_text(tmp_path):
    value = {"reward": math.inf, "rows": [{"loss": math.nan}, (1.5, -math.inf)], "ok": 2}
    text = json_text.dumps(value)
    assert json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name))) == \
        {"reward": None, "rows": [{"loss": None}, [1.5, None]], "ok": 2}
    (tmp_path / "rows.jsonl").write_text('{"step": 1}\n[1, 2]\n\n{"step": 2}\n{"step": 3, "lo')
    assert json_text.read_jsonl(tmp_path / "rows.jsonl") == [{"step": 1}, {"step": 2}]
