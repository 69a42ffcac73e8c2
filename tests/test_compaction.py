"""Compaction on a local ledger: small files merged into large sorted ones while a query loop runs;
every query sees every row exactly once, before, during and after."""

from __future__ import annotations

import json
import threading
import time

import pyarrow.parquet as pq

from analysis.ledger import connect
from pipeline.compaction import CompactionConfig
from pipeline.journal import Journal
from pipeline.ledger import LedgerWriter, compact_ledger, ledger_filesystem, list_parquet
from pipeline.settings import StackSettings

from samples import sample_group

SHA = "cd" * 32
RUN = "run-compact"


def _small_files(root: str, groups: int = 40) -> tuple[int, list[str]]:
    """One small file per group's steps (as a writer flushing every 0.25 s leaves them)."""
    writer = LedgerWriter(StackSettings(ledger_uri=root))
    steps = 0
    for g in range(groups):
        batch = [e for e in sample_group(RUN, f"g{g}", [SHA], seed=g) if type(e).__name__ == "StepRecorded"]
        writer._write(RUN, "StepRecorded", batch)
        steps += len(batch)
    fs, r = ledger_filesystem(StackSettings(ledger_uri=root))
    return steps, list_parquet(fs, r)


def test_compaction_merges_sorts_and_queries_meanwhile_see_every_row_once(tmp_path):
    root = str(tmp_path / "ledger")
    steps, files = _small_files(root)
    fs, r = ledger_filesystem(StackSettings(ledger_uri=root))
    Journal(fs, r).record("awrl.rollout", 0, 99, [files[-1]], "c")  # a writer's last flush: left alone
    seen, errors, stop = [], [], threading.Event()

    def query_loop():
        while not stop.is_set():
            try:
                seen.append(connect(root).execute(
                    "SELECT count(*), count(DISTINCT event_id) FROM step_recorded WHERE run_id = $run",
                    {"run": RUN}).fetchone())
            except Exception as exc:  # noqa: BLE001 - any failure is a test failure, reported below
                errors.append(repr(exc))

    thread = threading.Thread(target=query_loop)
    thread.start()
    config = CompactionConfig(target_rows=steps // 3, small_rows=steps // 3, min_age_s=0, grace_s=1.0)
    try:
        first = compact_ledger(StackSettings(ledger_uri=root), RUN, config)["StepRecorded"]
        time.sleep(1.5)  # past the grace: the next pass deletes the sources
        second = compact_ledger(StackSettings(ledger_uri=root), RUN, config)["StepRecorded"]
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[:3]
    assert len(seen) > 5 and set(seen) == {(steps, steps)}  # every query: every row, once
    merged_rows = steps - pq.read_table(files[-1]).num_rows
    assert (first.files_before, first.rows) == (len(files), merged_rows)
    # the merged files (about target_rows each: a source file is never split) + the journaled one
    assert 2 <= first.files_after - 1 <= -(-merged_rows // config.target_rows)
    assert second.deleted == len(files) - 1  # the sources, once past the grace
    live = list_parquet(fs, r)
    assert files[-1] in live and len(live) == first.files_after
    assert not [p for p in (tmp_path / "ledger").rglob("_compaction-*.json")]
    merged = [pq.read_table(p, columns=["trajectory_id", "step"]).to_pylist() for p in live if "compact" in p]
    for rows in merged:  # sorted by (trajectory, step): DuckDB prunes row groups on both
        assert rows == sorted(rows, key=lambda x: (x["trajectory_id"], x["step"]))


def test_a_compaction_cut_short_before_its_switch_is_invisible_then_cleaned_up(tmp_path):
    root = str(tmp_path / "ledger")
    steps, files = _small_files(root, groups=6)
    directory = files[0].rsplit("/", 1)[0]
    # a pass that died after writing its output, before committing the manifest
    (tmp_path / "x.parquet").write_bytes(open(files[0], "rb").read())
    (tmp_path / "x.parquet").rename(f"{directory}/part-compact-crashed-000.parquet")
    with open(f"{directory}/_compaction-crashed.json", "w") as f:
        json.dump({"state": "pending", "prefix": "part-compact-crashed-"}, f)
    fs, r = ledger_filesystem(StackSettings(ledger_uri=root))
    assert sorted(list_parquet(fs, r)) == sorted(files)  # the orphan output is not read
    assert connect(root).execute("SELECT count(*) FROM step_recorded").fetchone() == (steps,)
    result = compact_ledger(StackSettings(ledger_uri=root), RUN, CompactionConfig(min_age_s=0, grace_s=0))
    assert result["StepRecorded"].deleted == 1 and result["StepRecorded"].rows == steps
    assert connect(root).execute("SELECT count(*), count(DISTINCT event_id) FROM step_recorded").fetchone() == (
        steps, steps)
