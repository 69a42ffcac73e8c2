"""A run's report: markdown with the drift metrics next to the paper's figures, and four plots.

    write_report(connect(settings), "run-7", Path("reports/run-7"))  # -> reports/run-7/report.md

Plots (PNG, matplotlib's Agg backend so it runs headless): memory keys per step against step index
by outcome (drift shows as a rising line), trajectory length histogram of successes and failures (the
gap 1/|tau| punishes), success rate over the run's wall-clock time, and the learning curve against
policy version (training-task success and held-out evaluations, `analysis.curves.version_curve_png`).
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from analysis.curves import evaluation_points, success_by_version, version_curve_png
from analysis.drift import DriftConfig, DriftReport, drift_metrics
from analysis.plotting import plt, save
from analysis.views import load_sql
from pipeline.markdown import markdown_table

TIME_BINS = 20
PAPER = {  # AsyncWebRL, arXiv 2606.05597, "Memory-schema drift" and "Two inefficiencies": (1/|tau| run, 1/k run)
    "generic_key_ratio": ("34%", "11%"),
    "first_last_stable_ratio": ("7%", "65%"),
    "adjacent_unchanged_ratio": ("36%", "76%"),
    "keys_per_step_slope": ("almost 1", ""),
    "mean_response_tokens": ("~240", "~33% fewer"),
    "length_downweight": ("2.4x (12.5 / 5.1 steps)", ""),
    "offpolicy_gap_mean": ("~1.5 (eta = 2)", ""),
    "offpolicy_gap_max": ("~2.0", ""),
}
CAPTIONS = {
    "learning_curve": "Learning curve: success on the run's training tasks per policy version (line, 95% Wilson "
    "band; view `success_by_version`) and held-out evaluations (markers; view `evaluations`).",
    "reward_hacking": "Reward hacking watch: by policy version, success as the judge that gave the reward "
    "saw it, as the rule judge saw it, and the share the first called a success and the second a failure "
    "(`awrl_reward_hacking('rule')`). A share that grows is a policy learning what the judge accepts.",
}
"""A sentence under a plot, by file stem, where the picture alone does not say what it shows."""


def write_report(
    con: duckdb.DuckDBPyConnection, run_id: str, out_dir: Path, config: DriftConfig = DriftConfig()
) -> Path:
    """Write `report.md` and its PNGs into `out_dir`; return the markdown's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = drift_metrics(con, run_id, config)
    plots = [
        _plot_keys(con, run_id, out_dir / "keys_per_step.png"),
        _plot_lengths(con, run_id, out_dir / "lengths.png"),
        _plot_success(con, run_id, out_dir / "success_over_time.png"),
        _plot_versions(con, run_id, out_dir / "learning_curve.png"),
        _plot_hacking(con, run_id, out_dir / "reward_hacking.png"),
    ]
    path = out_dir / "report.md"
    path.write_text(_markdown(report, [p for p in plots if p is not None]))
    return path


def _fetch(con: duckdb.DuckDBPyConnection, name: str, params: dict) -> list[tuple]:
    return con.execute(load_sql(name), params).fetchall()


def _fmt(value, percent: bool = False) -> str:
    if value is None:
        return "-"
    if percent:
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _markdown(r: DriftReport, plots: list[Path]) -> str:
    rows = [(k, v) for k, v in r.to_dict().items() if not isinstance(v, list) and k != "run_id"]
    lines = [
        f"# Run `{r.run_id}`",
        "",
        "Metric definitions: `analysis/drift.py`. Paper columns: AsyncWebRL, arXiv 2606.05597.",
        "",
    ]
    cells = [[key, _fmt(value, key.endswith("_ratio")), *PAPER.get(key, ("", ""))] for key, value in rows]
    lines += markdown_table(["metric", "this run", "paper, 1/|tau|", "paper, 1/k"], cells)
    if r.clip_rate_by_update:
        n = len(r.clip_rate_by_update)
        lines += ["", f"Clip-trigger rate over {n} updates: mean {_fmt(r.clip_rate_mean, True)}."]
    lines += ["", "## Plots", ""]
    for p in plots:
        lines.append(f"![{p.stem}]({p.name})")
        if p.stem in CAPTIONS:
            lines += ["", f"*{CAPTIONS[p.stem]}*", ""]
    if not plots:
        lines.append("No finished trajectories or steps yet.")
    return "\n".join(lines) + "\n"


def _plot_keys(con, run_id: str, path: Path) -> Path | None:
    rows = _fetch(con, "report_keys_by_outcome", {"run_id": run_id})
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for outcome in sorted({r[0] or "unfinished" for r in rows}):
        pts = [(step, keys) for o, step, _, keys in rows if (o or "unfinished") == outcome]
        ax.plot(*zip(*pts), marker="o", label=outcome)
    ax.set(xlabel="step index", ylabel="mean memory keys", title="Memory keys per step")
    ax.legend()
    return save(fig, path)


def _plot_lengths(con, run_id: str, path: Path) -> Path | None:
    rows = _fetch(con, "report_lengths", {"run_id": run_id})
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(n for _, n in rows)
    bins = [b - 0.5 for b in range(top + 2)]
    for outcome in ("success", "failure"):
        lengths = [n for o, n in rows if o == outcome]
        if lengths:
            ax.hist(lengths, bins=bins, alpha=0.6, label=f"{outcome} (mean {sum(lengths) / len(lengths):.1f})")
    ax.set(xlabel="trajectory length (steps)", ylabel="trajectories", title="Length by outcome")
    ax.legend()
    return save(fig, path)


def _plot_success(con, run_id: str, path: Path) -> Path | None:
    rows = _fetch(con, "report_success_over_time", {"run_id": run_id, "bins": TIME_BINS})
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r[1] for r in rows], [r[3] for r in rows], marker="o")
    ax.set(
        xlabel="minutes since first finished trajectory",
        ylabel="success rate",
        ylim=(0, 1),
        title="Success rate over time",
    )
    return save(fig, path)


def _plot_versions(con, run_id: str, path: Path) -> Path | None:
    training, evaluations = success_by_version(con, run_id), evaluation_points(con, run_id)
    if not training.num_rows and not evaluations:
        return None
    return version_curve_png(training, evaluations, path, title=f"{run_id}: success by policy version")


def _plot_hacking(con, run_id: str, path: Path) -> Path | None:
    """Only for a run whose reward came from a model judge (the rule's verdicts recorded beside it)."""
    rows = con.execute(
        "SELECT policy_version, reward_success, reference_success, hacked_share "
        "FROM awrl_reward_hacking('rule') WHERE run_id = ? AND policy_version IS NOT NULL ORDER BY policy_version",
        [run_id],
    ).fetchall()
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    versions = [r[0] for r in rows]
    for i, label in ((1, "the reward's judge: success"), (2, "rule judge: success"), (3, "hacked share")):
        ax.plot(versions, [r[i] for r in rows], marker="o", label=label)
    ax.set(xlabel="policy version", ylabel="share of trajectories", ylim=(-0.02, 1.02), title="Reward hacking watch")
    ax.legend()
    return save(fig, path)
