"""Open-episode journals: what a rollout process has started and not yet finished, on local disk.

A pool process killed outright (SIGKILL, the OOM killer) cannot end its own episodes. Its group's
dispatch offset is uncommitted, so another pool re-runs the group with new trajectories; but the
dead process's half-done trajectories would stay open in the ledger forever. Each pool therefore
keeps a journal of its own (`<pid>-<start time>.jsonl`), and every pool on the host looks for
journals whose process is gone (at start and then periodically) and ends their open episodes as
`env_error`, naming the dead process. Claiming a journal is an atomic rename, and the closing
event's id is derived from the trajectory id, so two pools reaping at once cannot close one twice.

The journal is written ahead: each event of an episode is in it (whole) before it is sent, and the
episode leaves it only once its ending was sent. A process killed between the two therefore left an
event the reaper can send again (the ledger keeps one row per event id), never one the reaper does not
know of: written after the send, a step that reached the broker and not the journal made the reaper end
its episode with one step fewer than the ledger holds (seen once in CI's chaos soak). So the reaper
sends a dead process's open episodes whole: its started event, its steps, and its own ending if it was
written, else an `env_error` ending whose `num_steps` counts exactly the steps it sends.

The file is rewritten with only the open episodes whenever `compact_bytes` were appended since the last
rewrite (an atomic replace), so an everlasting pool's journal stays the size of its open episodes.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import psutil
from pydantic import ValidationError

from schemas import EpisodeFinished, EpisodeStarted, Event, StepRecorded
from schemas.events import decode_event

_CLAIMED = ".reaping-"
_EVENT, _SENT = "E ", "S "
"""Line kinds: `E <event JSON>` written before the event is sent; `S <trajectory id>` once its ending was."""


def _start_time(pid: int) -> str | None:
    """The process's start time (with the PID, a unique name for the process)."""
    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except psutil.Error:
        return None


def _alive(pid: int, start: str) -> bool:
    return _start_time(pid) == start


class EpisodeJournal:
    """This process's journal: `record` each episode event before sending it, and `sent` its ending
    after."""

    def __init__(self, directory: Path, compact_bytes: int = 8 << 20):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{os.getpid()}-{_start_time(os.getpid())}.jsonl"
        self.compact_bytes = compact_bytes
        self._file = self.path.open("a", buffering=1)  # line-buffered: a line survives our SIGKILL
        self._open: dict[str, list[str]] = {}  # trajectory id -> its lines, for a rewrite
        self._appended = 0

    def record(self, event: Event) -> None:
        """Before `event` is sent: an episode's started, step and finished events are journaled whole."""
        if not isinstance(event, EpisodeStarted | StepRecorded | EpisodeFinished):
            return
        line = _EVENT + event.model_dump_json() + "\n"
        self._open.setdefault(event.trajectory_id, []).append(line)
        self._write(line)

    def sent(self, event: Event) -> None:
        """After `event` was sent: an ending closes its episode, which no reaper then sends again."""
        if isinstance(event, EpisodeFinished) and self._open.pop(event.trajectory_id, None) is not None:
            self._write(_SENT + event.trajectory_id + "\n")

    def _write(self, line: str) -> None:
        self._file.write(line)
        self._appended += len(line)
        if self._appended >= self.compact_bytes:
            self._rewrite()

    def _rewrite(self) -> None:
        """Replace the file by the open episodes' lines: a reader sees the old file or the new, whole."""
        part = self.path.with_name(self.path.name + ".part")  # not `.jsonl`: no reaper claims it
        with part.open("w") as f:
            f.writelines(line for lines in self._open.values() for line in lines)
        self._file.close()
        os.replace(part, self.path)
        self._file = self.path.open("a", buffering=1)
        self._appended = 0

    def close(self) -> None:
        """Remove the journal when nothing is open; otherwise leave it for the next reaper (episodes
        cancelled at shutdown end as env_error too, like a crash's)."""
        self._file.close()
        if not self._open:
            self.path.unlink(missing_ok=True)


def orphans(path: Path) -> list[Event]:
    """What a dead process's journal says must be sent again: every event of each episode it left
    open, in order, ended by its own `EpisodeFinished` or by an `env_error` one."""
    episodes: dict[str, list[Event]] = {}
    for line in path.read_text().splitlines():
        if line.startswith(_SENT):
            episodes.pop(line.removeprefix(_SENT), None)
            continue
        try:
            event = decode_event(line.removeprefix(_EVENT))
        except ValidationError:  # the last line, cut short by the kill: that event was never sent
            continue
        episodes.setdefault(event.trajectory_id, []).append(event)
    pid = path.name.split("-", 1)[0]
    return [e for events in episodes.values() if events for e in _ended(events, pid)]


def _ended(events: list[Event], pid: str) -> list[Event]:
    """One open episode's events, with an `env_error` ending unless its own was journaled."""
    if isinstance(events[-1], EpisodeFinished):
        return events
    started = next((e for e in events if isinstance(e, EpisodeStarted)), None)
    if started is None:  # cannot happen (a step is journaled after its start); nothing to end it by
        return events
    steps = sum(isinstance(e, StepRecorded) for e in events)
    ending = EpisodeFinished(
        event_id=uuid.uuid5(uuid.NAMESPACE_URL, f"awrl:orphan:{started.trajectory_id}").hex,
        run_id=started.run_id,
        trajectory_id=started.trajectory_id,
        group_id=started.group_id,
        task_id=started.task_id,
        outcome="env_error",
        reward=0.0,
        num_steps=steps,
        reason=f"rollout process {pid} died mid-episode (its group is re-run)",
        answer=None,
    )
    return [*events, ending]


def reap(directory: Path, publish_all) -> int:
    """Send again the open episodes of every dead process's journal in `directory`, ended; returns how
    many episodes. `publish_all(events)` must return only once the broker acknowledged them all."""
    if not directory.exists():
        return 0
    closed = 0
    for path in sorted(directory.iterdir()):
        if path.name.endswith(".part") and _dead_owner(path.name.removesuffix(".part")):
            path.unlink(missing_ok=True)  # a rewrite its process never finished: the journal is whole
            continue
        claimed = _claim(path)
        if claimed is None:
            continue
        events = orphans(claimed)
        if events:
            publish_all(events)
        claimed.unlink()
        closed += sum(isinstance(e, EpisodeFinished) for e in events)
    return closed


def _dead_owner(name: str) -> bool:
    pid, _, start = name.removesuffix(".jsonl").partition("-")
    return pid.isdigit() and not _alive(int(pid), start)


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
    if not _dead_owner(owner):
        return None
    target = path.with_name(f"{rest}{_CLAIMED}{me}")
    try:
        os.rename(path, target)
    except FileNotFoundError:  # another pool claimed it first
        return None
    return target
