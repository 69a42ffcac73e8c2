"""Dagster assets over a real (local) ledger: definitions load, every asset materializes from events
written by the ledger writer, and the `groups` advantages are the trainer's advantages."""

from __future__ import annotations

import os

import dagster as dg
import pyarrow.parquet as pq
import pytest

from analysis.drift import drift_metrics
from analysis.views import RAW_VIEWS, connect
from assets import all_assets, all_checks, defs
from assets.io import Ledger, ParquetIOManager
from assets.sensors import ledger_sensor
from pipeline.ledger import LedgerWriter
from pipeline.settings import StackSettings
from schemas import BY_NAME, PolicyVersionPublished, RankMemory, UpdateApplied, arrow_schema
from trainer.advantages import group_advantages, informative

from samples import sample_group

SHA = "ab" * 32
RUN = "run-a"
VIEW_ASSETS = {
    "steps": "trajectory_id, step",
    "trajectories": "started_at nulls last, trajectory_id",
    "groups": "completed_at, group_id",
    "policy_versions": "version",
    "updates": "update_step",
}
"""The assets that are views of `analysis/sql/`, with the order each is written in."""
ASSETS = (
    "compaction",
    "steps",
    "trajectories",
    "groups",
    "policy_versions",
    "updates",
    "throughput",
    "memory_drift",
    "learning_curve",
    "judge_agreement",
)
pytestmark = pytest.mark.filterwarnings("ignore:InitResourceContext.dagster_run:DeprecationWarning")  # Dagster's own


def write_sample_run(root: str, run_id: str = RUN, groups: int = 2) -> dict[str, list]:
    """Write a small run (two GRPO groups, one update, two versions) through `LedgerWriter`."""
    events = [e for g in range(groups) for e in sample_group(run_id, f"g{g}", [SHA], seed=g)]
    events += [
        PolicyVersionPublished(
            run_id=run_id,
            version=v,
            checkpoint_uri=f"s3://awrl/ckpt/{v}",
            checkpoint_sha256=SHA,
            update_step=v - 1 if v else None,
        )
        for v in (0, 1)
    ]
    trained = [e.trajectory_id for e in events if type(e).__name__ == "EpisodeFinished"]
    events.append(
        UpdateApplied(
            run_id=run_id,
            update_step=0,
            version_before=0,
            version_after=1,
            group_ids=[f"g{g}" for g in range(groups)],
            trajectory_ids=trained,
            loss=0.5,
            grad_norm=1.0,
            stats={"clip_frac": 0.1},
            config_json="{}",
            weights_sha256=SHA,
            duration_s=0.2,
            world_size=2,
            memory=[
                RankMemory(
                    rank=r,
                    params_bytes=400,
                    grads_bytes=400,
                    optimizer_bytes=800 + r,
                    peak_bytes=10_000 * (r + 1),
                    device="cpu",
                )
                for r in range(2)
            ],
        )
    )
    by_type: dict[str, list] = {}
    for e in events:
        by_type.setdefault(type(e).__name__, []).append(e)
    writer = LedgerWriter(StackSettings(ledger_uri=root))
    for event_type, batch in by_type.items():
        writer._write(run_id, event_type, batch)
    return by_type


def materialize_run(
    root: str, run_id: str = RUN, raise_on_error: bool = True, selection=None
) -> tuple[dg.ExecuteInProcessResult, dg.DagsterInstance]:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", [run_id])
    ledger = Ledger(ledger_uri=root)
    result = dg.materialize(
        [*all_assets, *all_checks],
        partition_key=run_id,
        instance=instance,
        resources={"ledger": ledger, "io_manager": ParquetIOManager(ledger=ledger)},
        raise_on_error=raise_on_error,
        selection=selection,
    )
    return result, instance


def check_results(result: dg.ExecuteInProcessResult) -> dict[str, bool]:
    return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}


def test_definitions_load_with_the_events_at_the_top_of_the_graph():
    dg.Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    nodes = {k.to_user_string(): graph.get(k) for k in graph.get_all_asset_keys()}
    assert set(nodes) == set(ASSETS) | set(RAW_VIEWS) | {"replay"}  # replay: launched by a person
    assert repo.has_sensor_def("ledger_sensor")
    for name in RAW_VIEWS:  # the writer's tables: shown with their columns, never materialized by Dagster
        node = nodes[name]
        assert not node.is_materializable and node.group_name == "events"
        columns = [c.name for c in node.metadata["dagster/column_schema"].columns]
        assert columns == arrow_schema(RAW_VIEWS[name]).names
    for name in (*ASSETS, "replay"):  # every table says what it reads: the graph starts at the events
        node = nodes[name]
        assert node.is_materializable and node.group_name in {"events", "trajectories", "training", "analysis"}
        assert node.kinds and (node.parent_keys or name == "compaction"), name
    roots = {n for n, node in nodes.items() if not node.parent_keys}
    assert roots == set(RAW_VIEWS) | {"compaction"}


def test_each_table_asset_is_its_view_row_for_row(run):
    """One definition per table: the asset is the view of the same name (`analysis/sql/`), for the run."""
    root, _, _ = run
    con = connect(root)
    for name, order in VIEW_ASSETS.items():
        view = con.sql(f"select * from {name} where run_id = $run order by {order}", params={"run": RUN})
        asset = _table(root, name)
        assert asset.num_rows > 0 and asset.schema.names == view.columns, name
        assert asset.to_pylist() == view.to_arrow_table().to_pylist(), name


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ledger"))
    events = write_sample_run(root)
    result, _ = materialize_run(root)
    return root, events, result


def _table(root: str, asset: str, run_id: str = RUN):
    return pq.read_table(os.path.join(root, "assets", asset, f"run_id={run_id}", "data.parquet"))


def test_assets_materialize_with_row_counts(run):
    root, events, result = run
    assert result.success
    n_steps, n_traj = len(events["StepRecorded"]), len(events["EpisodeStarted"])
    expected = {
        "steps": n_steps,
        "trajectories": n_traj,
        "groups": 2,
        "policy_versions": 2,
        "updates": 1,
        "memory_drift": 1,
        "learning_curve": 1,
    }  # every sample episode runs on version 0
    for asset, rows in expected.items():
        assert _table(root, asset).num_rows == rows, asset
        meta = result.asset_materializations_for_node(asset)[0].metadata
        assert meta["dagster/row_count"].value == rows, asset
    traj = _table(root, "trajectories").to_pylist()
    assert sum(t["num_steps"] for t in traj) == n_steps
    assert {t["outcome"] for t in traj} <= {"success", "failure"}
    assert _table(root, "throughput").column("steps").to_pylist() == [n_steps]  # written within a minute
    (update,) = _table(root, "updates").to_pylist()
    assert (update["peak_bytes_max_rank"], update["state_bytes_max_rank"]) == (20_000, 1601)  # the larger rank
    (curve,) = _table(root, "learning_curve").to_pylist()
    finished = events["EpisodeFinished"]
    assert (curve["policy_version"], curve["trajectories"], curve["successes"]) == (
        0,
        len(finished),
        sum(f.outcome == "success" for f in finished),
    )
    for asset, plot in (
        ("trajectories", "success_rate_curve"),
        ("memory_drift", "keys_by_step_curve"),
        ("learning_curve", "success_by_version_curve"),
    ):
        png = result.asset_materializations_for_node(asset)[0].metadata[plot].value
        assert "](data:image/png;base64," in png, asset
    # links into the trajectory viewer (`awrl view`), where the rows can be looked at one by one
    links = {
        a: result.asset_materializations_for_node(a)[0].metadata["viewer"].value for a in ("trajectories", "updates")
    }
    assert links == {
        "trajectories": f"http://127.0.0.1:8765/runs/{RUN}",
        "updates": f"http://127.0.0.1:8765/runs/{RUN}/updates/0",
    }


def test_every_check_passes_on_a_sound_run(run):
    _, _, result = run
    checks = check_results(result)
    assert len(checks) == sum(len(c.check_keys) for c in all_checks) == 12
    assert all(checks.values()), checks


def _planted(tmp_path, plant, assets: list[str]) -> tuple[dict[str, bool], set[str]]:
    """A sound sample run with one violation planted by `plant(events_by_type, writer)`; the checks'
    results and which of `assets` (with their checks) materialized."""
    root = str(tmp_path / "ledger")
    events = write_sample_run(root)
    plant(events, LedgerWriter(StackSettings(ledger_uri=root)))
    result, _ = materialize_run(root, raise_on_error=False, selection=assets)
    done = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    return check_results(result), done


def test_a_duplicated_event_fails_its_check_and_blocks_what_reads_it(tmp_path):
    checks, done = _planted(
        tmp_path,
        lambda ev, w: w._write(RUN, "StepRecorded", ev["StepRecorded"][:1]),
        ["steps", "trajectories", "throughput", "memory_drift"],
    )
    assert checks["steps_event_id_unique"] is False and checks["trajectories_one_row_each"] is True
    assert {"steps", "trajectories"} <= done and not done & {"throughput", "memory_drift"}  # blocked downstream


def test_a_lost_step_fails_the_numbering_check(tmp_path):
    def plant(ev, w):  # the ledger holds step 1 of a trajectory without its step 0: rewrite the run
        import shutil

        shutil.rmtree(os.path.join(w.root, f"run_id={RUN}", "event_type=StepRecorded"))
        first = ev["StepRecorded"][0]
        w._write(
            RUN,
            "StepRecorded",
            [e for e in ev["StepRecorded"] if not (e.trajectory_id == first.trajectory_id and e.step == 0)],
        )

    checks, _ = _planted(tmp_path, plant, ["steps"])
    assert checks["steps_numbered_without_gaps"] is False and checks["steps_event_id_unique"] is True


def test_a_broken_version_lineage_fails_its_check(tmp_path):
    gap = PolicyVersionPublished(
        run_id=RUN, version=2, checkpoint_uri="s3://awrl/ckpt/3", checkpoint_sha256=SHA, update_step=1, parent_version=0
    )  # 2 trained from 0: 1 is not its parent
    checks, _ = _planted(tmp_path, lambda ev, w: w._write(RUN, "PolicyVersionPublished", [gap]), ["policy_versions"])
    assert checks["policy_versions_contiguous"] is False


def test_advantages_that_do_not_sum_to_zero_fail_their_check(tmp_path, monkeypatch):
    """An estimator that forgets to subtract the group mean (planted in the function the view calls)."""
    monkeypatch.setattr("analysis.views.group_advantages", lambda rewards: [float(r) for r in rewards])
    checks, _ = _planted(tmp_path, lambda ev, w: None, ["groups"])
    assert checks["group_advantages_sum_to_zero"] is False and checks["groups_event_id_unique"] is True


@pytest.mark.parametrize("policy_version, tokens", [(1, 0), (0, 5)])  # older than its step; never published
def test_a_mislabelled_token_version_fails_its_check(tmp_path, policy_version, tokens):
    def plant(ev, w):
        import shutil

        shutil.rmtree(os.path.join(w.root, f"run_id={RUN}", "event_type=StepRecorded"))
        first, *rest = ev["StepRecorded"]
        wrong = first.model_copy(
            update={
                "policy_version": policy_version,
                "token_policy_versions": [tokens] * len(first.token_policy_versions),
            }
        )
        w._write(RUN, "StepRecorded", [wrong, *rest])

    checks, done = _planted(tmp_path, plant, ["steps", "throughput"])
    assert checks["token_versions_match_their_step"] is False and checks["steps_event_id_unique"] is True
    assert "throughput" not in done  # blocking


def test_staleness_beyond_eta_fails_its_check(tmp_path):
    def plant(ev, w):
        (u,) = ev["UpdateApplied"]
        w._write(
            RUN,
            "UpdateApplied",
            [
                u.model_copy(
                    update={
                        "event_id": f"{u.event_id}-2",
                        "update_step": 1,
                        "config_json": '{"eta": 2}',
                        "stats": {**u.stats, "staleness_max": 3.0},
                    }
                )
            ],
        )

    checks, _ = _planted(tmp_path, plant, ["updates"])
    assert checks["staleness_within_eta"] is False and checks["updates_event_id_unique"] is True


def test_dead_letters_of_the_run_warn_with_their_reasons(settings, tmp_path, monkeypatch):
    """A real broker: a malformed message naming the run is refused by the ledger writer, as in
    production, which keeps it in the ledger's `_dead_letters/`; the check reads it there and warns (it
    blocks nothing: the letter is kept)."""
    from pipeline.bus import EventProducer, create_topics
    from pipeline.ledger import LedgerWriter
    from pipeline.topics import ROLLOUT

    create_topics(settings)
    for key, value in settings.environ().items():
        monkeypatch.setenv(key, value)
    root = str(tmp_path / "ledger")
    write_sample_run(root)
    clean, _ = materialize_run(root, raise_on_error=False, selection=["steps"])
    assert check_results(clean)["dead_letters"] is True

    producer = EventProducer(settings)
    producer.send_raw(ROLLOUT, f'{{"event_type": "StepRecorded", "run_id": "{RUN}"}}'.encode(), b"k").get(timeout=10)
    producer.close()
    written = LedgerWriter(settings.model_copy(update={"ledger_uri": root})).sync(idle_exit_s=3.0)
    assert written.dead_lettered == 1
    result, _ = materialize_run(root, raise_on_error=False, selection=["steps", "trajectories", "throughput"])
    (evaluation,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "dead_letters"]
    assert evaluation.passed is False and evaluation.severity == dg.AssetCheckSeverity.WARN
    assert evaluation.metadata["dead_letters"].value == 1
    assert "invalid event" in next(iter(evaluation.metadata["reasons"].value))
    assert {"steps", "throughput"} <= {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}


def test_replay_of_a_run_without_stored_checkpoints_says_why(tmp_path):
    """The sample run's checkpoints are names only: "Materialize all" must not fail on its replay."""
    from assets import replay_assets

    root = str(tmp_path / "ledger")
    write_sample_run(root)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", [RUN])
    ledger = Ledger(ledger_uri=root)
    result = dg.materialize(
        replay_assets,
        partition_key=RUN,
        instance=instance,
        resources={"ledger": ledger, "io_manager": ParquetIOManager(ledger=ledger)},
    )
    (event,) = result.get_asset_materialization_events()
    why = event.materialization.metadata["not_replayed"].value
    assert ("object store" in why or "S3 credentials" in why) and (
        event.materialization.metadata["dagster/row_count"].value == 0
    )
    (check,) = result.get_asset_check_evaluations()
    assert check.passed is False and check.severity == dg.AssetCheckSeverity.WARN


def test_memory_drift_is_the_analysis_report(run):

    root, events, _ = run
    (row,) = _table(root, "memory_drift").to_pylist()
    report = drift_metrics(connect(root), RUN).to_dict()
    assert row == report
    assert row["steps"] == len(events["StepRecorded"]) and row["keys_by_step"]  # sample memory grows per step


def test_groups_advantages_match_the_trainer_function(run):
    root, events, _ = run
    rows = {r["group_id"]: r for r in _table(root, "groups").to_pylist()}
    for done in events["GroupCompleted"]:
        row = rows[done.group_id]
        assert row["advantages"] == group_advantages(done.rewards)
        assert row["informative"] == informative(done.rewards)


def test_sensor_refreshes_what_changed_at_most_every_interval(tmp_path, monkeypatch):
    """New runs become partitions; a change refreshes only the assets that read the changed event type,
    and not twice within `REFRESH_EVERY_S` (held back, not lost: the cursor keeps it pending)."""
    from assets import sensors

    root, clock = str(tmp_path), [1_000_000.0]
    monkeypatch.setattr(sensors.time, "time", lambda: clock[0])
    write_sample_run(root, "run-b", groups=1)
    instance = dg.DagsterInstance.ephemeral()

    def tick(cursor):
        return ledger_sensor(
            dg.build_sensor_context(
                instance=instance, cursor=cursor, definitions=defs, resources={"ledger": Ledger(ledger_uri=root)}
            )
        )

    first = tick(None)
    assert first.dynamic_partitions_requests[0].partition_keys == ["run-b"]
    (request,) = first.run_requests
    assert request.partition_key == "run-b" and {k.to_user_string() for k in request.asset_selection} == set(ASSETS)
    instance.add_dynamic_partitions("runs", ["run-b"])
    idle = tick(first.cursor)
    assert idle.run_requests == [] and idle.dynamic_partitions_requests == []

    more = list(sample_group("run-b", "g9", [SHA], seed=9))
    LedgerWriter(StackSettings(ledger_uri=root))._write(
        "run-b", "StepRecorded", [e for e in more if type(e) is BY_NAME["StepRecorded"]]
    )
    clock[0] += sensors.REFRESH_EVERY_S / 2
    held = tick(first.cursor)
    assert held.run_requests == [] and held.cursor == first.cursor  # too soon: still pending
    clock[0] += sensors.REFRESH_EVERY_S / 2
    (again,) = tick(held.cursor).run_requests
    assert again.run_key != request.run_key
    assert {k.to_user_string() for k in again.asset_selection} == {
        "compaction",
        "steps",
        "trajectories",
        "throughput",
        "memory_drift",
        "learning_curve",
    }


def test_a_run_that_just_started_materializes(tmp_path):
    """The sensor picks a run up as soon as its first file lands, so every asset copes with event types
    that have no file yet (and with episodes that have not finished)."""
    root = str(tmp_path)
    started = [e for e in sample_group("fresh", "g0", [SHA]) if type(e).__name__ == "EpisodeStarted"]
    LedgerWriter(StackSettings(ledger_uri=root))._write("fresh", "EpisodeStarted", started)
    result, _ = materialize_run(root, "fresh")
    assert result.success
    assert {t["outcome"] for t in _table(root, "trajectories", "fresh").to_pylist()} == {None}  # running
    assert _table(root, "steps", "fresh").num_rows == 0 and _table(root, "groups", "fresh").num_rows == 0


def test_ledger_writer_restarts_beside_materialized_assets(run):
    root, _, _ = run
    writer = LedgerWriter(StackSettings(ledger_uri=root))
    writer._assigned({("awrl.rollout", 0)}, None)  # no journal entries: nothing to read, whatever the ledger holds
    assert len(writer.recent) == 0 and writer.journal.loaded_files == 0


def test_assets_on_the_s3_ledger(stack, monkeypatch):
    """The same run on the stack's S3 (radosgw): events and asset files written with single PUTs,
    read back through pyarrow's S3 filesystem; credentials come from `AWRL_*` as under `dagster dev`."""
    import uuid

    from pipeline.ledger import ledger_filesystem

    settings = stack.settings().model_copy(update={"ledger_uri": f"s3://{stack.bucket}/ledger-{uuid.uuid4().hex[:8]}"})
    for line in stack.dotenv().splitlines()[1:]:
        key, value = line.split("=", 1)
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWRL_LEDGER_URI", settings.ledger_uri)
    events = write_sample_run(settings.ledger_uri, groups=1)
    assert list(Ledger().run_fingerprints()) == [RUN]
    result, _ = materialize_run(settings.ledger_uri)
    assert result.success
    fs, root = ledger_filesystem(settings)
    table = pq.read_table(f"{root}/assets/groups/run_id={RUN}/data.parquet", filesystem=fs)
    assert table.column("advantages").to_pylist() == [group_advantages(events["GroupCompleted"][0].rewards)]
    assert pq.read_table(f"{root}/assets/steps/run_id={RUN}/data.parquet", filesystem=fs).num_rows == len(
        events["StepRecorded"]
    )
