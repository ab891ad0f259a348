"""tests/budget.py, the suite's CPU budget by file: what fails CI and what it prints."""

from __future__ import annotations

import json

import budget


def test_a_file_fails_past_one_and_a_half_times_its_recorded_share():
    recorded = {"a.py": 500.0, "b.py": 400.0, "c.py": 100.0}  # shares 50%, 40%, 10%
    # c.py: 14% of the suite (1.4x its share) passes; 16% (1.6x) fails; the others' shares fell.
    assert budget.overruns({"a.py": 460.0, "b.py": 400.0, "c.py": 140.0}, recorded) == []
    found = budget.overruns({"a.py": 440.0, "b.py": 400.0, "c.py": 160.0}, recorded)
    assert len(found) == 1 and found[0].startswith("c.py: 16.0% of the suite's CPU")


def test_a_new_file_fails_above_the_floor_only():
    recorded = {"a.py": 1000.0}
    assert budget.overruns({"a.py": 1000.0, "new.py": 9.0}, recorded) == []  # under 10 CPU-s: noise
    assert budget.overruns({"a.py": 1000.0, "new.py": 5.0 + 1000.0 * budget.FLOOR[0]}, recorded) == [
        "new.py: 15 CPU-s (1.5% of the suite) and not in the budget"]


def test_the_phases_add_up_by_part_and_the_table_says_where_the_time_went(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FINETUNE_RECORD_BUDGET", raising=False)  # a suite run that records the budget checks it too
    report = tmp_path / "report.json"
    budget.add_to_report(report, {"a.py": [10.0, 20.0, 30.0]})
    budget.add_to_report(report, {"a.py": [1.0, 2.0, 3.0], "b.py": [5.0, 0.0, 0.0]})
    assert json.loads(report.read_text()) == {"a.py": [11.0, 22.0, 33.0], "b.py": [5.0, 0.0, 0.0]}

    recorded = tmp_path / "budget.json"
    recorded.write_text(json.dumps({"a.py": 60.0, "b.py": 6.0}))
    monkeypatch.setattr(budget, "BUDGET", recorded)
    assert budget.main(report) == 0
    rows = {line.split()[-1]: line.split() for line in capsys.readouterr().out.splitlines() if line.endswith(".py")}
    assert rows["a.py"][:2] == ["66.0", "93.0%"] and rows["a.py"][3:6] == ["11.0", "22.0", "33.0"]

    budget.add_to_report(report, {"b.py": [60.0, 0.0, 0.0]})  # b.py: 65 of 131 CPU-s, recorded 9%
    assert budget.main(report) == 1
    assert "over budget: b.py" in capsys.readouterr().out
    monkeypatch.setenv("FINETUNE_RECORD_BUDGET", "1")
    assert budget.main(report) == 0
    assert json.loads(recorded.read_text()) == {"a.py": 66.0, "b.py": 65.0}
