"""`awrl rollout`: wire suites, a policy and the pool together, with a live progress line."""

from __future__ import annotations

import asyncio
import math
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from pipeline.checkpoints import CheckpointStore
from pipeline.settings import StackSettings
from rollout.curriculum import Curriculum, CurriculumConfig, family_index, seed_from_ledger
from rollout.dispatcher import Admission, dispatch_loop, task_stream
from rollout.episode import EpisodeConfig
from rollout.pool import PoolConfig, PoolStats, RolloutPool
from rollout.types import Policy, Suite
from schemas.observation import Difficulty, PolicyName, Split, SuiteName, Task

SUITES: tuple[str, ...] = get_args(SuiteName)
POLICIES: tuple[str, ...] = get_args(PolicyName)


# make_suite and make_policy import each backend when it is chosen: a suite or policy brings heavy
# dependencies (Playwright, MiniWoB++, torch, HTTP clients) that the others do not need.
def make_suite(name: str) -> Suite:
    if name == "sites":
        from rollout.suites.sites import SitesSuite

        return SitesSuite()
    if name == "miniwob":
        from rollout.suites.miniwob import MiniWobSuite

        return MiniWobSuite()
    if name == "boxes":
        from rollout.suites.boxes import BoxesSuite

        return BoxesSuite()
    raise ValueError(f"unknown suite {name!r}; choose from {SUITES}")


def make_policy(
    name: str,
    suites: dict[str, Suite],
    model_dir: Path | None = None,
    vllm_url: str | None = None,
    vllm_model: str | None = None,
    seed: int = 0,
    noise: float = 0.0,
    checkpoints=None,
    temperature: float = 1.0,
    max_batch: int = 64,
    push_address: str | None = None,
    threads: int | None = None,
) -> Policy:
    """`demo`: the oracle's actions (a random action with probability `noise`) as the local model's
    tokens and log-probs (`rollout.policy.scored`). `checkpoints`: a `CheckpointStore` through which
    model backends load s3:// versions. `push_address`: the local model also takes versions the trainer
    pushes there (`model.push`). `threads`: the local model's intra-op threads (`RolloutRequest.threads`)."""
    if name == "demo":
        from rollout.policy.scored import NoisyPolicy, ScoredPolicy

        script = make_policy("oracle", suites)
        if noise > 0:
            script = NoisyPolicy(script, make_policy("random", suites, seed=seed), noise, seed=seed)
        return ScoredPolicy(
            script,
            make_policy(
                "local",
                suites,
                model_dir,
                seed=seed,
                checkpoints=checkpoints,
                push_address=push_address,
                threads=threads,
            ),
        )
    if name == "oracle":
        from rollout.policy.scripted import OraclePolicy

        return OraclePolicy(suites)
    if name == "random":
        from rollout.policy.scripted import RandomPolicy

        return RandomPolicy(seed=seed)
    if name == "local":
        from rollout.policy.local import LocalPolicy

        # Chromium needs the cores torch's second thread would spin on: measured on 2 cores, MiniWoB++ at
        # 4 workers ran 1.33 episodes/s with one torch thread, 0.99 with two (boxes, no browser: 9.0 vs 11.0).
        if threads is None:
            threads = 1 if any(s.needs_browser for s in suites.values()) else None
        return LocalPolicy(
            model_dir,
            seed=seed,
            checkpoints=checkpoints,
            temperature=temperature,
            max_batch=max_batch,
            num_threads=threads,
            push_address=push_address,
        )
    if name == "vllm":
        return _vllm_policy(vllm_url, vllm_model, seed, checkpoints, temperature)
    raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")


def _vllm_policy(url: str | None, model: str | None, seed: int, checkpoints, temperature: float) -> Policy:
    """The policy server's client. The special tokens it must not sample are looked up in the served
    model's vocabulary (the tiny VLM names them as Qwen3-VL does, with other ids)."""
    from model.tokenizer import SPECIAL_TOKENS, STOP_TOKENS
    from rollout.policy.vllm_client import VLLMPolicy

    if not url:
        raise ValueError("--policy vllm needs a server: --vllm-url, AWRL_VLLM_URL, or `awrl stack up --vllm MODEL_DIR`")
    # The server loads the directory the pool fetched: they must share a filesystem.
    fetch = (lambda uri: str(checkpoints.download(uri))) if checkpoints is not None else None
    policy = VLLMPolicy(
        url, model or "policy", seed=seed, temperature=temperature, **({"fetch": fetch} if fetch else {})
    )
    policy.suppress_token_ids = policy.server_token_ids([t for t in SPECIAL_TOKENS if t not in STOP_TOKENS])
    return policy


@dataclass(frozen=True)
class RolloutRequest:
    suite: SuiteName = "sites"
    """Task suite: sites (our multi-page sites), miniwob or boxes."""
    policy: PolicyName = "oracle"
    """Policy backend: oracle, random, local, vllm, demo (oracle actions as the local model's tokens)."""
    workers: int = 4
    """Browsers kept alive in this process."""
    group_size: int = 4
    """Episodes per task group (GRPO's G)."""
    episodes: int | None = 16
    """Stop after this many episodes (rounded up to whole groups); None runs forever."""
    dispatch: bool = True
    """Also act as the dispatcher (one process); turn off when a separate dispatcher runs."""
    split: Split = "train"
    """Task split to dispatch."""
    difficulty: Difficulty | None = None
    """Dispatch only tasks of this difficulty (easy, medium, hard); None dispatches all."""
    templates: tuple[str, ...] | None = None
    """Dispatch only tasks of these templates; None dispatches all."""
    task_ids: tuple[str, ...] | None = None
    """Dispatch only these tasks (a paired evaluation's instances, `rollout.evaluate`); None dispatches all."""
    run_id: str = ""
    """Run id in the event log; empty: a new one (`rollout-<8 hex digits>`)."""
    seed: int = 0
    """Seed of the policy's sampling and the dispatcher's task order."""
    model_dir: Path | None = None
    """HF model directory: the local policy's weights; with the vllm policy, loaded into the server as
    version 0."""
    vllm_url: str | None = None
    """OpenAI-compatible vLLM server of the vllm policy; None: `AWRL_VLLM_URL`."""
    episode: EpisodeConfig = EpisodeConfig()
    """How each episode runs: observations, timeouts, allowed hosts."""
    noise: float = 0.0
    """`demo` policy only: probability of a random action instead of the oracle's."""
    temperature: float = 1.0
    """Sampling temperature of model policies (0: greedy)."""
    max_batch: int = 64
    """Most waiting prompts the local policy decodes together (1: each alone)."""
    min_version: int = 0
    """Dispatch groups at this policy version at least: the pool loads it before sampling them."""
    push_address: str | None = None
    """`local` policy: also take the versions the trainer pushes to this "host:port" (`model.push`)."""
    everlasting: bool = True
    """Keep browsers for the whole run (False: relaunch after every episode, an ablation)."""
    journal_dir: Path | None = Path(".awrl/rollout-journal")
    """Where this host's pools keep their open-episode journals (`rollout.episode_journal`)."""
    curriculum: CurriculumConfig = CurriculumConfig(enabled=False)
    """Dispatch from the task families whose recent success is in band (`rollout.curriculum`); when
    not `enabled`, a seeded shuffle of every task."""
    curriculum_from: tuple[str, ...] = ()
    """Earlier runs whose ledgered outcomes seed the curriculum (e.g. the warm start's evaluation)."""
    threads: int | None = None
    """The local model's intra-op threads (torch's, process-wide, given back when the pool stops); None:
    1 beside browsers, else torch's default. `awrl run` sets its share of the cores (`RunConfig.threads`)."""


def run_rollout(
    settings: StackSettings,
    req: RolloutRequest,
    show_progress: bool = True,
    stop: threading.Event | None = None,
    on_progress=None,
    admission: Admission | None = None,
) -> PoolStats:
    """Run the pool (and the dispatcher) until `req.episodes` are done or `stop` is set.
    `on_progress(pool)` after each episode replaces the progress bar. `admission`: the staleness budget
    the dispatcher asks before each group (fed from the run's trainer events); None: no bound."""
    run_id = req.run_id or f"rollout-{uuid.uuid4().hex[:8]}"
    suite = make_suite(req.suite)
    suite.start()
    try:
        policy = make_policy(
            req.policy,
            {suite.name: suite},
            req.model_dir,
            req.vllm_url or settings.vllm_url,
            settings.vllm_model,
            seed=req.seed,
            noise=req.noise,
            checkpoints=CheckpointStore.from_settings(settings),
            temperature=req.temperature,
            max_batch=req.max_batch,
            push_address=req.push_address,
            threads=req.threads,
        )
        if req.policy == "vllm" and req.model_dir is not None and req.min_version == 0:
            # The server serves whatever it last loaded: make version 0 the weights this run starts from.
            asyncio.run(policy.refresh(0, str(req.model_dir)))
        pool = RolloutPool(
            settings,
            {suite.name: suite},
            policy,
            PoolConfig(
                workers=req.workers,
                episode=req.episode,
                run_id=run_id,
                consumer_group=f"rollout-{run_id}",
                everlasting=req.everlasting,
                journal_dir=req.journal_dir,
            ),
        )
        groups = None if req.episodes is None else math.ceil(req.episodes / req.group_size)
        stop = stop or threading.Event()
        finished = threading.Event()
        if req.dispatch:
            tasks = [
                t
                for t in suite.tasks(req.split)
                if req.difficulty in (None, t.difficulty)
                and (req.templates is None or t.template in req.templates)
                and (req.task_ids is None or t.task_id in req.task_ids)
            ]
            stream = _task_stream(settings, suite, tasks, req)
            threading.Thread(
                target=dispatch_loop,
                daemon=True,
                args=(settings, pool, run_id, stream, req, groups, finished, admission),
            ).start()
        threading.Thread(target=lambda: (stop.wait(), finished.is_set() or pool.request_stop()), daemon=True).start()
        with _progress(show_progress and on_progress is None) as (progress, update):
            stats = asyncio.run(pool.run(max_groups=groups, on_progress=on_progress or update))
        finished.set(), stop.set()
        if hasattr(policy, "close"):
            policy.close()
        return stats
    finally:
        suite.stop()


def _task_stream(settings, suite: Suite, tasks: list[Task], req: RolloutRequest) -> Iterator[Task]:
    """The dispatcher's task order: a seeded shuffle, or a curriculum fed by the ledger (earlier runs)
    and by this run's own rollout log."""
    if not req.curriculum.enabled:
        return task_stream(tasks, seed=req.seed)
    curriculum = Curriculum(tasks, req.curriculum, seed=req.seed, family_of=family_index(suite))
    seed_from_ledger(curriculum, settings, req.curriculum_from)
    return curriculum


class _progress:
    """A live progress bar, on a terminal only: in a log, rich would print its last frame cut to 80
    columns (the caller reports the finished pool's figures itself)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and Console().is_terminal

    def __enter__(self):
        if not self.enabled:
            return None, None
        self.p = Progress(
            TextColumn("[bold]rollout"), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn()
        )
        self.p.start()
        task = self.p.add_task("starting browsers", total=None)

        def update(pool: RolloutPool) -> None:
            s = pool.stats
            rate = s.successes / max(s.episodes, 1)
            self.p.update(
                task,
                description=(
                    f"episodes {s.episodes}  success {rate:.2f}  env_err {s.env_errors}  judge_err {s.judge_errors}  "
                    f"steps/s {s.steps_per_s:.2f}  policy v{pool.policy.version}  "
                    f"dispatch paused {s.dispatch_paused_s:.0f}s"
                ),
            )

        return self.p, update

    def __exit__(self, *exc):
        if self.enabled:
            self.p.stop()
