"""The ledger's promises checked (`analysis.verify`, `awrl ledger verify`) and kept by the views: each
violation planted in a small ledger, found by its check and counted once by every view."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from analysis import VIEWS, connect, drift_metrics
from analysis.verify import CHECKS, OUTBOX, verify
from app import cli
from pipeline.outbox import Outbox
from schemas import PolicyVersionPublished, encode_event

from test_analysis import run_r1, run_r2, write_ledger

SHA = "ab" * 32


def versions(run: str, *pairs: tuple[int, int | None]) -> list[PolicyVersionPublished]:
    """PolicyVersionPublished events of (version, parent version)."""
    return [
        PolicyVersionPublished(
            run_id=run, version=v, parent_version=p, checkpoint_uri=f"s3://awrl/ckpt/{v}", checkpoint_sha256=SHA
        )
        for v, p in pairs
    ]


def sound() -> list:
    return run_r1() + run_r2() + versions("r1", (0, None), (1, 0), (2, 1))


def without(events: list, trajectory_id: str, step: int) -> list:
    return [
        e
        for e in events
        if not (type(e).__name__ == "StepRecorded" and e.trajectory_id == trajectory_id and e.step == step)
    ]


def same_drift(a: dict, b: dict) -> bool:
    """Equal drift reports, floats to rounding: the rows come in another order, so sums do too."""
    flat = {k: v for k, v in b.items() if isinstance(v, float)}
    return {k: v for k, v in a.items() if k not in flat} == {k: v for k, v in b.items() if k not in flat} and {
        k: a[k] for k in flat
    } == pytest.approx(flat)


def found(root, run_id: str | None = "r1", outbox_dir=None) -> dict[str, list[dict]]:
    with connect(root) as con:
        return {f.kind: f.rows for f in verify(con, run_id, outbox_dir)}


def copy_files(root, run_id: str, event_type: str) -> None:
    """Every file of one run and type written again beside itself (two passes that both committed)."""
    for name in os.listdir(directory := root / f"run_id={run_id}" / f"event_type={event_type}"):
        shutil.copy(directory / name, directory / name.replace(".parquet", "-copy.parquet"))


def test_a_sound_ledger_has_no_finding(tmp_path):
    write_ledger(tmp_path, sound())
    assert found(tmp_path) == {kind: [] for kind in CHECKS}
    assert found(tmp_path, None) == {kind: [] for kind in CHECKS}


def test_a_row_written_twice_is_found_and_every_view_shows_it_once(tmp_path):
    write_ledger(tmp_path, sound())
    with connect(tmp_path) as con:
        before = {v: con.execute(f"SELECT * FROM {v} ORDER BY ALL").fetchall() for v in VIEWS}
        drift = drift_metrics(con, "r1").to_dict()
    copy_files(tmp_path, "r1", "StepRecorded")
    copy_files(tmp_path, "r1", "GroupCompleted")
    rows = found(tmp_path)["duplicates"]
    assert {(r["event_type"], r["copies"]) for r in rows} == {("StepRecorded", 2), ("GroupCompleted", 2)}
    assert len(rows) == 10 + 2  # r1's 10 steps and 2 groups
    assert found(tmp_path, "r2")["duplicates"] == []  # another run's copies are not r2's
    with connect(tmp_path) as con:
        assert con.execute("SELECT count(*) FROM step_recorded_stored WHERE run_id = 'r1'").fetchone() == (20,)
        assert con.execute("SELECT count(*) FROM step_recorded WHERE run_id = 'r1'").fetchone() == (10,)
        assert {v: con.execute(f"SELECT * FROM {v} ORDER BY ALL").fetchall() for v in VIEWS} == before
        assert same_drift(drift_metrics(con, "r1").to_dict(), drift)


def test_a_copy_in_both_kinds_of_step_file_counts_once(tmp_path):
    """A compaction output (with token summaries) beside its older sources (without): the token pass
    reads the summarized copy, the other is left out."""
    events = sound()
    write_ledger(tmp_path / "old", events)
    write_ledger(tmp_path / "new", events, summaries=lambda is_a: True)
    with connect(tmp_path / "old") as con:
        drift = drift_metrics(con, "r1").to_dict()
    shutil.copytree(tmp_path / "new", tmp_path / "old", dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "new")  # the copy holds the same event ids in both kinds of file
    with connect(tmp_path / "old") as con:
        assert con.execute(
            "SELECT (SELECT count(*) FROM step_recorded_summarized), "
            "(SELECT count(*) FROM step_recorded_unsummarized), "
            "(SELECT count(*) FROM step_token_summary)"
        ).fetchone() == (11, 0, 11)
        assert same_drift(drift_metrics(con, "r1").to_dict(), drift)
    assert len(found(tmp_path / "old")["duplicates"]) == len(events) - len(run_r2())  # every event of r1


@pytest.mark.parametrize("trajectory_id, step", [("B", 1), ("B", 3)], ids=["gap", "last"])
def test_a_missing_step_is_found(tmp_path, trajectory_id, step):
    """A gap in the indices, or a lost last step (no gap: the group names 4 steps, 3 are there)."""
    write_ledger(tmp_path, without(sound(), trajectory_id, step))
    (row,) = found(tmp_path)["missing_steps"]
    assert (row["trajectory_id"], row["group_id"], row["steps_named"], row["steps_recorded"]) == ("B", "g1", 4, 3)


def test_version_gaps_and_broken_lineage_are_found(tmp_path):
    events = run_r1() + versions("r1", (0, None), (1, 0), (3, 2), (4, 1))  # 2 missing; 4 not trained from 3
    write_ledger(tmp_path, events)
    rows = found(tmp_path)["version_gaps"]
    assert [(r["version"], r["previous_version"], r["parent_version"]) for r in rows] == [(3, 1, 2), (4, 3, 1)]


def test_events_left_in_an_outbox_are_found(tmp_path):
    events = sound()
    write_ledger(tmp_path / "ledger", events[1:])  # the first event is still only in the outbox
    outbox = Outbox(tmp_path / "outbox" / "awrl.rollout.sqlite")
    for e in events[:2]:  # the second is in the ledger: only its confirmation is late
        outbox.add(e.event_id, "rollout", None, encode_event(e), [])
    outbox.close()
    rows = found(tmp_path / "ledger", "r1", tmp_path / "outbox")[OUTBOX]
    assert [(r["event_id"], r["in_ledger"]) for r in rows] == sorted(
        [(events[0].event_id, False), (events[1].event_id, True)]
    )
    assert found(tmp_path / "ledger", "r2", tmp_path / "outbox")[OUTBOX] == []
    assert found(tmp_path / "ledger", "r1", tmp_path / "empty")[OUTBOX] == []


@pytest.fixture()
def awrl(tmp_path, monkeypatch, capsys):
    """`awrl <args>` through the real entry point: (exit code, stdout, stderr); settings only from here."""
    for name in [k for k in os.environ if k.startswith("AWRL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no .env, no local stack
    monkeypatch.setenv("AWRL_OUTBOX_DIR", str(tmp_path / "outbox"))

    def run(*args) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as done:
            cli.main(["ledger", "verify", *map(str, args)])
        out = capsys.readouterr()
        return done.value.code, out.out, out.err

    return run


def test_cli_exits_0_on_a_sound_ledger_and_1_with_one_line_per_kind(tmp_path, awrl):
    write_ledger(tmp_path / "ledger", sound())
    code, out, err = awrl("r1", "--ledger-uri", tmp_path / "ledger")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "duplicates: 0",
        "missing steps: 0",
        "version gaps: 0",
        "unconfirmed outbox: 0",
        "judge errors: 0",
    ]

    events = without(sound(), "C", 2) + versions("r1", (4, 3))
    write_ledger(tmp_path / "bad", events[1:])
    copy_files(tmp_path / "bad", "r1", "UpdateApplied")
    outbox = Outbox(tmp_path / "outbox" / "awrl.rollout.sqlite")
    outbox.add(events[0].event_id, "rollout", None, encode_event(events[0]), [])
    outbox.close()
    code, out, err = awrl("r1", "--ledger-uri", tmp_path / "bad")
    assert code == 1 and err.count("\n") == 1, err
    assert "3 duplicates, 1 missing steps, 1 version gaps, 1 unconfirmed outbox" in err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "duplicates",
        "missing steps",
        "version gaps",
        "unconfirmed outbox",
        "judge errors",
    ]
    assert lines[1].startswith("missing steps: 1 trajectories with a step missing (e.g. run_id r1, trajectory_id C")

    code, out, _ = awrl("--format", "json", "--ledger-uri", tmp_path / "bad")  # every run
    assert code == 1
    assert {f["kind"]: f["count"] for f in json.loads(out)} == {
        "duplicates": 3,
        "missing_steps": 1,
        "version_gaps": 1,
        "unconfirmed_outbox": 1,
    }
    code, _, err = awrl("nosuch", "--ledger-uri", tmp_path / "bad")
    assert code == 2 and err.startswith("error: no run 'nosuch' in the ledger")


def test_the_soak_counts_a_row_written_twice(settings, tmp_path):
    """`read_events` and the views read each event id once, so the chaos soak's reconciliation
    (`bench/chaos_reconcile.py`) counts the stored rows: a step file written twice is every step twice."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from chaos_reconcile import Reconciliation, reconcile

    events = sound()
    write_ledger(tmp_path, events)
    copy_files(tmp_path, "r1", "StepRecorded")
    steps = sum(1 for e in events if type(e).__name__ == "StepRecorded" and e.run_id == "r1")
    r = reconcile(Reconciliation(0, []), settings.model_copy(update={"ledger_uri": str(tmp_path)}), "r1", set(), 2)
    assert steps > 0 and r.duplicated == steps and not r.ok
    assert f"duplicates: {steps} event ids stored more than once" in "\n".join(r.lines())
