"""The trainer on the real stack from recorded events (no browsers): the `awrl train` entry point on
two nodes and a published architecture, resume after a normal stop with another node count, and after
SIGKILL of the whole torchrun process group: versions continue, no group is trained twice, none is lost."""

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

import psutil
import torch

from analysis.replay import replay
from model.architectures import make_policy
from model.hf_io import save_policy
from model.prompt import render_prompt
from pipeline.bus import EventProducer
from pipeline.checkpoints import CheckpointStore
from pipeline.consumer import read_log
from pipeline.hashing import sha256_hex
from pipeline.ledger import LedgerWriter
from pipeline.stack.process import dies_with_parent, free_port
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


def publish_groups(settings, run_id: str, groups: int, first: int = 0, policy: LocalPolicy | None = None) -> list[str]:
    """Groups of two one-step trajectories (rewards 1, 0) sampled from `policy` (the tiny VLM), as a
    pool would. `first` numbers a later batch of the same run after the earlier ones."""
    policy = policy or _policy()
    store, producer, ids = ScreenshotStore.from_settings(settings), EventProducer(settings), []
    store.ensure_bucket()
    for g in range(first, first + groups):
        group_id, events, tids = f"{run_id}-g{g}", [], []
        for t in range(2):
            png = render_page(f"{run_id} {g} {t}", size=(320, 240), seed=g * 2 + t)
            obs = _observation(png, sha256_hex(png))
            store.put(png)
            out = policy.generate(*render_prompt(obs))
            tids.append(f"{group_id}-t{t}")
            events.append(
                sample_step(run_id, group_id, tids[-1], 0, sha256_hex(png)).model_copy(
                    update={
                        "prompt_token_ids": out.prompt_token_ids,
                        "response_token_ids": out.response_token_ids,
                        "behave_logprobs": out.logprobs,
                        "token_policy_versions": out.token_policy_versions,
                    }
                )
            )
        events.append(
            GroupCompleted(
                run_id=run_id,
                group_id=group_id,
                task_id="t",
                trajectory_ids=tids,
                rewards=[1.0, 0.0],
                num_steps=[1, 1],
                outcomes=["success", "failure"],
                min_policy_version=0,
                max_policy_version=0,
            )
        )
        producer.publish_all(events)
        ids.append(group_id)
    producer.close()
    return ids


def _observation(png: bytes, sha: str) -> Observation:
    return Observation(
        instruction="buy it",
        screenshots=[png],
        screenshot_sha256=[sha],
        url="http://127.0.0.1/",
        feedback="",
        history=[],
        memory={},
        marks=[Mark(1, "button", "Buy", 10, 10, 50, 20)],
        som=True,
        step=0,
        horizon=10,
        viewport=(320, 240),
    )


def trainer_events(settings, run_id: str):
    return [e for e in read_log(settings, TRAINER) if e.run_id == run_id]


def published(events) -> list[PolicyVersionPublished]:
    return sorted((e for e in events if isinstance(e, PolicyVersionPublished)), key=lambda e: e.version)


def test_two_nodes_train_a_qwen3_vl_2b_architecture_one_node_resumes_and_replay_is_exact(settings, tmp_path):
    """The whole path on a published architecture (Qwen3-VL-2B, 16x narrower, every layer kept):
    sampling, two `awrl train` processes as two nodes of one rank each (c10d rendezvous on 127.0.0.1)
    training two updates, one node resuming with a different node count, the sampler reloading the
    published version, and replay reproducing every update bit for bit."""
    model, tokenizer = make_policy("qwen3-vl-2b", narrow=16, seed=3)
    model_dir = save_policy(model, tokenizer, tmp_path / "qwen3-vl-2b-narrow16")
    sampler = LocalPolicy(model_dir, max_new_tokens=10, seed=2, checkpoints=CheckpointStore.from_settings(settings))
    run_id = f"nodes-{uuid.uuid4().hex[:6]}"
    groups = publish_groups(settings, run_id, 3, policy=sampler)
    env = {**os.environ, **settings.environ()}
    train = [
        sys.executable,
        "-m",
        "app.cli",
        "train",
        "--run-id",
        run_id,
        "--model-dir",
        str(model_dir),
        "--groups-per-update",
        "1",
        "--batch-timeout-s",
        "20",
        "--kl-coef",
        "0.1",
    ]

    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [*train, "--max-updates", "2", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=400)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2500:] for o in outputs)
    events = trainer_events(settings, run_id)
    assert [v.version for v in published(events)] == [0, 1, 2]
    assert all(u.world_size == 2 for u in events if isinstance(u, UpdateApplied))

    # one node, one rank: the 2-rank DCP state resharded, the last group trained
    out = subprocess.run([*train, "--max-updates", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    events = trainer_events(settings, run_id)
    versions = published(events)
    assert [v.version for v in versions] == [0, 1, 2, 3] and versions[-1].parent_version == 2
    updates = sorted((e for e in events if isinstance(e, UpdateApplied)), key=lambda u: u.update_step)
    assert [u.world_size for u in updates] == [2, 2, 1]
    assert sorted(g for u in updates for g in u.group_ids) == sorted(groups)
    assert [v.checkpoint_sha256 == stored_sha256(settings, v) for v in versions] == [True] * 4
    # pi_ref stays version 0 across the restart: each step's KL is measured before it moves the weights,
    # so the first is 0 and the resumed one (at v2) is not, as it would be with the resume point as pi_ref
    assert updates[0].stats["kl_ref"] == 0 and updates[2].stats["kl_ref"] > 0

    # the sampler loads the last version in place and acts with it
    before = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    sampler.load_weights(versions[-1].version, versions[-1].checkpoint_uri)
    assert any(not torch.equal(v, before[k]) for k, v in sampler.model.state_dict().items())
    png = render_page("after the update", size=(320, 240), seed=9)
    act = sampler.generate(*render_prompt(_observation(png, sha256_hex(png))))
    assert set(act.token_policy_versions) == {3}

    ledger = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(ledger).sync(idle_exit_s=2)
    assert [b.exact for b in replay(ledger, run_id)] == [True, True, True]


def test_sigkilled_trainer_resumes_without_losing_or_repeating_a_group(settings, tmp_path):
    run_id = f"kill-{uuid.uuid4().hex[:6]}"
    groups = publish_groups(settings, run_id, 5)
    env = {**os.environ, **settings.environ()}
    # every recorded group is at version 0: a staleness bound above 5 keeps all five trainable
    config = TrainConfig(run_id=run_id, groups_per_update=1, eta=8, max_updates=5, batch_timeout_s=20, slow_s=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.model_dump_json())
        proc = subprocess.Popen(
            torchrun_command(config, path, 2),
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(published(trainer_events(settings, run_id))) < 3:
            time.sleep(1)
        ranks = psutil.Process(proc.pid).children(recursive=True)  # each in a session of its own
        assert len([r for r in ranks if "trainer.train" in " ".join(r.cmdline())]) == 2
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun, mid-run: its ranks die with it (not in its group)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=15)
        assert alive == [], alive  # else they would train on beside the resumed trainer
        killed_at = len(published(trainer_events(settings, run_id))) - 1
        assert 2 <= killed_at < 5
        out = subprocess.run(torchrun_command(config, path, 2), env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]

    events = trainer_events(settings, run_id)
    versions = published(events)
    assert [v.version for v in versions] == list(range(6)), out.stdout[-2000:]
    lineage = {u for v in versions for u in v.update_ids}
    updates = [e for e in events if isinstance(e, UpdateApplied) and e.event_id in lineage]
    assert [s for s, n in Counter(u.update_step for u in updates).items() if n > 1] == []  # none applied twice
    assert [u.update_step for u in updates] == list(range(5))
    assert sorted(g for u in updates for g in u.group_ids) == sorted(groups)  # each group exactly once
    for v, _update in zip(versions[1:], updates):  # zip: only the versions that have an update
        assert v.parent_version == v.version - 1 and v.checkpoint_sha256 == stored_sha256(settings, v)

    # The kill may leave an update outside the lineage (sent, never published): the ledger must
    # still hold every event the broker acknowledged, once.
    ledger = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(ledger).sync(idle_exit_s=2)
    row = account(
        "trainer SIGKILLed mid-run (2 ranks)",
        log_ids(settings, run_id),
        ledger,
        run_id,
        note=f"killed after v{killed_at}; resumed to v5, update steps 0-4 once each",
    )
    assert row.lost == 0 and row.duplicated == 0 and row.rows == row.produced, row
    # The resumed trainer restored the sharded optimizer state the killed one stored: replay, which
    # starts every batch from that stored state, reproduces every update bit for bit.
    assert all(b.exact for b in replay(ledger, run_id))


def test_what_the_launcher_starts_dies_with_the_launcher():
    """`awrl train` SIGKILLed: the torchrun it started (in a session of its own) goes with it."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "p = subprocess.Popen(sys.argv[1:], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(60)",
            *dies_with_parent(["sleep", "60"]),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = psutil.Process(int(launcher.stdout.readline()))
    deadline = time.monotonic() + 30
    while child.name() != "sleep" and time.monotonic() < deadline:  # setpriv has asked, then exec'd it
        time.sleep(0.05)
    launcher.kill()
    launcher.wait()
    child.wait(timeout=10)  # raises if it outlives the launcher by 10 s (`sleep 60` would)
    assert not child.is_running()
