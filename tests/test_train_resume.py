"""The trainer on the real stack from recorded events (no browsers): the `awrl train` entry point,
resume after a normal stop, and after SIGKILL of the whole torchrun process group: versions continue,
no group is trained twice, none is lost."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

from analysis.replay import replay
from model.prompt import render_prompt
from pipeline.bus import EventProducer, read_log
from pipeline.hashing import sha256_hex
from pipeline.ledger import LedgerWriter
from pipeline.store import ScreenshotStore
from pipeline.topics import TRAINER
from rollout.policy.local import LocalPolicy
from schemas import GroupCompleted, PolicyVersionPublished, UpdateApplied
from schemas.observation import Mark, Observation
from trainer.config import TrainConfig
from trainer.launch import torchrun_command

from faults import account, log_ids
from samples import render_page, sample_step, stored_sha256


@functools.cache
def _policy() -> LocalPolicy:
    return LocalPolicy(max_new_tokens=10, seed=2)


def publish_groups(settings, run_id: str, groups: int, first: int = 0) -> list[str]:
    """Groups of two one-step trajectories (rewards 1, 0) sampled from the tiny VLM, as a pool would.
    `first` numbers a later batch of the same run after the earlier ones."""
    store, producer, ids = ScreenshotStore.from_settings(settings), EventProducer(settings), []
    store.ensure_bucket()
    for g in range(first, first + groups):
        group_id, events, tids = f"{run_id}-g{g}", [], []
        for t in range(2):
            png = render_page(f"{run_id} {g} {t}", size=(320, 240), seed=g * 2 + t)
            obs = Observation(instruction="buy it", screenshots=[png], screenshot_sha256=[sha256_hex(png)],
                              url="http://127.0.0.1/", feedback="", history=[], memory={},
                              marks=[Mark(1, "button", "Buy", 10, 10, 50, 20)], som=True, step=0, horizon=10,
                              viewport=(320, 240))
            store.put(png)
            out = _policy().generate(*render_prompt(obs))
            tids.append(f"{group_id}-t{t}")
            events.append(sample_step(run_id, group_id, tids[-1], 0, sha256_hex(png)).model_copy(update={
                "prompt_token_ids": out.prompt_token_ids, "response_token_ids": out.response_token_ids,
                "behave_logprobs": out.logprobs, "token_policy_versions": out.token_policy_versions}))
        events.append(GroupCompleted(run_id=run_id, group_id=group_id, task_id="t", trajectory_ids=tids,
                                     rewards=[1.0, 0.0], num_steps=[1, 1], outcomes=["success", "failure"],
                                     min_policy_version=0, max_policy_version=0))
        producer.publish_all(events)
        ids.append(group_id)
    producer.close()
    return ids


def trainer_events(settings, run_id: str):
    return [e for e in read_log(settings, TRAINER) if e.run_id == run_id]


def published(events) -> list[PolicyVersionPublished]:
    return sorted((e for e in events if isinstance(e, PolicyVersionPublished)), key=lambda e: e.version)


def test_awrl_train_cli_trains_and_resumes(settings):
    run_id = f"cli-{uuid.uuid4().hex[:6]}"
    groups = publish_groups(settings, run_id, 3)
    env = {**os.environ, **settings.environ()}

    def train(max_updates: int, nproc: int) -> None:
        cmd = [sys.executable, "-m", "app.cli", "train", "--run-id", run_id, "--groups-per-update", "1",
               "--max-updates", str(max_updates), "--batch-timeout-s", "20", "--kl-coef", "0.1", "--nproc", str(nproc)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    train(2, nproc=1)
    assert [v.version for v in published(trainer_events(settings, run_id))] == [0, 1, 2]
    train(3, nproc=2)  # resumes at version 2, its 1-rank DCP state resharded over 2 ranks, and trains the last group
    events = trainer_events(settings, run_id)
    versions = published(events)
    assert [v.version for v in versions] == [0, 1, 2, 3] and versions[-1].parent_version == 2
    updates = sorted((e for e in events if isinstance(e, UpdateApplied)), key=lambda u: u.update_step)
    assert sorted(g for u in updates for g in u.group_ids) == sorted(groups)
    # pi_ref stays version 0 across the restart: each step's KL is measured before it moves the weights,
    # so the first is 0 and the resumed one (at v2) is not, as it would be with the resume point as pi_ref
    assert updates[0].stats["kl_ref"] == 0 and updates[2].stats["kl_ref"] > 0


def test_sigkilled_trainer_resumes_without_losing_or_repeating_a_group(settings, tmp_path):
    run_id = f"kill-{uuid.uuid4().hex[:6]}"
    groups = publish_groups(settings, run_id, 5)
    env = {**os.environ, **settings.environ()}
    # every recorded group is at version 0: a staleness bound above 5 keeps all five trainable
    config = TrainConfig(run_id=run_id, groups_per_update=1, eta=8, max_updates=5, batch_timeout_s=20, slow_s=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.model_dump_json())
        proc = subprocess.Popen(torchrun_command(path, 2), env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(published(trainer_events(settings, run_id))) < 3:
            time.sleep(1)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run
        proc.wait(timeout=30)
        killed_at = len(published(trainer_events(settings, run_id))) - 1
        assert 2 <= killed_at < 5
        out = subprocess.run(torchrun_command(path, 2), env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]

    events = trainer_events(settings, run_id)
    versions = published(events)
    assert [v.version for v in versions] == list(range(6)), out.stdout[-2000:]
    lineage = {u for v in versions for u in v.update_ids}
    updates = [e for e in events if isinstance(e, UpdateApplied) and e.event_id in lineage]
    assert [s for s, n in Counter(u.update_step for u in updates).items() if n > 1] == []  # none applied twice
    assert [u.update_step for u in updates] == list(range(5))
    assert sorted(g for u in updates for g in u.group_ids) == sorted(groups)  # each group exactly once
    for v, u in zip(versions[1:], updates):
        assert v.parent_version == v.version - 1 and v.checkpoint_sha256 == stored_sha256(settings, v)

    # The kill may leave an update outside the lineage (sent, never published): the ledger must
    # still hold every event the broker acknowledged, once.
    ledger = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(ledger).sync(idle_exit_s=2)
    row = account("trainer SIGKILLed mid-run (2 ranks)", log_ids(settings, run_id), ledger, run_id,
                  note=f"killed after v{killed_at}; resumed to v5, update steps 0-4 once each")
    assert row.lost == 0 and row.duplicated == 0 and row.rows == row.produced, row
    # The resumed trainer restored the sharded optimizer state the killed one stored: replay, which
    # starts every batch from that stored state, reproduces every update bit for bit.
    assert all(b.exact for b in replay(ledger, run_id))
