"""Pictures of training outcomes: learning curves (success rate with its 95% interval against
training time, or against policy version) and a re-batching's staleness and advantage histograms.

    learning_curve_png(points, Path("curve.png"))                   # points of a run in progress
    learning_curve_png(evaluation_points(con, run), Path("curve.png"))  # or read back from the ledger
    version_curve_png(success_by_version(con, run), evaluation_points(con, run), Path("versions.png"))
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import duckdb
import pyarrow as pa
from matplotlib.ticker import MaxNLocator

from analysis.plotting import plt, save


def evaluation_points(con: duckdb.DuckDBPyConnection, run_id: str) -> list[SimpleNamespace]:
    """The `evaluations` view's points of one run, in order of training time."""
    rows = con.execute(
        """select stage, success_rate, ci95_low, ci95_high, train_s, episodes, policy_version
                          from evaluations where run_id = $run order by train_s, evaluated_at""",
        {"run": run_id},
    ).fetchall()
    return [
        SimpleNamespace(stage=s, rate=r, ci95=(lo, hi), train_s=t, episodes=n, policy_version=v)
        for s, r, lo, hi, t, n, v in rows
    ]


def success_by_version(con: duckdb.DuckDBPyConnection, run_id: str) -> pa.Table:
    """The `success_by_version` view's rows of one run (without `run_id`), by policy version."""
    return con.sql(
        "select * exclude (run_id) from success_by_version where run_id = $run order by policy_version",
        params={"run": run_id},
    ).to_arrow_table()


def learning_curve_png(points, path: Path, title: str = "") -> Path:
    """`points`: objects with `stage`, `rate`, `ci95` (low, high), `train_s` and `episodes`."""
    if not points:
        raise ValueError("no evaluations to plot")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    _evaluation_markers(ax, points, [p.train_s / 60 for p in points], marker="o", color="tab:blue")
    ax.set(
        xlabel="training wall time (min)",
        ylabel="success rate (95% Wilson CI)",
        ylim=(-0.02, 1.02),
        title=title or "learning curve",
    )
    ax.grid(alpha=0.3)
    return save(fig, path)


def version_curve_png(training: pa.Table, evaluations, path: Path, title: str = "") -> Path:
    """The learning curve RL users expect, x = policy version: success on the run's training tasks (a
    line in its 95% Wilson band; `success_by_version`) and held-out evaluations (markers with 95%
    intervals; `evaluation_points`, or objects with the same fields and `policy_version`)."""
    if not training.num_rows and not evaluations:
        raise ValueError("no finished trajectories or evaluations to plot")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if training.num_rows:
        _success_line(ax, training, "training tasks", "tab:blue")
    if evaluations:
        _evaluation_markers(
            ax,
            evaluations,
            [p.policy_version for p in evaluations],
            fmt="s",
            color="tab:orange",
            label="held-out evaluations",
        )
    return _version_axes(fig, ax, path, "success rate (95% Wilson CI)", title or "learning curve by policy version")


def compare_versions_png(runs: dict[str, pa.Table], path: Path, title: str = "") -> Path:
    """Training-task success by policy version of several runs on one axis (`success_by_version` rows
    per label), e.g. a run and its negative control."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (label, table), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        _success_line(ax, table, label, color)
    return _version_axes(fig, ax, path, "training-task success (95% Wilson CI)", title or "success by policy version")


def _success_line(ax, table: pa.Table, label: str, color: str) -> None:
    """`success_by_version` rows as a line in its 95% Wilson band."""
    t = table.to_pydict()
    ax.plot(t["policy_version"], t["success_rate"], marker=".", color=color, label=label)
    ax.fill_between(t["policy_version"], t["ci95_low"], t["ci95_high"], color=color, alpha=0.2, lw=0)


def _version_axes(fig, ax, path: Path, ylabel: str, title: str) -> Path:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="policy version", ylabel=ylabel, ylim=(-0.02, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def _evaluation_markers(ax, points, x: list[float], **style) -> None:
    """Evaluation points with their intervals as error bars, each labelled with its stage; labels of
    points at the same x (e.g. `untrained` and `sft`, both before version 1) are stacked, not overlaid."""
    err = [[p.rate - p.ci95[0] for p in points], [p.ci95[1] - p.rate for p in points]]
    ax.errorbar(x, [p.rate for p in points], yerr=err, capsize=4, **style)
    for i, (p, xi) in enumerate(zip(points, x)):
        above = x[:i].count(xi)
        ax.annotate(
            f"{p.stage}\n{p.rate:.2f} (n={p.episodes})",
            (xi, p.rate),
            textcoords="offset points",
            xytext=(6, 8 + 22 * above),
            fontsize=8,
        )


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
    return save(fig, path)
