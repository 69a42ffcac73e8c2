"""Compaction on a local ledger: small files merged into large sorted ones while a query loop runs;
every query sees every row exactly once, before, during and after; and passes that overlap, stall at
any step, or die half-way, leave every row exactly once too. Each interleaving test pauses one actor
before a step (driving `compaction_steps` one storage action at a time), runs another, then resumes it;
its negative control runs the same schedule with the safeguard off (`tests/test_compaction_explorer.py`
draws such schedules at random)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime

import dagster as dg
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from analysis.views import connect
from pipeline.compaction import (
    SAFE,
    CompactionConfig,
    Safeguards,
    compact_run,
    compaction_steps,
    manifest_rule,
    run,
    view_steps,
)
from pipeline.files import write_atomic
from pipeline.ledger import compact_ledger, ledger_filesystem, list_parquet
from pipeline.ledger_journal import ClaimedFile, Journal
from pipeline.settings import StackSettings
from pipeline.summaries import with_summaries
from schemas import BY_NAME
from schemas.columnar import columnar_table

from samples import sample_group

SHA = "cd" * 32
RUN = "run-compact"


def _write_steps(root: str, events) -> None:
    """One ledger file of `events`, as the writer lays it out (its internals are not needed here)."""
    table = with_summaries("StepRecorded", columnar_table(events, BY_NAME["StepRecorded"]))
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    _, r = ledger_filesystem(StackSettings(ledger_uri=root))
    write_atomic(
        f"{r}/run_id={RUN}/event_type=StepRecorded/part-{datetime.now(UTC):%Y%m%dT%H%M%S%f}-"
        f"{uuid.uuid4().hex[:8]}.parquet",
        buf.getvalue(),
    )


def _steps(group: int) -> list:
    return [e for e in sample_group(RUN, f"g{group}", [SHA], seed=group) if type(e).__name__ == "StepRecorded"]


def _small_files(root: str, groups: int = 40) -> tuple[int, list[str]]:
    """One small file per group's steps (as a writer flushing every 0.25 s leaves them)."""
    steps = 0
    for g in range(groups):
        _write_steps(root, _steps(g))
        steps += len(_steps(g))
    fs, r = ledger_filesystem(StackSettings(ledger_uri=root))
    return steps, list_parquet(fs, r)


def test_compaction_merges_sorts_and_queries_meanwhile_see_every_row_once(tmp_path):
    root = str(tmp_path / "ledger")
    steps, files = _small_files(root)
    fs, r = ledger_filesystem(StackSettings(ledger_uri=root))
    last_flush = ClaimedFile(files[-1], "StepRecorded", ((0, 1),))
    Journal(fs, r).claim("awrl.rollout", 0, None, 100, [last_flush], "c")  # a writer's last flush: left alone
    seen, errors, stop = [], [], threading.Event()

    def query_loop():
        while not stop.is_set():
            try:
                seen.append(
                    connect(root)
                    .execute(
                        "SELECT count(*), count(DISTINCT event_id) FROM step_recorded WHERE run_id = $run", {"run": RUN}
                    )
                    .fetchone()
                )
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
    result = compact_ledger(
        StackSettings(ledger_uri=root), RUN, CompactionConfig(min_age_s=0, grace_s=0, abandoned_s=0)
    )
    assert result["StepRecorded"].deleted == 1 and result["StepRecorded"].rows == steps
    assert connect(root).execute("SELECT count(*), count(DISTINCT event_id) FROM step_recorded").fetchone() == (
        steps,
        steps,
    )


# --- passes that overlap (issue: safe compaction) ---------------------------------------------------


def _aged(root: str, groups: int = 40) -> tuple[int, list[str]]:
    """Small files older than the default `min_age_s`, as a live run's are a minute on."""
    steps, files = _small_files(root, groups)
    past = time.time() - 120
    for f in files:
        os.utime(f, (past, past))
    return steps, files


def _counts(root: str) -> tuple[int, int]:
    """(rows, distinct event ids) in the files a reader lists: as stored, before any view's dedupe."""
    fs, r = ledger_filesystem(StackSettings(ledger_uri=root))
    steps = list_parquet(fs, f"{r}/run_id={RUN}/event_type=StepRecorded")
    ids = [i for p in steps for i in pq.read_table(p, columns=["event_id"]).column(0).to_pylist()]
    return len(ids), len(set(ids))


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


def test_two_passes_that_listed_the_same_files_at_once_commit_at_most_once(tmp_path):
    """Both chose the same files and are held before writing their claims, then released: the one that
    lists after the other's claim gives way (both do if both claimed before either listed; two passes
    both committing would need a conditional write to order them). A pass after them merges what is left."""
    root = str(tmp_path / "ledger")
    steps, files = _aged(root)
    fs, r = ledger_filesystem(StackSettings(ledger_uri=root))
    gate = _Gate(2, "pending")

    def one():
        return compact_run(fs, r, RUN, CompactionConfig(), gate)["StepRecorded"]

    results = _together(one, one)
    assert sum(x.yielded for x in results) >= 1 and _counts(root) == (steps, steps)
    again = compact_ledger(StackSettings(ledger_uri=root), RUN)["StepRecorded"]
    assert sum(x.rows for x in results) + again.rows == steps and _counts(root) == (steps, steps)


def test_two_passes_that_claim_before_either_checks_both_give_way(tmp_path):
    """The same, scheduled: both claims written before either pass lists again (Dekker's case)."""
    root = str(tmp_path / "ledger")
    steps, files = _aged(root, groups=12)
    fs, _ = ledger_filesystem(StackSettings(ledger_uri=root))
    one, two = (compaction_steps(fs, _directory(files), set(), CompactionConfig(), write_atomic) for _ in "12")
    for p in (one, two):
        _until(p, "claim")
    for p in (one, two):
        next(p)  # its claim written
    for p in (one, two):
        _until(p, "delete")  # checked: the other's claim is there, so its own goes
    assert run(one).yielded and run(two).yielded and _counts(root) == (steps, steps)
    assert not list((tmp_path / "ledger").rglob("_compaction-*.json"))  # each removed its claim


def _until(steps, action: str) -> str:
    """Run a pass or reader up to (not into) its next storage action that starts with `action`."""
    while not (label := next(steps)).startswith(action):
        pass
    return label


def _directory(files: list[str]) -> str:
    return files[0].rsplit("/", 1)[0]


@pytest.mark.parametrize("pause", ["write", "commit"])
@pytest.mark.parametrize("safeguards", [SAFE, Safeguards(claims=False)], ids=["protocol", "control"])
def test_a_pass_stalled_before_it_writes_or_commits_never_doubles_rows(tmp_path, pause, safeguards):
    """Issue 41's first fault. Pass B lists, claims and reads the files, and stalls before its output
    (`write`) or just before its commit (`commit`); for longer than `abandoned_s`, so pass A may take its
    claim over, and A commits; past the grace a third pass finishes A (the sources, then A's manifest);
    B resumes. With the protocol: a B still writing finds its sources gone at its check and gives way;
    a B past its check keeps its sources (A finds nothing to merge) and commits alone. The control, this
    module's check before the issue (committed manifests only): B commits too, every row twice."""
    root = str(tmp_path / "ledger")
    steps, files = _aged(root, groups=12)
    fs, _ = ledger_filesystem(StackSettings(ledger_uri=root))
    config, now = CompactionConfig(), [time.time()]

    def one(name: str):
        return compaction_steps(
            fs, _directory(files), set(), config, write_atomic, clock=lambda: now[0], name=name, safeguards=safeguards
        )

    b = one("b")
    _until(b, f"{pause} ")  # not "committing"
    now[0] += config.abandoned_s
    a = run(one("a"))
    now[0] += config.grace_s
    finisher = run(one("finisher"))
    late = run(b)
    if safeguards is SAFE:
        assert _counts(root) == (steps, steps)
        if pause == "write":
            assert a.rows == steps and finisher.deleted == len(files) and late.yielded
        else:
            assert a.rows == 0 and late.rows == steps and not late.yielded
    else:
        assert a.rows == late.rows == steps and finisher.deleted == len(files)
        assert _counts(root) == (2 * steps, steps)  # the fault: every row twice, for good


@pytest.mark.parametrize("safeguards", [SAFE, Safeguards(listed_outputs=False)], ids=["protocol", "control"])
def test_a_reader_that_lists_during_a_commit_sees_every_row_once(tmp_path, safeguards):
    """Issue 41's second fault. A reader lists while a pass's claim (a pending manifest) is there and its
    output is not; the pass writes its output and commits; the reader then reads the manifest: committed.
    With the protocol it hides the sources only from a reader that listed all its outputs, so this one
    reads the sources. The control, hiding them from every reader: every row missing from that read."""
    root = str(tmp_path / "ledger")
    steps, files = _aged(root, groups=12)
    fs, _ = ledger_filesystem(StackSettings(ledger_uri=root))
    merge = compaction_steps(fs, _directory(files), set(), CompactionConfig(), write_atomic)
    _until(merge, "write")  # its claim is written
    reader = view_steps(fs, _directory(files))
    _until(reader, "read")  # listed: the claim and the sources, no output
    assert not run(merge).yielded  # committed
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in run(reader).live(safeguards))
    assert rows == (steps if safeguards is SAFE else 0)
    assert _counts(root) == (steps, steps)  # a reader that lists now: the output


def test_a_reader_whose_listed_manifest_vanishes_lists_again(tmp_path):
    """A reader lists a committed pass's manifest, its sources and outputs; a finisher deletes the sources,
    then the manifest, before the reader reads it. `view_steps` lists again: the outputs alone. The
    control, one listing whose vanished manifest is skipped (`manifest_rule`): sources and outputs both,
    every row twice (here the sources are gone, so the read fails instead)."""
    root = str(tmp_path / "ledger")
    steps, files = _aged(root, groups=12)
    fs, _ = ledger_filesystem(StackSettings(ledger_uri=root))
    assert run(compaction_steps(fs, _directory(files), set(), CompactionConfig(), write_atomic)).rows == steps
    reader = view_steps(fs, _directory(files))
    _until(reader, "read")
    listed = set(_listing(fs, _directory(files)))
    later = time.time() + CompactionConfig().grace_s
    assert run(
        compaction_steps(fs, _directory(files), set(), CompactionConfig(), write_atomic, clock=lambda: later)
    ).deleted == len(files)
    live = run(reader).live()
    assert len(live) == 1 and sum(pq.ParquetFile(p).metadata.num_rows for p in live) == steps
    hidden, invisible = manifest_rule(fs, listed)
    assert len([p for p in listed if p.endswith(".parquet") and p not in hidden | invisible]) == len(files) + 1


def _listing(fs, directory: str) -> list[str]:
    return [i.path for i in fs.get_file_info(pafs.FileSelector(directory)) if i.type == pafs.FileType.File]


@pytest.mark.parametrize("dedupe", [True, False], ids=["protocol", "control"])
def test_a_merge_keeps_one_row_per_event_id(tmp_path, dedupe):
    """A batch the ledger holds twice (as a fault upstream would leave it) is once in the merged file."""
    root = str(tmp_path / "ledger")
    steps, files = _aged(root, groups=6)
    again = pq.ParquetFile(files[0]).metadata.num_rows
    write_atomic(f"{_directory(files)}/part-again.parquet", open(files[0], "rb").read())  # the same events
    assert _counts(root) == (steps + again, steps)
    fs, _ = ledger_filesystem(StackSettings(ledger_uri=root))
    merged = run(
        compaction_steps(
            fs,
            _directory(files),
            set(),
            CompactionConfig(min_age_s=0),
            write_atomic,
            safeguards=Safeguards(dedupe=dedupe),
        )
    )
    assert merged.rows == steps + (0 if dedupe else again)
    assert _counts(root) == (merged.rows, steps)


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
        return dg.materialize(
            [compaction],
            partition_key=RUN,
            instance=instance,
            resources={"ledger": ledger, "io_manager": ParquetIOManager(ledger=ledger)},
        )

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

def put(path, data):  # SIGKILL with the outputs written, the claim still pending
    if path.endswith(".json") and b'"state": "committing"' in data:
        os.kill(os.getpid(), signal.SIGKILL)
    write_atomic(path, data)

fs, root = ledger_filesystem(StackSettings(ledger_uri=sys.argv[1]))
compact_run(fs, root, sys.argv[2], CompactionConfig(), put)
"""


def test_a_pass_killed_half_way_holds_its_files_until_its_claim_is_abandoned(tmp_path):
    """A pass SIGKILLed with its outputs written and its claim pending: its files stay invisible; its
    sources stay claimed for `abandoned_s` (nothing tells a dead pass from a stalled one), then the next
    pass takes the claim over and merges them; the dead pass's outputs go, and a tombstone stays, so
    that they would stay invisible even if it were only stalled and wrote more."""
    root = str(tmp_path / "ledger")
    steps, _ = _aged(root)
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_PASS, root, RUN],
        cwd=os.getcwd(),
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert killed.returncode == -9
    orphans = list((tmp_path / "ledger").rglob("part-compact-*.parquet"))
    assert orphans and _counts(root) == (steps, steps)
    settings = StackSettings(ledger_uri=root)
    assert compact_ledger(settings, RUN)["StepRecorded"].rows == 0  # claimed, not yet abandoned
    again = compact_ledger(settings, RUN, CompactionConfig(abandoned_s=0))["StepRecorded"]
    assert again.rows > 0 and not again.yielded and _counts(root) == (steps, steps)
    compact_ledger(settings, RUN, CompactionConfig(grace_s=0, abandoned_s=0))
    assert not [p for p in orphans if p.exists()] and _counts(root) == (steps, steps)
    tombstones = [json.loads(p.read_text()) for p in (tmp_path / "ledger").rglob("_compaction-*.json")]
    assert [t["state"] for t in tombstones] == ["aborted"]
