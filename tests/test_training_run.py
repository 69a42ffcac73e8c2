"""`awrl run` smoke tests with a tiny budget: each schedule runs the pool, the trainer and the ledger
writer together, updates the policy, and leaves the whole run in the ledger; its TensorBoard files,
written live, match the ledger, and the viewer shows its real browser steps with their marks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from analysis.views import connect
from app.training import RunConfig, run_training
from trainer.config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

UPDATES = 2
"""The run's budget: it ends once the trainer has made this many updates."""
CAP_MINUTES = 15.0
"""Only a cap: an idle 2-core machine makes the updates in well under a minute."""


# The async schedule is exercised end to end by `awrl demo`'s test and by test_train_e2e.
@pytest.mark.parametrize("mode", ["sync"])
def test_a_short_run_trains_and_reaches_the_ledger(settings, tmp_path, mode):
    settings = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    # budgeted in updates: the run ends when the trainer has made them; the minutes are only a cap that
    # a loaded machine may reach, and then the assertion names how far it got
    config = RunConfig(
        mode=mode,
        minutes=CAP_MINUTES,
        rollout=replace(RunConfig().rollout, policy="demo", noise=0.5),
        train=TrainConfig(run_id="", groups_per_update=1, dynamic_sampling=False, max_updates=UPDATES),
        log_dir=tmp_path / "runs",
        tensorboard=tmp_path / "tb",
    )
    seen = []
    summary = run_training(settings, config, on_progress=seen.append)
    print(f"\n{mode}: {summary}")
    assert summary.updates == UPDATES and summary.version == UPDATES and seen, (
        f"{summary.updates} of {UPDATES} updates within the {CAP_MINUTES}-minute cap: {summary}"
    )
    assert summary.episodes > 0 and not summary.stopped
    assert 0 < summary.record_share < 1 and summary.ledger_share is not None and summary.ledger_share > 0
    con = connect(settings.ledger_uri)
    rows = con.sql(f"select count(*) from updates where run_id = '{summary.run_id}'").fetchall()[0][0]
    assert rows == summary.updates
    assert con.sql(f"select count(*) from trajectories where run_id = '{summary.run_id}'").fetchall()[0][0] > 0
    assert (tmp_path / "runs" / summary.run_id / "trainer.log").stat().st_size > 0
    _tensorboard_matches_the_ledger(con, summary.run_id, tmp_path / "tb")
    _the_viewer_shows_a_real_step(settings, con, summary.run_id)


def test_the_trainer_and_the_pool_split_the_cores_when_they_compute_at_once():
    """Every process at torch's default gets every core, and OpenMP threads spin-wait on each other's
    (bench/threads.py): async with a local model splits them; sync takes turns; an explicit count wins."""
    from app.training import _threads
    from trainer.launch import thread_share

    assert [thread_share(1, 1, cores=c) for c in (1, 2, 3, 16)] == [1, 1, 1, 8]
    assert thread_share(2, 1, cores=16) == 5 and thread_share(4, 0, cores=16) == 4
    local = replace(RunConfig().rollout, policy="local")
    assert _threads(RunConfig(rollout=local)) == thread_share(1, 1)
    assert _threads(RunConfig(rollout=replace(local, policy="vllm"), nproc=2)) == thread_share(2, 0)
    assert _threads(RunConfig(mode="sync", rollout=local)) is None
    assert _threads(RunConfig(rollout=local, trainer_cpus="1")) is None
    assert _threads(RunConfig(mode="sync", rollout=local, threads=3)) == 3


def _tensorboard_matches_the_ledger(con, run_id: str, logdir) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir / run_id))
    events.Reload()
    updates = con.execute(
        "SELECT update_step, loss FROM updates WHERE run_id = $r ORDER BY update_step", {"r": run_id}
    ).fetchall()
    assert [(e.step, e.value) for e in events.Scalars("update/loss")] == [(s, pytest.approx(v)) for s, v in updates]


def _the_viewer_shows_a_real_step(settings, con, run_id: str) -> None:
    """The viewer in-process over the run: a trajectory page, and a step drawn with its recorded marks."""
    import io
    import threading
    import urllib.request

    import uvicorn
    from PIL import Image

    from app.viewer import make_app

    tid, step, marks = con.execute(
        "SELECT trajectory_id, step, len(marks) FROM steps WHERE run_id = $r AND len(marks) > 0 "
        "ORDER BY trajectory_id, step LIMIT 1",
        {"r": run_id},
    ).fetchall()[0]
    assert marks > 0  # the rollout records the Set-of-Mark elements of each screen
    server = uvicorn.Server(uvicorn.Config(make_app(settings), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.1)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        base = f"http://127.0.0.1:{port}/runs/{run_id}/trajectories/{tid}"
        html = urllib.request.urlopen(base, timeout=60).read().decode()
        assert f'id="step-{step}"' in html and "placeholder" not in html
        png = urllib.request.urlopen(f"{base}/steps/{step}.png", timeout=60).read()
        assert Image.open(io.BytesIO(png)).size[0] > 0
    finally:
        server.should_exit = True
        thread.join(10)
