"""Pictures of training outcomes: a learning curve (success rate with its 95% interval against
training time) and a re-batching's staleness and advantage histograms.

    learning_curve_png(points, Path("curve.png"))                   # points of a run in progress
    learning_curve_png(evaluation_points(con, run), Path("curve.png"))  # or read back from the ledger
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import duckdb
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def evaluation_points(con: duckdb.DuckDBPyConnection, run_id: str) -> list[SimpleNamespace]:
    """The `evaluations` view's points of one run, in order of training time."""
    rows = con.execute("""select stage, success_rate, ci95_low, ci95_high, train_s, episodes from evaluations
                          where run_id = $run order by train_s, evaluated_at""", {"run": run_id}).fetchall()
    return [SimpleNamespace(stage=s, rate=r, ci95=(lo, hi), train_s=t, episodes=n) for s, r, lo, hi, t, n in rows]


def learning_curve_png(points, path: Path, title: str = "") -> Path:
    """`points`: objects with `stage`, `rate`, `ci95` (low, high), `train_s` and `episodes`."""
    if not points:
        raise ValueError("no evaluations to plot")
    x = [p.train_s / 60 for p in points]
    y = [p.rate for p in points]
    err = [[p.rate - p.ci95[0] for p in points], [p.ci95[1] - p.rate for p in points]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.errorbar(x, y, yerr=err, marker="o", capsize=4, color="tab:blue")
    for p, xi in zip(points, x):
        ax.annotate(f"{p.stage}\n{p.rate:.2f} (n={p.episodes})", (xi, p.rate), textcoords="offset points",
                    xytext=(6, 8), fontsize=8)
    ax.set(xlabel="training wall time (min)", ylabel="success rate (95% Wilson CI)", ylim=(-0.02, 1.02),
           title=title or "learning curve")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rebatch_png(found, path: Path) -> Path:
    """`found`: an `analysis.rebatch.Rebatch`."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    lags = sorted(found.staleness)
    left.bar([str(k) for k in lags], [found.staleness[k] for k in lags], color="tab:blue")
    left.set(xlabel="version lag at admission", ylabel="groups", title="staleness of admitted groups")
    right.hist(found.advantages or [0.0], bins=21, color="tab:green")
    right.set(xlabel="group advantage", ylabel="trajectories", title="advantages of admitted groups")
    a = found.admission
    fig.suptitle(f"{found.run_id}: eta={a.eta}, filter={a.filter}: {len(found.admitted)}/{found.groups} admitted")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
