"""Benchmark: memory-drift metrics over a 1,000,000-step ledger.

    .venv/bin/python bench/drift.py [--trajectories 100000] [--keep /tmp/drift-ledger] [--repeat 3]

The synthetic run has the paper's shape: groups of 8, successes of 5 steps with 2 fixed memory keys,
failures of 15 steps that add a generic `step_<n>` key every step, ~240 response tokens per step
(uniform 120-359) with per-token policy versions, and one update per 256 trajectories trained 1-2
versions later. 100k trajectories -> 1,000,000 StepRecorded in files of 20,000 (the ledger writer's
largest batch). Tables are built column-wise with Arrow (a million pydantic events would take
minutes); a few rows of each are decoded back through the event models to prove they are valid.

Timings are wall and process CPU time (all threads): this machine is shared, so wall time moves with
the load average, which is printed too. Writes bench/out/drift.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/samples.py

import json
import os
import resource
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import typer
from rich.console import Console
from rich.table import Table

from analysis import DriftConfig, connect, drift_metrics
from pipeline.summaries import with_summaries
from schemas import (
    EpisodeFinished,
    EpisodeStarted,
    GroupCompleted,
    StepRecorded,
    UpdateApplied,
    arrow_schema,
    events_to_table,
    table_to_events,
)

from samples import sample_group

RUN = "bench"
GROUP = 8
PER_FILE = 20_000
PER_UPDATE = 256
SHA = "ab" * 32
KEYS = pa.array(["product price", "notes"] + [f"step_{m}" for m in range(1, 64)])
console = Console()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _offsets(lengths: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.array(offsets)


def _lists(lengths: np.ndarray, values) -> pa.ListArray:
    return pa.ListArray.from_arrays(_offsets(lengths), values)


def _const(value, n: int, type_=None) -> pa.Array:
    return pa.repeat(pa.scalar(value, type_), n)


def _write(root: Path, cls, table: pa.Table, name: str) -> int:
    directory = root / f"run_id={RUN}" / f"event_type={cls.__name__}"
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / f"part-{name}.parquet", compression="zstd", row_group_size=64_000)
    assert table_to_events(table.slice(0, 3), cls)  # valid events, not just valid Arrow
    return (directory / f"part-{name}.parquet").stat().st_size


def _common(n: int, cls, prefix: str, first: int = 0) -> dict:
    """Event ids `<prefix><first>...`: unique across files, as the views read each event id once."""
    return {
        "event_id": pc.binary_join_element_wise(prefix, pa.array(np.arange(first, first + n)).cast(pa.string()), ""),
        "run_id": _const(RUN, n),
        "schema_version": _const(1, n, pa.int64()),
        "emitted_at": pa.array((first + np.arange(n, dtype=np.int64)) * 1_000).cast(pa.timestamp("us", tz="UTC")),
        "event_type": _const(cls.__name__, n),
    }


def _table(cls, columns: dict) -> pa.Table:
    schema = arrow_schema(cls)
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)


def _steps(
    rng,
    tids: pa.Array,
    gids: pa.Array,
    traj: np.ndarray,
    step: np.ndarray,
    success: np.ndarray,
    version: np.ndarray,
    a: int,
) -> pa.Table:
    """StepRecorded rows for global step indices [a, a + len(traj))."""
    n = len(traj)
    nkeys = np.where(success, 2, 2 + step)
    pos = np.arange(nkeys.sum()) - np.repeat(np.cumsum(nkeys) - nkeys, nkeys)  # 0.. within each step
    memory = pa.MapArray.from_arrays(_offsets(nkeys), KEYS.take(pa.array(pos)), _const("v", len(pos)))
    rlen = rng.integers(120, 360, n)
    tokens = int(rlen.sum())
    rows = pa.array(traj)
    action_type = arrow_schema(StepRecorded).field("action").type
    timing_type = arrow_schema(StepRecorded).field("timings").type
    mark_type = arrow_schema(StepRecorded).field("marks").type
    return _table(
        StepRecorded,
        {
            **_common(n, StepRecorded, "s", a),
            "trajectory_id": pc.take(tids, rows),
            "group_id": pc.take(gids, rows),
            "task_id": _const("shop-price", n),
            "step": pa.array(step.astype(np.int64)),
            "screenshot_sha256": _const(SHA, n),
            "url": _const("http://127.0.0.1/shop", n),
            "action": pa.StructArray.from_arrays(
                [_const("click", n), _const(640, n, pa.int64()), _const(360, n, pa.int64())]
                + [pa.nulls(n, f.type) for f in list(action_type)[3:]],
                fields=list(action_type),
            ),
            "response_text": _const("thought", n),
            "memory": memory,
            "prompt_token_ids": _lists(np.zeros(n, np.int64), pa.array([], pa.int64())),
            "prompt_screenshot_sha256": _lists(np.ones(n, np.int64), _const(SHA, n)),
            "response_token_ids": _lists(rlen, pa.array(rng.integers(0, 32_000, tokens))),
            "behave_logprobs": _lists(rlen, pa.array(-3 * rng.random(tokens))),
            "token_policy_versions": _lists(rlen, pa.array(np.repeat(version, rlen).astype(np.int64))),
            "policy_version": pa.array(version.astype(np.int64)),
            "env_feedback": _const("ok", n),
            "error_class": pa.nulls(n, pa.string()),
            "timings": pa.StructArray.from_arrays([_const(0.1, n)] * 3, fields=list(timing_type)),
            "marks": _lists(np.zeros(n, np.int64), pa.array([], mark_type.value_type)),
            "marks_drawn": _const(False, n),
        },
    )


def generate(root: Path, trajectories: int, summaries: bool = True, per_file: int = PER_FILE) -> dict:
    """Write the synthetic run; return {event type: bytes} and the step count. `summaries`: StepRecorded
    files with the ledger's token summaries (as it writes them now) or without (files from before)."""
    rng = np.random.default_rng(0)
    t = np.arange(trajectories)
    success = t % 2 == 0
    length = np.where(success, 5, 15)
    tversion = t // 2_000
    tids = pc.binary_join_element_wise("t", pa.array(t).cast(pa.string()), "")
    traj = np.repeat(t, length)
    step = np.arange(len(traj)) - np.repeat(np.cumsum(length) - length, length)
    gids = pc.binary_join_element_wise("g", pa.array(t // GROUP).cast(pa.string()), "")
    sizes = {"StepRecorded": 0}
    for i, a in enumerate(range(0, len(traj), per_file)):
        s = slice(a, a + per_file)
        table = _steps(rng, tids, gids, traj[s], step[s], success[traj[s]], tversion[traj[s]], a)
        table = with_summaries("StepRecorded", table) if summaries else table
        sizes["StepRecorded"] += _write(root, StepRecorded, table, f"{i:05d}")
    sizes["EpisodeStarted"] = _write(
        root,
        EpisodeStarted,
        _table(
            EpisodeStarted,
            {
                **_common(trajectories, EpisodeStarted, "es"),
                "trajectory_id": tids,
                "group_id": gids,
                "task_id": _const("shop-price", trajectories),
                "worker_id": _const("w", trajectories),
                "instruction": _const("Find the price of the product in the shop", trajectories),
                "horizon": _const(15, trajectories, pa.int64()),
                "policy_version": pa.array(tversion),
            },
        ),
        "0",
    )
    outcome = pa.array(np.where(success, "success", "failure"))
    sizes["EpisodeFinished"] = _write(
        root,
        EpisodeFinished,
        _table(
            EpisodeFinished,
            {
                **_common(trajectories, EpisodeFinished, "ef"),
                "trajectory_id": tids,
                "group_id": gids,
                "task_id": _const("shop-price", trajectories),
                "outcome": outcome,
                "reward": pa.array(success.astype(np.float64)),
                "num_steps": pa.array(length.astype(np.int64)),
                "reason": _const("judge", trajectories),
                "answer": pa.nulls(trajectories, pa.string()),
            },
        ),
        "0",
    )
    sizes.update(_groups_and_updates(root, rng, tids, success, length, tversion))
    return {"bytes": sizes, "steps": len(traj)}


def _groups_and_updates(root: Path, rng, tids: pa.Array, success, length, tversion) -> dict:
    ids = tids.to_pylist()
    groups = [slice(g, g + GROUP) for g in range(0, len(ids), GROUP)]
    gtable = pa.Table.from_pylist(
        [
            {
                "event_id": f"gc{i}",
                "run_id": RUN,
                "schema_version": 1,
                "emitted_at": 0,
                "event_type": "GroupCompleted",
                "group_id": f"g{i}",
                "task_id": "shop-price",
                "trajectory_ids": ids[s],
                "rewards": success[s].astype(float).tolist(),
                "num_steps": length[s].tolist(),
                "outcomes": ["success" if ok else "failure" for ok in success[s]],
                "min_policy_version": int(tversion[s].min()),
                "max_policy_version": int(tversion[s].max()),
            }
            for i, s in enumerate(groups)
        ],
        schema=arrow_schema(GroupCompleted),
    )
    utable = pa.Table.from_pylist(
        [
            {
                "event_id": f"ua{u}",
                "run_id": RUN,
                "schema_version": 1,
                "emitted_at": 0,
                "event_type": "UpdateApplied",
                "update_step": u,
                "version_before": int(tversion[a]) + 1 + u % 2,
                "version_after": int(tversion[a]) + 2 + u % 2,
                "group_ids": [],
                "trajectory_ids": ids[a : a + PER_UPDATE],
                "loss": 0.1,
                "grad_norm": 1.0,
                "stats": {"clip_frac": float(rng.random() * 0.1)},
                "config_json": "{}",
                "weights_sha256": SHA,
                "duration_s": 1.0,
                "wait_s": 0.0,
                "compute_s": 1.0,
                "world_size": 1,
            }
            for u, a in enumerate(range(0, len(ids), PER_UPDATE))
        ],
        schema=arrow_schema(UpdateApplied),
    )
    return {
        "GroupCompleted": _write(root, GroupCompleted, gtable, "0"),
        "UpdateApplied": _write(root, UpdateApplied, utable, "0"),
    }


def realistic_bytes_per_step(steps: int = 2_000) -> float:
    """Parquet bytes per StepRecorded as the ledger writer stores `tests/samples.py` steps (1,200 prompt
    and 300 response tokens), since the large run above carries no prompt tokens."""
    events = [
        e
        for g in range(steps // 10)
        for e in sample_group(RUN, f"g{g}", [SHA], group_size=4, steps=5, seed=g)
        if isinstance(e, StepRecorded)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "steps.parquet"
        pq.write_table(events_to_table(events), path, compression="zstd", row_group_size=64_000)
        return path.stat().st_size / len(events)


def _timed(fn, repeat: int) -> dict:
    walls, cpus = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), _cpu()
        result = fn()
        walls.append(time.perf_counter() - t)
        cpus.append(_cpu() - c)
    return {
        "wall_min_s": min(walls),
        "wall_median_s": statistics.median(walls),
        "cpu_median_s": statistics.median(cpus),
        "result": result,
    }


def main(
    trajectories: int = 100_000, keep: Path = typer.Option(None, help="Reuse / keep the ledger here."), repeat: int = 3
) -> None:
    root = keep or Path(tempfile.mkdtemp(prefix="drift-bench-"))
    try:
        gen = None
        if not (root / f"run_id={RUN}").exists():
            t = time.perf_counter()
            gen = {"steps": generate(root, trajectories)["steps"], "seconds": time.perf_counter() - t}
        files = sorted(root.rglob("*.parquet"))
        sizes = {}
        for f in files:
            kind = f.parent.name.removeprefix("event_type=")
            sizes[kind] = sizes.get(kind, 0) + f.stat().st_size
        load_before = os.getloadavg()[0]
        con_t = _timed(lambda: connect(root).close(), repeat)
        con = connect(root)
        steps = con.execute("SELECT count(*) FROM step_recorded").fetchone()[0]
        full = _timed(lambda: drift_metrics(con, RUN).to_dict(), repeat)
        memory = _timed(lambda: drift_metrics(con, RUN, DriftConfig(token_metrics=False)).to_dict(), repeat)
        con.close()
        out = {
            "steps": steps,
            "trajectories": trajectories,
            "files": len(files),
            "parquet_bytes": sizes,
            "step_bytes_per_step": sizes["StepRecorded"] / steps,
            "realistic_step_bytes_per_step": realistic_bytes_per_step(),
            "generate": gen,
            "load_average_1m": [load_before, os.getloadavg()[0]],
            "cpus": os.cpu_count(),
            "connect": {k: v for k, v in con_t.items() if k != "result"},
            "drift_full": {k: v for k, v in full.items() if k != "result"},
            "drift_no_tokens": {k: v for k, v in memory.items() if k != "result"},
            "metrics": {k: v for k, v in full["result"].items() if k not in ("keys_by_step", "clip_rate_by_update")},
        }
        _print(out)
        Path("bench/out").mkdir(parents=True, exist_ok=True)
        Path("bench/out/drift.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def _print(out: dict) -> None:
    table = Table(
        "measure",
        "value",
        title=f"drift metrics over {out['steps']:,} steps ({out['cpus']} CPUs, load {out['load_average_1m'][0]:.1f})",
    )
    for name in ("connect", "drift_full", "drift_no_tokens"):
        m = out[name]
        table.add_row(f"{name} wall min / median", f"{m['wall_min_s']:.2f} s / {m['wall_median_s']:.2f} s")
        table.add_row(f"{name} CPU (all threads)", f"{m['cpu_median_s']:.2f} s")
    table.add_row("StepRecorded Parquet bytes/step (no prompt tokens)", f"{out['step_bytes_per_step']:,.0f}")
    table.add_row(
        "bytes/step, realistic (1200 prompt + 300 response tokens)", f"{out['realistic_step_bytes_per_step']:,.0f}"
    )
    table.add_row("ledger total", f"{sum(out['parquet_bytes'].values()) / 2**20:,.0f} MiB in {out['files']} files")
    for key in (
        "generic_key_ratio",
        "first_last_stable_ratio",
        "adjacent_unchanged_ratio",
        "mean_response_tokens",
        "length_downweight",
        "offpolicy_gap_mean",
        "offpolicy_gap_max",
    ):
        table.add_row(key, f"{out['metrics'][key]:.4g}")
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
