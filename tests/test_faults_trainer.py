"""Fault matrix, trainer side: a stored screenshot goes bad between rollout and training.

The object under the screenshot's hash is overwritten with other bytes (bit rot, a buggy copy), or is
gone. The trainer must notice before the group reaches a batch, drop that group with a reason and a
count, keep training the others, and the ledger must still hold every event exactly once.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
import uuid

from pipeline.bus import EventProducer
from pipeline.consumer import read_log
from pipeline.ledger import LedgerWriter
from pipeline.store import ScreenshotStore
from pipeline.topics import ROLLOUT
from schemas import GroupDropped, StepRecorded, UpdateApplied
from trainer.batch import BatchBuilder
from trainer.config import TrainConfig
from trainer.launch import torchrun_command

from faults import account, log_ids
from samples import sample_group
from test_train_resume import publish_groups, published, trainer_events


def corrupt_one_screenshot(settings, run_id: str, group_id: str) -> str:
    """Overwrite one of the group's stored screenshots in place (same key, one byte flipped)."""
    sha = next(
        e.screenshot_sha256
        for e in read_log(settings, ROLLOUT)
        if isinstance(e, StepRecorded) and e.run_id == run_id and e.group_id == group_id
    )
    store = ScreenshotStore.from_settings(settings)
    data = bytearray(store.get(sha))
    data[len(data) // 2] ^= 0xFF
    store.client.put_object(store.bucket, store.key(sha), io.BytesIO(bytes(data)), len(data))
    return sha


def wait_for_drop(settings, run_id: str, proc: subprocess.Popen, deadline_s: float = 240) -> None:
    """Return once the trainer has dropped a group (or exited: the caller's asserts then explain)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and proc.poll() is None:
        if any(isinstance(e, GroupDropped) for e in trainer_events(settings, run_id)):
            return
        time.sleep(1)


def test_corrupted_screenshot_drops_its_group_and_training_goes_on(settings, tmp_path):
    run_id = f"rot-{uuid.uuid4().hex[:6]}"
    healthy = publish_groups(settings, run_id, 1)
    (damaged,) = publish_groups(settings, run_id, 1, first=1)
    corrupt_one_screenshot(settings, run_id, damaged)
    # Two updates need two healthy groups; the second is published only once the damaged one was
    # dropped, so the trainer cannot reach its last update without having judged the damaged group.
    config = TrainConfig(run_id=run_id, groups_per_update=1, eta=8, max_updates=2, batch_timeout_s=60)
    path = tmp_path / "config.json"
    path.write_text(config.model_dump_json())
    log = tmp_path / "trainer.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            torchrun_command(config, path, 1),
            env={**os.environ, **settings.environ()},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_drop(settings, run_id, proc)
            healthy += publish_groups(settings, run_id, 1, first=2)
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    events = trainer_events(settings, run_id)
    drops = [e for e in events if isinstance(e, GroupDropped)]
    assert [(d.group_id, d.reason) for d in drops] == [(damaged, "screenshot_corrupted")]
    assert f"dropping group {damaged} (screenshot_corrupted)" in log.read_text()
    updates = [e for e in events if isinstance(e, UpdateApplied)]
    assert sorted(g for u in updates for g in u.group_ids) == sorted(healthy)  # the damaged one never
    assert max(updates, key=lambda u: u.update_step).stats["groups_dropped"] == 1  # counted
    assert [v.version for v in published(events)] == [0, 1, 2]

    ledger = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(ledger).sync(idle_exit_s=2)
    row = account(
        "stored screenshot corrupted",
        log_ids(settings, run_id),
        ledger,
        run_id,
        note=f"group dropped as screenshot_corrupted; {len(healthy)} others trained",
    )
    assert row.lost == 0 and row.duplicated == 0 and row.rows == row.produced, row


def test_a_group_whose_screenshot_is_missing_is_dropped(settings, tmp_path):
    run_id = f"gone-{uuid.uuid4().hex[:6]}"
    never_stored = uuid.uuid4().hex * 2
    producer = EventProducer(settings)
    producer.publish_all(sample_group(run_id, "g0", [never_stored], group_size=2, steps=1, seed=1))
    config = TrainConfig(run_id=run_id, groups_per_update=1, dynamic_sampling=False, batch_timeout_s=1)
    builder = BatchBuilder(settings, config, producer)
    try:
        deadline = time.monotonic() + 60
        while not builder.stats.dropped and time.monotonic() < deadline:
            assert builder.next_batch(0) is None  # nothing may reach a batch
        builder.commit()
    finally:
        builder.close()
        producer.close()
    assert dict(builder.stats.dropped) == {"screenshot_missing": 1}
    drops = [e for e in trainer_events(settings, run_id) if isinstance(e, GroupDropped)]
    assert [(d.group_id, d.reason) for d in drops] == [("g0", "screenshot_missing")]

    ledger = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(ledger).sync(idle_exit_s=2)
    row = account(
        "stored screenshot missing",
        log_ids(settings, run_id),
        ledger,
        run_id,
        note="group dropped as screenshot_missing by the batch builder",
    )
    assert row.lost == 0 and row.duplicated == 0 and row.rows == row.produced, row
