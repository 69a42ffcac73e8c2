"""`awrl run`: one training run, the rollout pool, the ledger writer and the trainer together, under
one of two schedules that differ in nothing else (same model, tasks, batch size, hyper-parameters):

- **async** (AsyncWebRL): an everlasting pool samples continuously; the dispatcher admits groups
  within the staleness budget (eta); the trainer updates whenever a batch is ready and the pool loads
  each version between steps. Rollout, training and refresh overlap.
- **sync** (WebGym): per iteration, build a fresh browser pool, collect `groups_per_update` groups,
  wait for the slowest episode, tear the pool down, let the trainer update (eta = 0: strictly
  on-policy), wait for the new version, repeat. Groups the trainer drops (all-equal rewards) are
  replaced by collecting more before the iteration's update can happen, as WebGym's dynamic sampling.

The trainer and the ledger writer are child processes (torchrun; `awrl ledger sync --follow`), stopped
by process group at the end; the ledger is then drained so the whole run is queryable.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, fields, replace
from importlib import metadata
from pathlib import Path
from typing import Literal

import psutil
from pydantic import TypeAdapter

from model.hf_io import ensure_policy
from pipeline.bus import EventProducer
from pipeline.history import follow_run
from pipeline.ledger import LedgerWriter
from pipeline.settings import StackSettings
from pipeline.stack.process import free_port, start_child, stop_child
from pipeline.topics import TRAINER
from rollout.episode import EpisodeConfig
from rollout.pool import PoolStats
from rollout.run import RolloutRequest, run_rollout
from schemas import GroupDropped, PolicyVersionPublished, RunStarted, UpdateApplied
from trainer import launch
from trainer.config import TrainConfig
from trainer.staleness import StalenessBudget
from trainer.starvation import Starvation


@dataclass(frozen=True)
class RunConfig:
    mode: Literal["async", "sync"] = "async"
    minutes: float = 10.0
    """Wall budget for rollout and training (start-up and the final drain are not counted)."""
    rollout: RolloutRequest = RolloutRequest(
        policy="local", workers=2, group_size=2, difficulty="easy", episode=EpisodeConfig(som=True), episodes=None
    )
    """The pool's side: suite, tasks, policy, its initial weights (the trainer's too), workers, G,
    curriculum. The run sets `run_id`, `episodes`, `temperature` (the trainer's) and `min_version`;
    `everlasting=False` relaunches each browser after every episode (an ablation)."""
    eta: int = 2
    """Staleness bound of the async schedule (sync is on-policy: 0)."""
    nproc: int = 1
    """Trainer processes."""
    trainer_cpus: str | None = None
    """Cores the trainer runs on (`taskset -c` syntax, e.g. "1"); None: wherever the OS puts it."""
    threads: int | None = None
    """Intra-op threads of each trainer process and of the pool's local model. None: in async mode, where
    both compute at once, the cores split evenly among them (`trainer.launch.thread_share`), unless
    `trainer_cpus` places the trainer; in sync mode, where they take turns, torch's default in each."""
    train: TrainConfig = TrainConfig(run_id="", groups_per_update=2)
    """Trainer hyper-parameters (2 groups a version: the default pool's 2 workers x G=2); the run sets
    `run_id`, `model_dir` (`rollout.model_dir`) and `eta`."""
    push: bool = True
    """With a `local` (or `demo`) policy: the trainer pushes each version's weights straight to the pool
    (`model.push`) beside the checkpoint; False: the pool loads every version from the object store."""
    run_id: str = ""
    """The run's id in the event log and the ledger; empty: a new one (`<mode>-<8 hex digits>`)."""
    log_dir: Path = Path(".awrl/runs")
    """The trainer's and the ledger writer's logs go to `<log_dir>/<run_id>/`."""
    tensorboard: Path | None = None
    """Also write the run's curves as TensorBoard event files to `<tensorboard>/<run_id>/`, from the
    ledger as it fills (every `TENSORBOARD_EVERY_S`) and complete once the run is drained."""
    patience: int | None = 32
    """Stop the run, saying why, after this many groups in a row dropped as uninformative with no update
    between (`trainer.starvation`); None: idle to the budget. At a 70% drop rate a healthy run meets
    32 in a row with odds of 1 in 90,000."""

    def __post_init__(self) -> None:
        set_by_run(
            self.train,
            "train",
            run_id=(self.run_id, "--run-id"),
            eta=(self.eta if self.mode == "async" else 0, "--eta"),
            model_dir=(self.rollout.model_dir, "--rollout.model-dir"),
        )
        set_by_run(
            self.rollout,
            "rollout",
            run_id=(self.run_id, "--run-id"),
            episodes=(None, "--minutes"),
            temperature=(self.train.temperature, "--train.temperature"),
            min_version=(0, "--mode"),
        )


def set_by_run(config, prefix: str, **sources: tuple[object, str]) -> None:
    """Refuse a nested field that the run sets itself (`name=(value the run sets, flag that sets it)`)
    unless it is left at its default or agrees: a flag the run would overwrite in silence is a mistake."""
    for name, (value, flag) in sources.items():
        got = getattr(config, name)
        if got not in (value, _default(config, name)):
            raise ValueError(f"--{prefix}.{name.replace('_', '-')} is set by the run: use {flag}")


def _default(config, name: str):
    if hasattr(type(config), "model_fields"):  # pydantic; a required field (run_id) is unset when empty
        info = type(config).model_fields[name]
        return "" if info.is_required() else info.default
    return next(f.default for f in fields(config) if f.name == name)


STARVING_SHOWN = 8
"""Uninformative drops in a row after which the live status names the cause."""


@dataclass
class RunProgress:
    """What the live display shows, folded from the pool and the trainer's events."""

    started: float = field(default_factory=time.monotonic)
    episodes: int = 0
    successes: int = 0
    steps: int = 0
    version: int = 0
    updates: list[UpdateApplied] = field(default_factory=list)
    dropped: int = 0
    iterations: int = 0
    pool: PoolStats | None = None
    starvation: Starvation = field(default_factory=Starvation)
    """Uninformative drops since the trainer's last version, and their cause."""
    stopped: str = ""
    """Why the run ended before its budget ('' when it ran it out)."""
    busy_s: float = 0.0
    """Browser-worker time on episodes (all pools of the run, summed over workers)."""
    record_s: float = 0.0
    """Of `busy_s`, time storing screenshots, publishing events and awaiting their acks."""

    def on_trainer_event(self, e) -> None:
        if isinstance(e, PolicyVersionPublished):
            self.version = max(self.version, e.version)
        elif isinstance(e, UpdateApplied):
            self.updates.append(e)
            self.starvation.reset()
        elif isinstance(e, GroupDropped):
            self.dropped += 1
            self.starvation.add(e)

    def starved(self, patience: int | None) -> bool:
        """True (and `stopped` says why) once `patience` uninformative groups in a row were dropped."""
        if patience is not None and self.starvation.groups >= patience and not self.stopped:
            self.stopped = self.starvation.message()
        return bool(self.stopped)

    @property
    def status(self) -> str:
        """The starvation warning for a live display, once a few groups in a row were dropped."""
        return self.starvation.message() if self.starvation.groups >= STARVING_SHOWN else ""

    @property
    def trainer_idle(self) -> float:
        """Fraction of the run's wall time the trainer was not computing (waiting for data or idle)."""
        elapsed = time.monotonic() - self.started
        return 1.0 - min(1.0, sum(u.compute_s for u in self.updates) / max(elapsed, 1e-9))

    @property
    def staleness(self) -> float:
        stale = [u.stats.get("staleness_mean", 0.0) for u in self.updates]
        return sum(stale) / len(stale) if stale else 0.0


@dataclass
class RunSummary:
    run_id: str
    mode: str
    seconds: float
    episodes: int
    successes: int
    steps: int
    updates: int
    version: int
    groups_dropped: int
    trainer_idle: float
    staleness_mean: float
    record_share: float = 0.0
    """Share of the workers' episode time spent recording (screenshots to S3, events to the broker)."""
    ledger_share: float | None = None
    """The ledger writer's CPU time as a share of the workers' episode time (None where /proc is absent)."""
    stopped: str = ""
    """Why the run ended before its budget ('' when it ran it out), e.g. starvation's cause."""
    groups_completed: int = 0
    """Groups the pool completed (the ledger's `groups`)."""
    informative_share: float | None = None
    """Of them, the share whose rewards were not all equal: what dynamic sampling keeps
    (`analysis.informative`)."""
    informative_per_minute: float | None = None
    """Informative groups per minute, from the run's first dispatched group to its last completed one."""

    @property
    def trajectories_per_hour(self) -> float:
        return self.episodes * 3600 / max(self.seconds, 1e-9)


def record_start(producer: EventProducer, run_id: str, command: str, config) -> None:
    """Record the run's resolved config (`RunStarted`) in its event log, before anything else it does."""
    producer.publish(
        RunStarted(
            run_id=run_id,
            command=command,
            config_json=TypeAdapter(type(config)).dump_json(config).decode(),
            argv=sys.argv,
            package_version=_package_version(),
            host=socket.gethostname(),
        )
    ).get(timeout=60)


def _package_version() -> str:
    try:
        return metadata.version("asyncwebrl")
    except metadata.PackageNotFoundError:
        return ""


def run_training(settings: StackSettings, config: RunConfig, on_progress=None, record: bool = True) -> RunSummary:
    """Run the schedule for `config.minutes`; `on_progress(progress)` is called about once a second.
    `record`: publish the resolved config as this run's `RunStarted` (the learning loop records its own)."""
    run_id = config.run_id or f"{config.mode}-{uuid.uuid4().hex[:8]}"
    recorded = replace(config, run_id=run_id)  # as launched: a model_dir of None means "the tiny VLM", anywhere
    logs = config.log_dir / run_id
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **settings.environ()}
    if config.rollout.model_dir is None:  # one directory for the trainer and a policy server alike
        config = replace(config, rollout=replace(config.rollout, model_dir=ensure_policy()))
    if config.push and config.rollout.policy in ("local", "demo") and config.train.push_address is None:
        address = f"127.0.0.1:{free_port()}"  # the trainer's rank 0 runs on this host too
        config = replace(
            config,
            train=config.train.model_copy(update={"push_address": address}),
            rollout=replace(config.rollout, push_address=address),
        )
    train = config.train.model_copy(
        update={
            "run_id": run_id,
            "model_dir": config.rollout.model_dir,
            "eta": config.eta if config.mode == "async" else 0,
        }
    )
    config = replace(config, run_id=run_id, train=train)  # the schedules below read the resolved config
    threads = _threads(config)
    if threads is not None and config.rollout.threads is None:
        config = replace(config, rollout=replace(config.rollout, threads=threads))
    progress, stop = RunProgress(), threading.Event()
    producer = EventProducer(settings, client_id="run")
    if record:
        record_start(producer, run_id, "run", recorded)
    watcher = threading.Thread(
        target=follow_run,
        daemon=True,
        args=(
            settings,
            TRAINER,
            run_id,
            [PolicyVersionPublished, UpdateApplied, GroupDropped],
            progress.on_trainer_event,
            stop,
            producer,
            "run",
        ),
    )
    watcher.start()
    tensorboard = LiveTensorBoard(settings, run_id, config.tensorboard) if config.tensorboard else None
    with open(logs / "trainer.log", "w") as tlog, open(logs / "ledger.log", "w") as llog:
        ledger = start_child([sys.executable, "-m", "app.cli", "ledger", "sync", "--follow"], env, llog)
        trainer = launch.start(train, config.nproc, env, log=tlog, cpus=config.trainer_cpus, threads=threads)
        progress.started = time.monotonic()
        deadline = progress.started + config.minutes * 60
        ticker = threading.Thread(target=_tick, args=(progress, stop, on_progress), daemon=True)
        ticker.start()
        try:
            schedule = _run_async if config.mode == "async" else _run_sync
            schedule(settings, config, run_id, progress, deadline, trainer)
            _catch_up(progress, trainer, config.train.max_updates)
        finally:
            seconds = time.monotonic() - progress.started
            stop.set()
            stop_child(trainer)
            ledger_cpu_s = _cpu_seconds(ledger.pid)
            stop_child(ledger)
    LedgerWriter(settings).sync(idle_exit_s=3.0)  # drain: the whole run is in the ledger
    informative = _informative_groups(settings, run_id)
    producer.close()
    if tensorboard:
        tensorboard.finish()
    busy = max(progress.busy_s, 1e-9)
    return RunSummary(
        run_id,
        config.mode,
        seconds,
        progress.episodes,
        progress.successes,
        progress.steps,
        len(progress.updates),
        progress.version,
        progress.dropped,
        progress.trainer_idle,
        progress.staleness,
        progress.record_s / busy,
        None if ledger_cpu_s is None else ledger_cpu_s / busy,
        progress.stopped,
        informative.groups,
        informative.share,
        informative.per_minute,
    )


def _threads(config: RunConfig) -> int | None:
    """`RunConfig.threads` resolved: the trainer's processes and a pool with a local model share the cores."""
    if config.threads is not None or config.mode == "sync" or config.trainer_cpus is not None:
        return config.threads
    return launch.thread_share(config.nproc, beside=int(config.rollout.policy in ("local", "demo")))


def _informative_groups(settings: StackSettings, run_id: str):
    """The run's informative groups from the drained ledger (`analysis/sql/informative_groups.sql`)."""
    from analysis.informative import informative_groups
    from analysis.views import connect

    con = connect(settings, run_id=run_id)
    try:
        return informative_groups(con, run_id)
    finally:
        con.close()


TENSORBOARD_EVERY_S = 15.0
"""How often `RunConfig.tensorboard` folds the ledger's new points into the event files."""


class LiveTensorBoard:
    """Exports a run's new points from the ledger to TensorBoard every `TENSORBOARD_EVERY_S` while the
    run goes on, and once more, complete, after the drain (`finish`). It only reads the ledger."""

    def __init__(self, settings: StackSettings, run_id: str, out: Path):
        from analysis.export import TensorBoardExport

        self.settings, self.run_id = settings, run_id
        self.export = TensorBoardExport(out, run_id)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tensorboard", daemon=True)
        self.thread.start()

    def _sync(self) -> None:
        from analysis.views import connect

        con = connect(self.settings, run_id=self.run_id)
        try:
            self.export.sync(con)
        finally:
            con.close()

    def _loop(self) -> None:
        while not self.stop.wait(TENSORBOARD_EVERY_S):
            try:
                self._sync()
            except OSError as exc:  # the store hiccuped: the next round reads again
                logging.getLogger(__name__).warning("tensorboard export: %s", exc)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        try:
            self._sync()
        finally:
            self.export.close()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process, or None."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


def _request(
    config: RunConfig, run_id: str, episodes: int | None, min_version: int = 0, seed: int = 0
) -> RolloutRequest:
    # The pool samples at the temperature the trainer scores at: the behaviour distribution is one.
    return replace(
        config.rollout,
        run_id=run_id,
        episodes=episodes,
        temperature=config.train.temperature,
        min_version=min_version,
        seed=config.rollout.seed + seed,
    )


def _count(progress: RunProgress):
    base = (progress.episodes, progress.successes, progress.steps, progress.busy_s, progress.record_s)

    def update(pool) -> None:
        s = pool.stats
        progress.episodes, progress.successes, progress.steps = (
            base[0] + s.episodes,
            base[1] + s.successes,
            base[2] + s.steps,
        )
        progress.busy_s, progress.record_s = base[3] + s.busy_s, base[4] + s.record_s
        progress.pool = s

    return update


def _run_async(settings, config: RunConfig, run_id: str, progress: RunProgress, deadline: float, trainer) -> None:
    stop = threading.Event()

    def watch() -> None:  # the budget, a trainer that finished its updates (or died), starvation
        while not stop.wait(0.5):
            if time.monotonic() > deadline or trainer.poll() is not None or progress.starved(config.patience):
                stop.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        budget = StalenessBudget(config.eta, config.train.groups_per_update)
        run_rollout(settings, _request(config, run_id, None), False, stop, _count(progress), admission=budget)
    finally:
        stop.set()


def _run_sync(settings, config: RunConfig, run_id: str, progress: RunProgress, deadline: float, trainer) -> None:
    batch = config.train.groups_per_update
    dispatched = 0
    while (
        time.monotonic() < deadline
        and trainer.poll() is None
        and not progress.starved(config.patience)
        and not _finished(progress, config.train.max_updates)
    ):
        version = progress.version
        # collect until the trainer can fill a batch: every group it dropped must be replaced
        needed = batch
        while needed > 0 and time.monotonic() < deadline and not progress.starved(config.patience):
            stop = threading.Event()
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop.set)
            timer.start()
            # a fresh pool each round: browsers built and torn down (a new task order too: seed)
            request = _request(config, run_id, needed * config.rollout.group_size, version, seed=dispatched)
            run_rollout(settings, request, False, stop, _count(progress))
            timer.cancel()
            dispatched += needed
            needed = _wait_for_trainer(progress, version, dispatched, batch, deadline, trainer)
        progress.iterations += 1


def _wait_for_trainer(
    progress: RunProgress, version: int, dispatched: int, batch: int, deadline: float, trainer
) -> int:
    """Wait for the trainer's next version (then 0 more groups are needed), or until it has dropped so
    many groups that the ones it holds cannot fill a batch (then the shortfall)."""
    while time.monotonic() < deadline and trainer.poll() is None:
        if progress.version > version:
            return 0
        held = dispatched - progress.dropped - sum(len(u.group_ids) for u in progress.updates)
        if held < batch:
            return batch - held
        time.sleep(0.2)
    return 0


def _finished(progress: RunProgress, max_updates: int | None) -> bool:
    """The trainer has made its last update (it is exiting): no new round of rollouts is needed."""
    return max_updates is not None and len(progress.updates) >= max_updates


CATCH_UP_S = 60.0
"""How long a run whose trainer finished its `max_updates` waits for their events to reach its progress."""


def _catch_up(progress: RunProgress, trainer, max_updates: int | None) -> None:
    """A trainer that made its last update exits as soon as its events are acknowledged, which can be
    before the run's follower has read them: wait for them, so the summary counts every update."""
    if max_updates is None or trainer.poll() != 0:
        return
    deadline = time.monotonic() + CATCH_UP_S
    while len(progress.updates) < max_updates and time.monotonic() < deadline:
        time.sleep(0.2)


def _tick(progress: RunProgress, stop: threading.Event, on_progress) -> None:
    while not stop.wait(1.0):
        if on_progress:
            on_progress(progress)
