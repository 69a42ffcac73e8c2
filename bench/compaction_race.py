"""Two compaction passes started together on one directory: does every row stay visible exactly once?

Each trial writes a run of 120 small StepRecorded files (as a writer flushing every 0.25 s leaves
them), ages them past `min_age_s`, and starts two `awrl ledger compact` passes as separate processes at
the same moment. Then it counts the rows a reader sees (`analysis.connect`, the ledger's own listing)
against the rows written, and says how the trial resolved: one pass gave way before committing, or
both committed and readers counted the first. Two arms side by side: `now`, this checkout, and
`before`, the code at `--before` (a git worktree; the commit before compaction handled overlapping
passes), whose passes and reader run the same trial: the negative control.

    .venv/bin/python bench/compaction_race.py [--trials 6] [--before e5be601^]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/samples.py

import json
import os
import subprocess
import tempfile
import time

import typer
from rich.console import Console
from rich.table import Table

from pipeline.ledger import LedgerWriter
from pipeline.settings import StackSettings

from samples import sample_group

RUN = "race"
PASS = """
import json, sys
from pipeline.ledger import compact_ledger
from pipeline.settings import StackSettings
r = compact_ledger(StackSettings(ledger_uri=sys.argv[1]), "race")["StepRecorded"]
print(json.dumps({"rows": r.rows, "yielded": getattr(r, "yielded", False)}))
"""
READ = """
import json, sys
from analysis import connect
con = connect(sys.argv[1])
print(json.dumps(con.execute("select count(*), count(distinct event_id) from step_recorded").fetchone()))
"""
console = Console()


def _ledger(root: str, files: int) -> int:
    writer, rows = LedgerWriter(StackSettings(ledger_uri=root)), 0
    for g in range(files):
        batch = [e for e in sample_group(RUN, f"g{g}", ["ab" * 32], seed=g) if type(e).__name__ == "StepRecorded"]
        writer._write(RUN, "StepRecorded", batch)
        rows += len(batch)
    past = time.time() - 120
    for f in Path(root).rglob("*.parquet"):
        os.utime(f, (past, past))
    return rows


def _python(code: str, root: str, src: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, root],
        stdout=subprocess.PIPE,
        text=True,
        cwd=src,
        env={**os.environ, "PYTHONPATH": str(src)},
    )


def _last_json(proc: subprocess.Popen):
    return json.loads(proc.communicate(timeout=300)[0].strip().splitlines()[-1])


def main(trials: int = 6, files: int = 120, before: str = "e5be601^") -> None:
    here = Path(__file__).resolve().parents[1]
    table = Table(title=f"two compaction passes at once on {files} small files")
    for c in ("arm", "trial", "rows written", "rows read", "distinct", "resolution"):
        table.add_column(c, justify="right")
    wrong = {"before": 0, "now": 0}
    with tempfile.TemporaryDirectory() as tree:
        subprocess.run(["git", "worktree", "add", "--detach", tree, before], cwd=here, check=True, capture_output=True)
        try:
            for trial in range(1, trials + 1):
                for arm, src in (("before", Path(tree)), ("now", here)):
                    with tempfile.TemporaryDirectory() as root:
                        rows = _ledger(root, files)
                        results = [_last_json(p) for p in [_python(PASS, root, src) for _ in range(2)]]
                        read, distinct = _last_json(_python(READ, root, src))
                        wrong[arm] += read != rows
                        how = (
                            "one gave way"
                            if any(r["yielded"] for r in results)
                            else "both committed"
                            if all(r["rows"] for r in results)
                            else "one pass merged"
                        )
                        table.add_row(arm, str(trial), f"{rows:,}", f"{read:,}", f"{distinct:,}", how)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=here, capture_output=True)
    console.print(table)
    for arm, n in wrong.items():
        console.print(f"{arm}: trials where a reader saw a row twice or not at all: {n} of {trials}")


if __name__ == "__main__":
    typer.run(main)
