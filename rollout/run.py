"""`awrl rollout`: wire suites, a policy and the pool together, with a live progress line."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from pipeline.bus import EventProducer
from pipeline.settings import StackSettings
from rollout.dispatcher import dispatch, task_stream
from rollout.episode import EpisodeConfig
from rollout.pool import PoolConfig, PoolStats, RolloutPool
from rollout.types import Policy, Suite

SUITES = ("sites", "miniwob")
POLICIES = ("oracle", "random", "local", "vllm")


def make_suite(name: str) -> Suite:
    if name == "sites":
        from rollout.suites.sites import SitesSuite

        return SitesSuite()
    if name == "miniwob":
        from rollout.suites.miniwob import MiniWobSuite

        return MiniWobSuite()
    raise ValueError(f"unknown suite {name!r}; choose from {SUITES}")


def make_policy(name: str, suites: dict[str, Suite], model_dir: Path | None = None,
                vllm_url: str | None = None, vllm_model: str | None = None, seed: int = 0) -> Policy:
    if name == "oracle":
        from rollout.policy.scripted import OraclePolicy

        return OraclePolicy(suites)
    if name == "random":
        from rollout.policy.scripted import RandomPolicy

        return RandomPolicy(seed=seed)
    if name == "local":
        from rollout.policy.local import LocalPolicy

        return LocalPolicy(model_dir, seed=seed) if model_dir else LocalPolicy(seed=seed)
    if name == "vllm":
        from rollout.policy.vllm_client import VLLMPolicy

        if not vllm_url:
            raise ValueError("--policy vllm needs --vllm-url")
        return VLLMPolicy(vllm_url, vllm_model or "policy")
    raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")


@dataclass(frozen=True)
class RolloutRequest:
    suite: str = "sites"
    policy: str = "oracle"
    workers: int = 4
    group_size: int = 4
    episodes: int | None = 16
    """Stop after this many episodes (rounded up to whole groups); None runs forever."""
    dispatch: bool = True
    """Also act as the dispatcher (one process); turn off when a separate dispatcher runs."""
    split: str = "train"
    run_id: str = ""
    seed: int = 0
    model_dir: Path | None = None
    vllm_url: str | None = None
    episode: EpisodeConfig = EpisodeConfig()


def run_rollout(settings: StackSettings, req: RolloutRequest, show_progress: bool = True) -> PoolStats:
    run_id = req.run_id or f"rollout-{uuid.uuid4().hex[:8]}"
    suite = make_suite(req.suite)
    suite.start()
    try:
        policy = make_policy(req.policy, {suite.name: suite}, req.model_dir, req.vllm_url, seed=req.seed)
        pool = RolloutPool(settings, {suite.name: suite}, policy,
                           PoolConfig(workers=req.workers, episode=req.episode))
        groups = None if req.episodes is None else math.ceil(req.episodes / req.group_size)
        stop = threading.Event()
        if req.dispatch:
            tasks = task_stream(suite.tasks(req.split), seed=req.seed)
            threading.Thread(target=_dispatch_loop, args=(settings, pool, run_id, tasks, req, groups, stop),
                             daemon=True).start()
        with _progress(show_progress) as (progress, update):
            stats = asyncio.run(pool.run(max_groups=groups, on_progress=update))
        stop.set()
        return stats
    finally:
        suite.stop()


def _dispatch_loop(settings, pool: RolloutPool, run_id, tasks, req: RolloutRequest, groups, stop) -> None:
    """Keep a small backlog of groups ahead of the pool (finite runs dispatch exactly `groups`)."""
    producer = EventProducer(settings, client_id="dispatcher")
    backlog = max(2, 2 * req.workers // req.group_size)
    sent = 0
    try:
        while not stop.is_set() and (groups is None or sent < groups):
            if sent - pool.stats.groups < backlog:
                n = min(backlog - (sent - pool.stats.groups), (groups - sent) if groups else backlog)
                dispatch(producer, run_id, tasks, n, req.group_size, version=pool.policy.version)
                sent += n
            time.sleep(0.2)
    finally:
        producer.close()


class _progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            return None, None
        self.p = Progress(TextColumn("[bold]rollout"), BarColumn(), TextColumn("{task.description}"),
                          TimeElapsedColumn())
        self.p.start()
        task = self.p.add_task("starting browsers", total=None)

        def update(pool: RolloutPool) -> None:
            s = pool.stats
            rate = s.successes / max(s.episodes, 1)
            self.p.update(task, description=(
                f"episodes {s.episodes}  success {rate:.2f}  env_err {s.env_errors}  "
                f"steps/s {s.steps_per_s:.2f}  policy v{pool.policy.version}"))

        return self.p, update

    def __exit__(self, *exc):
        if self.enabled:
            self.p.stop()
