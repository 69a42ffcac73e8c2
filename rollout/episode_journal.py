"""Open-episode journals: what a rollout process has started and not yet finished, on local disk.

A pool process killed outright (SIGKILL, the OOM killer) cannot end its own episodes. Its group's
dispatch offset is uncommitted, so another pool re-runs the group with new trajectories; but the
dead process's half-done trajectories would stay open in the ledger forever. Each pool therefore
appends to a journal of its own (`<pid>-<start time>.jsonl`), and every pool on the host looks for
journals whose process is gone (at start and then periodically) and ends their open episodes as
`env_error`, naming the dead process. Claiming a journal is an atomic rename, and the closing
event's id is derived from the trajectory id, so two pools reaping at once cannot close one twice.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import psutil

from schemas import EpisodeFinished, EpisodeStarted, Event, StepRecorded

_CLAIMED = ".reaping-"


def _start_time(pid: int) -> str | None:
    """The process's start time (with the PID, a unique name for the process)."""
    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except psutil.Error:
        return None


def _alive(pid: int, start: str) -> bool:
    return _start_time(pid) == start


class EpisodeJournal:
    """This process's journal; `record` each event the pool emits."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{os.getpid()}-{_start_time(os.getpid())}.jsonl"
        self._file = self.path.open("a", buffering=1)  # line-buffered: a line survives our SIGKILL
        self._open: set[str] = set()

    def record(self, event: Event) -> None:
        if isinstance(event, EpisodeStarted):
            self._open.add(event.trajectory_id)
            line = {"op": "start", "event": event.model_dump(mode="json")}
        elif isinstance(event, StepRecorded):
            line = {"op": "step", "trajectory_id": event.trajectory_id}
        elif isinstance(event, EpisodeFinished):
            self._open.discard(event.trajectory_id)
            line = {"op": "end", "trajectory_id": event.trajectory_id}
        else:
            return
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        """Remove the journal when nothing is open; otherwise leave it for the next reaper (episodes
        cancelled at shutdown end as env_error too, like a crash's)."""
        self._file.close()
        if not self._open:
            self.path.unlink(missing_ok=True)


def orphans(path: Path) -> list[EpisodeFinished]:
    """`env_error` endings for the episodes a journal left open."""
    started: dict[str, dict] = {}
    steps: dict[str, int] = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # the last line, cut short by the kill
            continue
        if entry["op"] == "start":
            started[entry["event"]["trajectory_id"]] = entry["event"]
        elif entry["op"] == "step":
            steps[entry["trajectory_id"]] = steps.get(entry["trajectory_id"], 0) + 1
        else:
            started.pop(entry["trajectory_id"], None)
    pid = path.name.split("-", 1)[0]
    return [
        EpisodeFinished(
            event_id=uuid.uuid5(uuid.NAMESPACE_URL, f"awrl:orphan:{tid}").hex,
            run_id=e["run_id"],
            trajectory_id=tid,
            group_id=e["group_id"],
            task_id=e["task_id"],
            outcome="env_error",
            reward=0.0,
            num_steps=steps.get(tid, 0),
            reason=f"rollout process {pid} died mid-episode (its group is re-run)",
            answer=None,
        )
        for tid, e in started.items()
    ]


def reap(directory: Path, publish_all) -> int:
    """End the open episodes of every dead process's journal in `directory`; returns how many.
    `publish_all(events)` must return only once the broker acknowledged them all."""
    if not directory.exists():
        return 0
    closed = 0
    for path in sorted(directory.iterdir()):
        claimed = _claim(path)
        if claimed is None:
            continue
        events = orphans(claimed)
        if events:
            publish_all(events)
        claimed.unlink()
        closed += len(events)
    return closed


def _claim(path: Path) -> Path | None:
    """Rename a dead process's journal (or a dead reaper's claim) to our claim; None if not ours to take."""
    name = path.name
    if _CLAIMED in name:  # a reaper's claim: take it over only if that reaper died too
        rest, owner = name.split(_CLAIMED, 1)
    elif name.endswith(".jsonl"):
        rest, owner = name, name.removesuffix(".jsonl")
    else:
        return None
    me = f"{os.getpid()}-{_start_time(os.getpid())}"
    if owner == me and _CLAIMED in name:  # ours, from an attempt whose publish failed: try again
        return path
    pid, _, start = owner.partition("-")
    if not pid.isdigit() or _alive(int(pid), start):
        return None
    target = path.with_name(f"{rest}{_CLAIMED}{me}")
    try:
        os.rename(path, target)
    except FileNotFoundError:  # another pool claimed it first
        return None
    return target
