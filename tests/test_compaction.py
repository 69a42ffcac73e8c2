"""Compaction on a local ledger: small files merged into large sorted ones while a query loop runs;
every query sees every row exactly once, before, during and after; and passes that overlap, or die
half-way, leave every row exactly once too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import dagster as dg
import pyarrow.parquet as pq
import pytest

from analysis.ledger import connect
from pipeline.compaction import CompactionConfig, compact_run, manifest_rule
from pipeline.files import write_atomic
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
        deadline = time.monotonic() + 60
        while len(seen) <= 5 and time.monotonic() < deadline:  # a loaded machine queries slowly
            time.sleep(0.2)
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
    result = compact_ledger(StackSettings(ledger_uri=root), RUN, CompactionConfig(min_age_s=0, grace_s=0, abandoned_s=0))
    assert result["StepRecorded"].deleted == 1 and result["StepRecorded"].rows == steps
    assert connect(root).execute("SELECT count(*), count(DISTINCT event_id) FROM step_recorded").fetchone() == (
        steps, steps)


# --- passes that overlap (issue: safe compaction) ---------------------------------------------------

def _aged(root: str, groups: int = 40) -> tuple[int, list[str]]:
    """Small files older than the default `min_age_s`, as a live run's are a minute on."""
    steps, files = _small_files(root, groups)
    past = time.time() - 120
    for f in files:
        os.utime(f, (past, past))
    return steps, files


def _counts(root: str) -> tuple[int, int]:
    return connect(root).execute("SELECT count(*), count(DISTINCT event_id) FROM step_recorded").fetchone()


class _Gate:
    """An atomic `put` that holds each of `parties` passes at one step (`at`: the manifest state about to
    be written) until all have reached it, so the passes overlap exactly there."""

    def __init__(self, parties: int, at: str):
        self.barrier, self.at = threading.Barrier(parties), f'"state": "{at}"'.encode()

    def __call__(self, path: str, data: bytes) -> None:
        if path.endswith(".json") and "_compaction-" in path and self.at in data:
            self.barrier.wait(timeout=60)
        write_atomic(path, data)


def _together(*passes) -> list:
    out, threads = [None] * len(passes), []
    for i, p in enumerate(passes):
        threads.append(threading.Thread(target=lambda i=i, p=p: out.__setitem__(i, p())))
        threads[-1].start()
    for t in threads:
        t.join(timeout=120)
    return out


@pytest.mark.parametrize("overlap", ["pending", "committed"])
def test_two_passes_started_together_leave_every_row_once(tmp_path, overlap):
    """`pending`: both listed the same files, then race (the second to commit finds its sources taken
    and gives up). `committed`: both are past that check and commit: readers count the first only, and
    the next pass removes the loser. The negative control reads the same files counting every committed
    pass, as before: every merged row twice."""
    root = str(tmp_path / "ledger")
    steps, files = _aged(root)
    fs, r = ledger_filesystem(StackSettings(ledger_uri=root))
    gate = _Gate(2, overlap)
    one = lambda: compact_run(fs, r, RUN, CompactionConfig(), gate)["StepRecorded"]  # noqa: E731
    results = _together(one, one)
    assert all(results) and _counts(root) == (steps, steps)
    if overlap == "committed":
        assert not any(x.yielded for x in results)
        paths = {str(p) for p in (tmp_path / "ledger").rglob("*") if p.is_file()}
        hidden, invisible = manifest_rule(fs, paths, first_commit_wins=False)
        naive = sum(pq.ParquetFile(p).metadata.num_rows for p in paths
                    if p.endswith(".parquet") and p not in hidden and p not in invisible)
        assert naive == 2 * steps, (naive, steps)  # the duplication the rule prevents
    else:
        assert sum(x.yielded for x in results) <= 1
    compact_ledger(StackSettings(ledger_uri=root), RUN, CompactionConfig(grace_s=0))  # finishes both
    assert _counts(root) == (steps, steps)
    assert not list((tmp_path / "ledger").rglob("_compaction-*.json"))
    assert len(list_parquet(fs, r)) == len(list((tmp_path / "ledger").rglob("*.parquet")))


def test_a_pass_beside_the_dagster_compaction_asset(tmp_path, monkeypatch):
    """`awrl ledger compact` while the sensor's run compacts the same run: both held after listing the
    same files."""
    from assets.io import Ledger, ParquetIOManager
    from assets.maintenance import compaction

    root = str(tmp_path / "ledger")
    steps, _ = _aged(root, groups=120)
    gate = _Gate(2, "pending")
    monkeypatch.setattr("pipeline.files.write_atomic", gate)  # both passes' atomic put
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", [RUN])
    ledger = Ledger(ledger_uri=root)

    def asset():
        return dg.materialize([compaction], partition_key=RUN, instance=instance,
                              resources={"ledger": ledger, "io_manager": ParquetIOManager(ledger=ledger)})

    result, cli = _together(asset, lambda: compact_ledger(StackSettings(ledger_uri=root), RUN)["StepRecorded"])
    assert result.success and cli is not None
    assert _counts(root) == (steps, steps)


def test_dagster_dev_limits_compaction_to_one_pass_at_a_time(tmp_path):
    """`dagster dev` in the repo root reads ./dagster.yaml: the compaction asset's pool has a limit of 1
    there, so two sensor runs queue their passes (Dagster enforces the pool; its own tests cover that)."""
    from pathlib import Path

    from assets.maintenance import POOL, compaction

    (tmp_path / "dagster.yaml").write_text(Path("dagster.yaml").read_text() + "telemetry:\n  enabled: false\n")
    instance = dg.DagsterInstance.local_temp(str(tmp_path))
    assert compaction.op.pool == POOL and instance.get_concurrency_config().pool_config.default_pool_limit == 1


_KILLED_PASS = """
import os, signal, sys
from pipeline.compaction import CompactionConfig, compact_run
from pipeline.files import write_atomic
from pipeline.ledger import ledger_filesystem
from pipeline.settings import StackSettings

def put(path, data):  # SIGKILL as the pass is about to commit: its outputs are written, its manifest pending
    if path.endswith(".json") and b'"state": "committed"' in data:
        os.kill(os.getpid(), signal.SIGKILL)
    write_atomic(path, data)

fs, root = ledger_filesystem(StackSettings(ledger_uri=sys.argv[1]))
compact_run(fs, root, sys.argv[2], CompactionConfig(), put)
"""


def test_a_pass_killed_half_way_holds_nothing_up(tmp_path):
    """A pass SIGKILLed with its outputs written and its switch not made: its files stay invisible, the
    next pass merges the same sources at once (no lock to wait out), and its leftovers go once abandoned."""
    root = str(tmp_path / "ledger")
    steps, _ = _aged(root)
    killed = subprocess.run([sys.executable, "-c", _KILLED_PASS, root, RUN], cwd=os.getcwd(), timeout=120,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert killed.returncode == -9
    orphans = list((tmp_path / "ledger").rglob("part-compact-*.parquet"))
    assert orphans and _counts(root) == (steps, steps)
    again = compact_ledger(StackSettings(ledger_uri=root), RUN)["StepRecorded"]
    assert again.rows > 0 and not again.yielded and _counts(root) == (steps, steps)
    compact_ledger(StackSettings(ledger_uri=root), RUN, CompactionConfig(grace_s=0, abandoned_s=0))
    assert not [p for p in orphans if p.exists()] and _counts(root) == (steps, steps)
    assert len(list((tmp_path / "ledger").rglob("_compaction-*.json"))) == 0
