"""A run's timeline as a picture, like the papers' pipeline figure: one lane per browser worker (each
episode a bar, green for success), one for the trainer's compute, one for checkpoint publishing.

    timeline_png(connect(settings), "async-1a2b", Path("bench/out/timeline-async.png"))

Gaps in the worker lanes are idle browsers; gaps in the trainer lane are an idle trainer. Everything is
read from the ledger: episode start and end events, and each update's and version's own timings.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from analysis.plotting import plt, save

EPISODES = """
    select s.worker_id, epoch(s.emitted_at) as t0, epoch(f.emitted_at) as t1, f.outcome = 'success' as won
    from episode_started s join episode_finished f using (run_id, trajectory_id)
    where s.run_id = $run order by t0"""
UPDATES = """select epoch(emitted_at) - compute_s as t0, epoch(emitted_at) as t1 from update_applied
             where run_id = $run"""
PUBLISHES = """select epoch(emitted_at) - publish_s as t0, epoch(emitted_at) as t1 from policy_version_published
               where run_id = $run"""


def timeline_png(con: duckdb.DuckDBPyConnection, run_id: str, path: Path, title: str | None = None) -> Path:
    episodes = con.execute(EPISODES, {"run": run_id}).fetchall()
    updates = con.execute(UPDATES, {"run": run_id}).fetchall()
    publishes = con.execute(PUBLISHES, {"run": run_id}).fetchall()
    if not episodes:
        raise ValueError(f"run {run_id!r} has no finished episodes in the ledger")
    origin = min(t0 for _, t0, _, _ in episodes)
    workers = sorted({w for w, *_ in episodes})
    lanes = [*workers, "trainer", "publish"]
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(lanes) + 1.2))
    for worker, t0, t1, won in episodes:
        ax.broken_barh(
            [(t0 - origin, t1 - t0)],
            (lanes.index(worker) - 0.4, 0.8),
            facecolors="tab:green" if won else "tab:gray",
            edgecolor="white",
            linewidth=0.5,
        )
    for lane, spans, colour in (("trainer", updates, "tab:blue"), ("publish", publishes, "tab:orange")):
        ax.broken_barh([(t0 - origin, t1 - t0) for t0, t1 in spans], (lanes.index(lane) - 0.4, 0.8), facecolors=colour)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first episode")
    ax.set_title(title or f"timeline of {run_id}")
    return save(fig, Path(path))
