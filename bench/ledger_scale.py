"""The ledger at scale, side by side in one run: drift with and without token summaries, and files,
bytes, query and drift time before and after compaction.

    .venv/bin/python bench/ledger_scale.py [--trajectories 100000] [--small-rows 100] [--repeat 3]

Three copies of bench/drift.py's synthetic run (100k trajectories -> 1,000,000 StepRecorded, ~240
response tokens each):
  summaries      files of 20,000 steps with the ledger's per-step token summaries (as written now)
  arrays         the same files without them (a ledger written before them): the token pass decodes
  small files    files of `small_rows` steps with summaries, as a writer flushing every 0.25 s leaves a
                 busy run (the generator's draws differ with the file size: another sample of the
                 same distribution); then `compact_ledger` (`pipeline.compaction`) and the same queries
Queries: the drift report with every metric; one trajectory's steps (`WHERE trajectory_id = ...`),
which row-group statistics prune once the rows are sorted. Wall time, min / median of `repeat`.
Writes bench/out/ledger_scale.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/drift.py's generator

import json
import math
import statistics
import tempfile
import time

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def _timed(fn, repeat: int) -> tuple[float, float]:
    walls = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    return min(walls), statistics.median(walls)


def _files(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*.parquet")]
    return len(files), sum(p.stat().st_size for p in files)


def measure(root: Path, repeat: int) -> dict:
    from analysis import connect, drift_metrics

    from drift import RUN

    files, size = _files(root)
    con = connect(root)
    drift = _timed(lambda: drift_metrics(con, RUN), repeat)
    lookup = _timed(
        lambda: con.execute(
            "SELECT count(*), sum(len(token_policy_versions)) FROM step_recorded WHERE trajectory_id = 't54321'"
        ).fetchall(),
        repeat,
    )
    connect_s = _timed(lambda: connect(root).close(), repeat)
    return {
        "files": files,
        "bytes": size,
        "drift_s": drift,
        "lookup_s": lookup,
        "connect_s": connect_s,
        "metrics": {
            k: v
            for k, v in drift_metrics(con, RUN).to_dict().items()
            if k not in ("keys_by_step", "clip_rate_by_update")
        },
    }


def main(trajectories: int = 100_000, small_rows: int = 100, repeat: int = 3) -> None:
    from pipeline.compaction import CompactionConfig
    from pipeline.ledger import compact_ledger
    from pipeline.settings import StackSettings

    from drift import RUN, generate

    results = {}
    with tempfile.TemporaryDirectory(prefix="ledger-scale-") as tmp:
        for name, summaries, per_file in (
            ("summaries", True, 20_000),
            ("arrays", False, 20_000),
            ("small files", True, small_rows),
        ):
            root = Path(tmp) / name.replace(" ", "-")
            with console.status(f"generating '{name}' ..."):
                generate(root, trajectories, summaries=summaries, per_file=per_file)
            with console.status(f"querying '{name}' ..."):
                results[name] = measure(root, repeat)
        root = Path(tmp) / "small-files"
        with console.status("compacting ..."):
            t = time.perf_counter()
            compacted = compact_ledger(
                StackSettings(ledger_uri=str(root)), RUN, CompactionConfig(target_rows=100_000, min_age_s=0, grace_s=0)
            )
            compact_s = time.perf_counter() - t
            compact_ledger(StackSettings(ledger_uri=str(root)), RUN, CompactionConfig(min_age_s=0, grace_s=0))
        with console.status("querying after compaction ..."):
            results["compacted"] = measure(root, repeat)
        results["compacted"]["compaction_s"] = compact_s
        results["compacted"]["rows_merged"] = sum(r.rows for r in compacted.values())
    for a, b in (("summaries", "arrays"), ("small files", "compacted")):  # same data, same answers
        other = results[b]["metrics"]  # equal; float sums to rounding (row order differs after compaction)
        diff = {
            k: (v, other[k])
            for k, v in results[a]["metrics"].items()
            if not (other[k] == v or isinstance(v, float) and math.isclose(v, other[k], rel_tol=1e-9))
        }
        assert not diff, (a, b, diff)
    report(results, trajectories)


def report(results: dict, trajectories: int) -> None:
    head = [
        "ledger",
        "files",
        "MiB",
        "connect s",
        "drift, all metrics s (min / median)",
        "one trajectory's steps s (min / median)",
    ]
    table = Table(title=f"{trajectories:,} trajectories, 1M steps")
    for col in head:
        table.add_column(col)
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        row = [
            name,
            f"{r['files']:,}",
            f"{r['bytes'] / 2**20:,.0f}",
            f"{r['connect_s'][1]:.2f}",
            f"{r['drift_s'][0]:.2f} / {r['drift_s'][1]:.2f}",
            f"{r['lookup_s'][0]:.3f} / {r['lookup_s'][1]:.3f}",
        ]
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    console.print("\n".join(md), markup=False, highlight=False)
    console.print(
        f"compaction: {results['compacted']['rows_merged']:,} rows in {results['compacted']['compaction_s']:.1f} s"
    )
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "ledger_scale.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    typer.run(main)
