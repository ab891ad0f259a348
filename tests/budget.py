"""The suite's CPU budget, by test file.

Each test's CPU-seconds are counted where they are spent: the pytest worker's
own, its waited-for children's (every launched run), and the forked runs'
(tests/fork_server.py reports each run's rusage). conftest.py adds them up by
file; scripts/test.sh writes both phases' sums into one report, then runs this
file on it:

    python tests/budget.py REPORT        the table, and the check
    FINETUNE_RECORD_BUDGET=1 ...         writes the report into tests/budget.json

The check fails when a file's share of the suite's CPU grows past its recorded
share by more than GROWTH (shares, not seconds: the fast and slow machines
differ by half, a file's part of the whole does not), or when a file not in
the budget takes more than FLOOR of it. A file that grows on purpose records
the budget again in the same commit, with the reason in the commit message.
tests/budget.json also orders the files (the costliest first: conftest.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

BUDGET = Path(__file__).parent / "budget.json"
GROWTH = 1.5
FLOOR = 0.01, 10.0  # under 1% of the suite or 10 CPU-s a file's figure is noise: not checked


def recorded() -> dict[str, float]:
    return json.loads(BUDGET.read_text())


def add_to_report(path: Path, seconds: dict[str, list[float]]) -> None:
    """Adds one pytest run's CPU-seconds by file, in conftest's CPU_PARTS, to
    the report at `path` (a phase of scripts/test.sh)."""
    report = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
    for name, parts in seconds.items():
        report[name] = [round(a + b, 1) for a, b in zip(report.get(name, [0.0] * len(parts)), parts)]
    path.write_text(json.dumps(report, indent=1) + "\n")


def overruns(measured: dict[str, float], budget: dict[str, float]) -> list[str]:
    total, budget_total = sum(measured.values()), sum(budget.values())
    found = []
    for name, spent in measured.items():
        share = spent / total
        if share < FLOOR[0] or spent < FLOOR[1]:
            continue
        if name not in budget:
            found.append(f"{name}: {spent:.0f} CPU-s ({share:.1%} of the suite) and not in the budget")
        elif share > GROWTH * budget[name] / budget_total:
            found.append(f"{name}: {share:.1%} of the suite's CPU ({spent:.0f} CPU-s), recorded "
                         f"{budget[name] / budget_total:.1%}: more than {GROWTH}x its share")
    return found


def table(measured: dict[str, list[float]], budget: dict[str, float]) -> str:
    totals = {name: sum(parts) for name, parts in measured.items()}
    total, budget_total = sum(totals.values()), sum(budget.values()) or 1.0
    lines = [f"{'CPU-s':>8} {'share':>6} {'budget':>7} {'worker':>8} {'launched':>9} {'forked':>8}  file"]
    for name, spent in sorted(totals.items(), key=lambda kv: -kv[1]):
        was = f"{budget[name] / budget_total:.1%}" if name in budget else "new"
        worker, launched, forked = measured[name]
        lines.append(f"{spent:8.1f} {spent / total:6.1%} {was:>7} {worker:8.1f} {launched:9.1f} {forked:8.1f}  {name}")
    worker, launched, forked = (sum(parts[i] for parts in measured.values()) for i in range(3))
    lines.append(f"{total:8.1f} {'':6} {'':>7} {worker:8.1f} {launched:9.1f} {forked:8.1f}  total "
                 f"({budget_total:.0f} recorded)")
    return "\n".join(lines)


def main(report: Path) -> int:
    measured = json.loads(report.read_text())  # file: [worker, launched, forked]
    totals = {name: round(sum(parts), 1) for name, parts in measured.items()}
    budget = recorded()
    print("\nCPU-seconds by test file: the pytest worker's own, its launched runs and other commands', its forked runs'")
    print(table(measured, budget))
    if os.environ.get("FINETUNE_RECORD_BUDGET"):
        BUDGET.write_text(json.dumps(dict(sorted(totals.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
        print(f"recorded in {BUDGET}: commit it with the reason in the message")
        return 0
    found = overruns(totals, budget)
    for line in found:
        print(f"over budget: {line}")
    if found:
        print("A file that grows on purpose: FINETUNE_RECORD_BUDGET=1 bash scripts/test.sh, and commit "
              "tests/budget.json with the change, saying why in the commit message.")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
