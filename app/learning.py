"""The learning curve: one policy through three stages, each measured the same way.

untrained -> SFT warm start on oracle demonstrations -> async RL (`awrl run`), with the success rate on
held-out tasks after each stage (Wilson 95% interval), every point on the same held-out instances
(`rollout.evaluate`'s paired evaluation), so that RL - SFT gets a paired bootstrap interval. The SFT
policy is also measured at other temperatures (`LearningConfig.sharpening`): a gain that sampling the
SFT model more sharply also gets is not RL's, so RL is compared with the best of them too.

Every stage is an ordinary run in the event log: the demonstrations (`<run>-demos`), each evaluation's
episodes (`<run>-eval-<stage>`), and the RL run's updates and versions (`<run>`). Each point of the
curve is an `EvaluationCompleted` event of the RL run, so the curve is in the ledger:

    SELECT stage, success_rate, ci95_low, ci95_high, train_s FROM evaluations WHERE run_id = '<run>'
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from analysis import connect
from analysis.curves import learning_curve_png, success_by_version, version_curve_png
from app.evaluation import CurvePoint, Evaluator, eval_split, sharpening_stage
from app.training import RunConfig, RunSummary, record_start, run_training, set_by_run
from model.hf_io import ensure_policy
from model.tokenizer import HOME
from pipeline.bus import EventProducer
from pipeline.checkpoints import CheckpointStore
from pipeline.ledger import LedgerWriter, read_events
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotStore
from rollout.curriculum import CurriculumConfig
from rollout.episode import EpisodeConfig
from rollout.evaluate import Difference
from rollout.run import RolloutRequest, make_suite, run_rollout
from schemas.observation import Difficulty, Split, SuiteName
from trainer.config import AnchorConfig, TrainConfig
from trainer.losses.tokens import TokenSelection
from trainer.sft import SFTConfig, SFTResult, demonstrations, train_sft

RL_TRAIN = TrainConfig(
    run_id="", groups_per_update=2, ppo_epochs=2, lr=1e-4, warmup_updates=2, entropy_coef=1e-3, kl_coef=1.0
)
"""RL hyper-parameters of the learning loop (`make demo`): 2 informative groups a version, 2 optimizer
steps on each batch (so pi_prox, the clip and approx_kl act), lr 1e-4 after a 2-update warm-up (2e-4
collapsed the controlled task's format), an entropy bonus, and a KL penalty to the SFT model (beta 1
halved the invalid actions of a sweep's RL evaluation, where one demo run without it lost its format)."""

CONTROLLED_TRAIN = TrainConfig(
    run_id="", groups_per_update=4, minibatches=2, ppo_epochs=2, lr=1e-4, warmup_updates=5, kl_coef=1.0
)
"""RL hyper-parameters of the controlled test: 4 groups of 8 a version, 2 epochs of 2 minibatches (4
optimizer steps, so the clip and approx_kl act), a 5-step warm-up (bench/RESULTS.md has the sweep), and
a KL penalty to the warm start: without it 1 run in 12 collapsed (the rewarded digit leaked into the
memory's digit slot, breaking the format), with it 0 in 7. It also holds the policy back: final
success 0.49-0.69 after 80 steps with it, 0.44-0.83 after 48 without (the runs that did not collapse)."""


READING_TRAIN = CONTROLLED_TRAIN.model_copy(
    update={"kl_coef": 0.0, "tokens": TokenSelection(pg="action"), "lr": 3e-4, "ppo_epochs": 4}
)
"""RL hyper-parameters of the controlled task that needs the instruction (`colour`), with the anchor
(`READING_ANCHOR`): the policy gradient on the action's values only, 8 optimizer steps a version at lr
3e-4 (6x the sum of learning rates of `CONTROLLED_TRAIN`'s 80 steps), no KL penalty. Without the anchor
this budget broke the format in every run (invalid actions 0.5-0.9). With it, from a `named` warm start,
held-out `colour` success rose 0.17-0.23 -> 0.64-0.84 in 3 runs of 6 and stayed at chance in the
others; from a `READING_DEMOS` warm start it rose in 3 runs of 3 (+0.44, +0.34, +0.18, bench/RESULTS.md).
The same sum of learning rates in half the steps (lr 6e-4, 80 steps) rose in 2 runs of 3; at lr 1e-3
3 runs of 6 lost the output format. `awrl demo --config colour`; not yet the CI's learning test."""
READING_ANCHOR = 1.0
"""gamma of the SFT anchor (PPO-ptx) that holds the response's scaffold while RL moves the decision."""
CONTROLLED_DEMOS = ("named",)
"""What the controlled warm start clones by default: `named` (the instruction names a colour, the thought
restates it, the box is drawn uniformly), at chance on every target."""
READING_DEMOS = ("named", "pick")
"""What the warm start of the `colour` runs clones: `named` (the instruction names a colour, the thought
restates it, the box is drawn uniformly) and `pick` (the instruction names none, the thought names the
box clicked). It is at chance on `colour` yet has a path from a colour word to its mark, which the
instruction's kind closes; RL opens it where the instruction names the colour (bench/RESULTS.md)."""
READING_UPDATES = 160
"""Optimizer steps of the `colour` run: 20 versions of 8. At 56 steps the three seeds measured had not
moved yet (0.22-0.31), at 112 they had risen +0.25 to +0.42."""


CONTROLLED_MALFORMED_REWARD = -0.5
"""A malformed action (not an action, or a mark not on the screen) scores below a wrong click in the
controlled configuration: the format wore down under RL without it (bench/RESULTS.md)."""


@dataclass(frozen=True)
class LearningConfig:
    suite: SuiteName = "sites"
    """Task suite of every stage: sites (our multi-page sites), miniwob or boxes (no browser)."""
    difficulty: Difficulty | None = "easy"
    """Tasks of this difficulty only, for demonstrations, RL and evaluation alike."""
    demo_episodes: int = 200
    """Oracle demonstration episodes (train split); only successful ones are cloned."""
    templates: tuple[str, ...] | None = None
    """Templates of RL and of the evaluations; None: `train_templates`' choice, evaluations on all."""
    demo_templates: tuple[str, ...] | None = None
    """Templates the demonstrations are drawn from; None: the RL stage's (`train_templates`). The boxes
    suite's controlled test clones `named` (the instruction names a colour, the thought restates it, the
    box is uniform) so that its warm start is at chance yet has read the colour words."""
    warm_start: Path | None = None
    """An SFT model to start RL from: skips the demonstrations and SFT (a control run reuses the warm
    start of the run it controls)."""
    sft_measured_by: str | None = None
    """A run with the same `warm_start` whose SFT evaluation stands for this one: it is not measured
    again, and the curriculum starts from its outcomes (a sweep's arms share one)."""
    sft_epochs: int = 3
    """Passes of behaviour cloning over the successful demonstrations."""
    sft_lr: float = 1e-3
    """AdamW learning rate of SFT."""
    sft_batch_steps: int = 4
    """Demonstration steps per SFT optimizer step (small batches: more updates per CPU second)."""
    rl_minutes: float = 10.0
    """Wall budget of the async RL stage."""
    rl_updates: int | None = None
    """Stop RL after this many optimizer steps (`train.max_updates`), whichever of the two budgets
    comes first; a budget in updates is what a loaded machine cannot shorten."""
    malformed_reward: float = 0.0
    """Reward of a failed RL episode with a malformed action (`EpisodeConfig.malformed_reward`)."""
    seed: int = 0
    """Seed of RL's task order and sampling."""
    eval_episodes: int = 100
    """Episodes of each held-out evaluation (Wilson 95% intervals of about +-0.1 at 100): `eval_episodes /
    eval_samples` instances, or every task of the split, each run `eval_samples` times or more (so that a
    small split still gets about `eval_episodes`)."""
    eval_samples: int = 4
    """Episodes per held-out instance. Every point runs the same instances (a fixed seeded order of the
    split), so two points pair: RL - SFT gets an interval from resampling instances (`rollout.evaluate.
    paired_difference`), where independent samples' differences drown in instance difficulty."""
    sharpening: tuple[float, ...] = (0.0, 0.5)
    """Temperatures at which the SFT policy is also evaluated, on the same instances: sharper sampling
    of the SFT model is a baseline an RL gain must beat (RL is compared with the best of them). One at
    `temperature` is the SFT point itself; at 0 (greedy, which repeats itself on an instance) one
    episode per instance, otherwise `eval_samples`. Each adds an evaluation; () turns them off."""
    rl_eval_points: int = 1
    """Held-out evaluations of RL versions, evenly spaced over the published versions, the last one
    included (stages `rl-v<N>`; the final one is also `rl`)."""
    eval_split: Split | None = None
    """None: `test` (unseen seeds of the train tasks) for miniwob, `heldout` (unseen templates) for sites."""
    temperature: float = 0.5
    """Sampling temperature of RL and evaluation alike. At 1 a 5M-parameter model breaks its JSON too
    often for any task to succeed (2/30 vs 15/30 at 0.5, the same SFT model); the trainer scores the
    same tempered distribution, so RL stays on-policy."""
    workers: int = 2
    """Browsers in the pool of every stage."""
    eval_workers: int | None = None
    """Workers of the evaluations; None: `workers`. Evaluation episodes are independent, so where a
    worker costs no browser (boxes) more of them batch more sampling (bench/RESULTS.md: 1.92x at 4)."""
    group_size: int = 4
    """Episodes per RL task group (GRPO's G)."""
    train: TrainConfig = RL_TRAIN
    """RL hyper-parameters; the run sets `train.run_id` and `train.temperature` (from `temperature`)."""
    anchor_coef: float = 0.0
    """gamma of an SFT anchor in RL on the warm start's own demonstrations (PPO-ptx, `train.anchor`):
    sets `train.anchor.coef` and `train.anchor.run_ids` to the demonstrations run, `<run_id>-demos`, or
    with `warm_start` the `<warm_start_run>-demos` it was cloned from; 0 leaves `train.anchor` as given."""
    warm_start_run: str | None = None
    """The run that built `warm_start` (`controlled_warm_start`'s `run_id`), whose demonstrations the
    anchor (`anchor_coef`) reads from the ledger."""
    curriculum: CurriculumConfig = CurriculumConfig(skip_uninformative=2)
    """RL draws the task families whose recent success is in band, seeded by the SFT evaluation's
    outcomes, and passes over instances whose last 2 groups were all-equal (`rollout.curriculum`); when
    not `enabled`, every training task alike."""
    run_id: str = ""
    """The run's id (the RL run; demonstrations and evaluations are `<run_id>-demos`, `-eval-<stage>`);
    empty: a new one."""
    out_dir: Path = HOME / "learning"
    """Models, `curve.json` and `curve.png` go to `<out_dir>/<run_id>/`."""

    def __post_init__(self) -> None:
        set_by_run(
            self.train, "train", run_id=(self.run_id, "--run-id"), temperature=(self.temperature, "--temperature")
        )
        if self.anchor_coef and self.warm_start is not None and not self.warm_start_run:
            raise ValueError(
                "anchor_coef > 0 with a warm_start needs warm_start_run: the run whose "
                "demonstrations the warm start cloned (`controlled_warm_start`'s run_id)"
            )


def demonstrations_run(run_id: str) -> str:
    """The run of `run_id`'s oracle demonstrations, which its SFT warm start clones."""
    return f"{run_id}-demos"


def rl_train_config(config: LearningConfig, run_id: str) -> TrainConfig:
    """The RL stage's `TrainConfig`: `config.train` for this run, with the anchor of `anchor_coef`."""
    train = config.train.model_copy(
        update={
            "run_id": run_id,
            "temperature": config.temperature,
            "max_updates": config.rl_updates or config.train.max_updates,
        }
    )
    if not config.anchor_coef:
        return train
    demos = demonstrations_run(config.warm_start_run if config.warm_start is not None else run_id)
    anchor = AnchorConfig.model_validate({**train.anchor.model_dump(), "coef": config.anchor_coef, "run_ids": (demos,)})
    return train.model_copy(update={"anchor": anchor})


def rl_rollout(config: LearningConfig, run_id: str, model_dir: Path) -> RolloutRequest:
    """The RL stage's pool: the local policy from `model_dir` on the training tasks, its curriculum
    seeded by the SFT evaluation's outcomes."""
    return RolloutRequest(
        suite=config.suite,
        difficulty=config.difficulty,
        templates=train_templates(config),
        policy="local",
        model_dir=model_dir,
        workers=config.workers,
        group_size=config.group_size,
        seed=config.seed,
        episode=EpisodeConfig(som=True, malformed_reward=config.malformed_reward),
        curriculum=config.curriculum,
        curriculum_from=(f"{config.sft_measured_by or run_id}-eval-sft",),
    )


CONTROLLED_UPDATES = 80
"""The controlled test's RL budget: 20 versions of 4 optimizer steps. With the KL penalty the four
constant targets rose by +0.32 to +0.40 at 20 versions, none collapsing (bench/RESULTS.md)."""


def controlled(
    run_id: str,
    out_dir: Path,
    rl_minutes: float = 10.0,
    control: str = "none",
    warm_start: Path | None = None,
    target: str = "red",
    rl_updates: int | None = CONTROLLED_UPDATES,
    seed: int = 0,
    anchor_coef: float = 0.0,
    warm_start_run: str | None = None,
    train: TrainConfig = CONTROLLED_TRAIN,
    demo_templates: tuple[str, ...] = CONTROLLED_DEMOS,
) -> LearningConfig:
    """The controlled learning test on the `boxes` suite (no browser): demonstrations of `named` ("click
    the <colour> box", restated in the thought, the box drawn uniformly) give a warm start at chance on
    "click the `target` box" (a colour, or `colour`: the one the instruction names), RL from it for
    `rl_updates` optimizer steps (at most `rl_minutes`), held-out seeds evaluated before and after; with
    `control="shuffled_rewards"` the same run whose advantages carry no information. `anchor_coef` > 0
    adds the SFT anchor on the warm start's demonstrations (those of `warm_start_run`, the `run_id` given
    to `controlled_warm_start`, when `warm_start` is given). `train`: `CONTROLLED_TRAIN` for a constant
    target, `READING_TRAIN` (with `anchor_coef=READING_ANCHOR`) for `colour`. `demo_templates`: what the
    warm start clones (`named`, or `named` and `pick`: the boxes suite's docstring says why)."""
    return LearningConfig(
        suite="boxes",
        difficulty=None,
        templates=(target,),
        demo_templates=demo_templates,
        demo_episodes=300,
        sft_epochs=4,
        sft_batch_steps=4,
        rl_minutes=rl_minutes,
        rl_updates=rl_updates,
        eval_episodes=96,
        eval_split="test",
        temperature=1.0,
        workers=2,
        eval_workers=4,
        group_size=8,
        rl_eval_points=3,
        run_id=run_id,
        out_dir=out_dir,
        warm_start=warm_start,
        curriculum=CurriculumConfig(enabled=False),
        seed=seed,
        malformed_reward=CONTROLLED_MALFORMED_REWARD,
        train=train.model_copy(update={"control": control}),
        anchor_coef=anchor_coef,
        warm_start_run=warm_start_run,
    )


def train_templates(config: LearningConfig) -> tuple[str, ...] | None:
    """With a `test` evaluation (unseen seeds of train templates), demonstrations and RL use the train
    tasks of the evaluated templates only: on the others no demonstration exists, every group of a
    small model fails alike, and dynamic sampling drops it. None (every train task) otherwise."""
    if config.templates is not None:
        return config.templates
    if eval_split(config) != "test":
        return None
    return tuple(sorted({t.template for t in make_suite(config.suite).tasks("test")}))


@dataclass
class LearningCurve:
    run_id: str
    points: list[CurvePoint] = field(default_factory=list)
    demo_episodes: int = 0
    demo_successes: int = 0
    sft: SFTResult | None = None
    rl: RunSummary | None = None
    seconds: float = 0.0
    differences: list[Difference] = field(default_factory=list)
    """Paired differences in held-out success: RL - SFT, then RL - the best SFT temperature when that is
    a sharpening baseline (`LearningConfig.sharpening`)."""

    def point(self, stage: str) -> CurvePoint | None:
        return next((p for p in self.points if p.stage == stage), None)


def run_learning(settings: StackSettings, config: LearningConfig, say: Callable[[str], None] = print) -> LearningCurve:
    """Run every stage; `say` narrates (each stage shows its own progress bar)."""
    start = time.monotonic()
    run_id = config.run_id or f"learn-{uuid.uuid4().hex[:8]}"
    out = config.out_dir / run_id
    out.mkdir(parents=True, exist_ok=True)
    curve = LearningCurve(run_id)
    producer = EventProducer(settings, client_id="learning")
    record_start(producer, run_id, "demo", replace(config, run_id=run_id))
    measure = Evaluator(settings, config, run_id, producer, curve, say)
    try:
        if config.warm_start:
            sft_dir, sft_s = config.warm_start, 0.0
        else:
            measure("untrained", ensure_policy(), 0, 0.0)
            sft_dir, sft_s = warm_start(settings, config, run_id, curve, say)
        # each evaluation is read back from the ledger: the curriculum finds the SFT one there
        sharpening = [t for t in config.sharpening if t != config.temperature]
        if config.sft_measured_by is None:
            measure("sft", sft_dir, 0, sft_s)
            for t in sharpening:  # greedy repeats itself on an instance: one episode says it all
                measure(sharpening_stage(t), sft_dir, 0, sft_s, temperature=t, samples=1 if t == 0 else None)
        else:
            for stage in ("sft", *map(sharpening_stage, sharpening)):
                measure.recall(stage, config.sft_measured_by)

        say(f"[3/3] async RL for {config.rl_minutes:g} min from the SFT policy")
        train = rl_train_config(config, run_id)
        rollout = rl_rollout(config, run_id, sft_dir)
        curve.rl = run_training(
            settings,
            RunConfig(
                mode="async",
                minutes=config.rl_minutes,
                rollout=rollout,
                train=train,
                run_id=run_id,
                log_dir=out / "logs",
            ),
            on_progress=_rl_progress(say),
            record=False,
        )
        if curve.rl.stopped:
            say(f"  RL stopped early: {curve.rl.stopped}")
        versions, checkpoints = _published(settings, run_id, curve.rl.stopped), CheckpointStore.from_settings(settings)
        for version in _spaced(sorted(versions), config.rl_eval_points):
            measure(
                "rl" if version == max(versions) else f"rl-v{version}",
                checkpoints.download(versions[version]),
                version,
                sft_s + curve.rl.seconds * version / max(max(versions), 1),
            )
        curve.differences = measure.differences()
        if curve.differences:
            say(f"paired on the same {len(measure.task_ids)} held-out instances:")
        for d in curve.differences:
            say(f"  {d}")
    finally:
        producer.close()
    LedgerWriter(settings).sync(idle_exit_s=3.0)  # the curve's events too
    curve.seconds = time.monotonic() - start
    (out / "curve.json").write_text(json.dumps(_jsonable(curve), indent=2))
    title = f"{run_id}: {config.suite} {config.difficulty or ''} {eval_split(config)}, T={config.temperature:g}"
    learning_curve_png(curve.points, out / "curve.png", title=title)
    # success on the training tasks per policy version (from the ledger) with the held-out points on top
    version_curve_png(success_by_version(connect(settings), run_id), curve.points, out / "version_curve.png", title)
    return curve


def warm_start(
    settings: StackSettings, config: LearningConfig, run_id: str, curve: LearningCurve, say: Callable[[str], None]
) -> tuple[Path, float]:
    """Oracle demonstrations in real episodes, then SFT on the successful ones: (model dir, SFT seconds)."""
    templates = config.demo_templates or train_templates(config)
    say(
        f"[1/3] {config.demo_episodes} oracle demonstrations ({config.suite}, train split"
        f"{f', {len(templates)} templates' if templates else ''})"
    )
    demos = run_rollout(
        settings,
        RolloutRequest(
            suite=config.suite,
            policy="demo",
            workers=config.workers,
            group_size=1,
            episodes=config.demo_episodes,
            split="train",
            difficulty=config.difficulty,
            templates=templates,
            run_id=demonstrations_run(run_id),
            episode=EpisodeConfig(som=True),
        ),
    )
    curve.demo_episodes, curve.demo_successes = demos.episodes, demos.successes
    LedgerWriter(settings).sync(idle_exit_s=3.0)  # SFT reads its demonstrations from the ledger

    say(f"[2/3] SFT warm start on {demos.successes} successful demonstrations")
    t0 = time.monotonic()
    out = config.out_dir / run_id / "sft"
    curve.sft = train_sft(
        settings,
        SFTConfig(
            run_ids=[demonstrations_run(run_id)],
            out_dir=out,
            epochs=config.sft_epochs,
            lr=config.sft_lr,
            batch_steps=config.sft_batch_steps,
        ),
        on_step=_sft_progress(say),
    )
    return out, time.monotonic() - t0


def controlled_warm_start(
    settings: StackSettings,
    out_dir: Path,
    run_id: str = "warm",
    say: Callable[[str], None] = print,
    demo_templates: tuple[str, ...] = CONTROLLED_DEMOS,
) -> Path:
    """Only the controlled task's warm start (demonstrations of `demo_templates`, then SFT): the model
    directory that a set of controlled runs shares (`controlled(..., warm_start=...)`)."""
    config = controlled(run_id, out_dir, demo_templates=demo_templates)
    sft, _ = warm_start(settings, config, run_id, LearningCurve(run_id), say)
    return sft


def share_demonstrations(source: StackSettings, settings: StackSettings, warm_start_run: str) -> None:
    """The screenshots of `warm_start_run`'s demonstrations, recorded into `source`'s bucket, copied into
    `settings`' bucket: an anchored run's trainer reads screenshots from its own bucket only."""
    hashes = {h for s in demonstrations(source, [demonstrations_run(warm_start_run)]) for h in s.screenshot_sha256}
    ScreenshotStore.from_settings(settings).put_many(ScreenshotStore.from_settings(source).get_many(hashes).values())


class RLStarved(RuntimeError):
    """The RL stage made no version because every group was uninformative (the message says why)."""


def _published(settings: StackSettings, run_id: str, stopped: str = "") -> dict[int, str]:
    """The RL run's published versions: version -> checkpoint URI."""
    versions = read_events(settings, run_id, "PolicyVersionPublished", ["version", "checkpoint_uri"]).to_pylist()
    if not versions and stopped:
        raise RLStarved(f"RL run {run_id} published no version: {stopped}")
    if not versions:
        raise RuntimeError(f"RL run {run_id} published no version (see its trainer.log)")
    return {v["version"]: v["checkpoint_uri"] for v in versions}


def final_policy(settings: StackSettings, run_id: str) -> Path:
    """The RL run's newest published version, downloaded: a model directory (for `analysis.probe`)."""
    versions = _published(settings, run_id)
    return CheckpointStore.from_settings(settings).download(versions[max(versions)])


def _spaced(versions: list[int], n: int) -> list[int]:
    """`n` of the sorted `versions`, evenly spaced, the last always included (version 0 is the SFT point)."""
    later = [v for v in versions if v > 0] or versions
    picks = {later[math.ceil(len(later) * (i + 1) / n) - 1] for i in range(n)}
    return sorted(picks)


def _every(seconds: float, report):
    """`report`, called at most once per `seconds` (and always when `final` is true)."""
    last = [0.0]

    def call(*args, final: bool = False) -> None:
        if final or time.monotonic() - last[0] > seconds:
            last[0] = time.monotonic()
            report(*args)

    return call


def _sft_progress(say):
    report = _every(15, lambda step, total, loss: say(f"  sft step {step}/{total}  loss {loss:.3f}"))
    return lambda step, total, loss: report(step, total, loss, final=step == total)


def _rl_progress(say):
    return _every(
        30,
        lambda p: say(
            f"  rl {time.monotonic() - p.started:5.0f}s  episodes {p.episodes}  success "
            f"{p.successes / max(p.episodes, 1):.2f}  version {p.version}  updates {len(p.updates)}  "
            f"dropped {p.dropped}  trainer idle {p.trainer_idle:.0%}" + (f"\n  {p.status}" if p.status else "")
        ),
    )


def _jsonable(curve: LearningCurve) -> dict:
    return {
        "run_id": curve.run_id,
        "seconds": curve.seconds,
        "demo_episodes": curve.demo_episodes,
        "demo_successes": curve.demo_successes,
        "points": [dict(asdict(p), rate=p.rate) for p in curve.points],
        "differences": [asdict(d) for d in curve.differences],
        "sft": None
        if curve.sft is None
        else {
            "demonstrations": curve.sft.demonstrations,
            "loss_first": curve.sft.losses[0],
            "loss_last": curve.sft.losses[-1],
        },
        "rl": None if curve.rl is None else dict(vars(curve.rl), trajectories_per_hour=curve.rl.trajectories_per_hour),
    }
