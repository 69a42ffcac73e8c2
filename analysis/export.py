"""Take a run elsewhere: its curves as TensorBoard event files, its steps as a self-contained dataset.

Both are derived from the ledger and never feed back into it: export again and the same files come out
(TensorBoard's wall times are the events' own times, not the export's).

    TensorBoardExport(out_dir, run_id).sync(con)        # what is new since the last sync
    export_dataset(con, store, run_id, out_dir)         # Parquet, the screenshots as image columns

Scalars written (step = update step for `update/*`, policy version for the rest):
- `update/loss`, `update/grad_norm`, `update/duration_s`, `update/wait_s`, `update/compute_s` and
  `update/<key>` for every key of the update's statistics (`approx_kl`, `clip_frac`, `kl_ref`,
  `staleness_mean`, ...), each update once, in update order; the sampler-vs-trainer mismatch
  (`trainer/mismatch.py`) as `mismatch/<name>` from the `updates` view's `mismatch_<name>` columns
  (`mismatch/k3`, `mismatch/ratio_max`, `mismatch/stale_k3`, ...), none where the view has NULL;
- `rollout/success_rate` (`success_by_version`) and `rollout/env_steps_per_s` per policy version, once
  the version is superseded (until then more of its trajectories can finish, and TensorBoard keeps
  every point written);
- `eval/<split>/success_rate` per evaluation (`evaluations`).
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.browse import rows
from pipeline.store import ScreenshotCorrupted, ScreenshotMissing

UPDATE_COLUMNS = ("loss", "grad_norm", "duration_s", "wait_s", "compute_s")
MISMATCH = "mismatch_"
"""Prefix of the `updates` view's sampler-vs-trainer columns, written under TensorBoard's `mismatch/`."""
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
"""The storage of the `datasets` library's Image feature: such a column loads as PIL images there."""


class TensorBoardExport:
    """Appends a run's new points to `<out_dir>/<run_id>/` on each `sync` (live or after the fact)."""

    def __init__(self, out_dir: Path | str, run_id: str):
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = run_id
        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / run_id))
        self.last_update = -1
        self.versions_done: set[int] = set()
        self.evaluations_done: set[str] = set()

    def sync(self, con: duckdb.DuckDBPyConnection) -> int:
        """Write the points that are final and not yet written; returns how many."""
        n = self._updates(con) + self._versions(con) + self._evaluations(con)
        self.writer.flush()
        return n

    def close(self) -> None:
        self.writer.close()

    def _scalar(self, tag: str, value, step: int, at) -> int:
        if value is None:
            return 0
        self.writer.add_scalar(tag, float(value), global_step=int(step), walltime=at.timestamp())
        return 1

    def _updates(self, con) -> int:
        n = 0
        for u in rows(
            con,
            f"SELECT update_step, stats, applied_at, {', '.join(UPDATE_COLUMNS)}, "
            f"COLUMNS('^{MISMATCH}') FROM updates "
            "WHERE run_id = $r AND update_step > $after ORDER BY update_step",
            {"r": self.run_id, "after": self.last_update},
        ):
            for column in UPDATE_COLUMNS:
                n += self._scalar(f"update/{column}", u[column], u["update_step"], u["applied_at"])
            for key, value in sorted((u["stats"] or {}).items()):
                if not key.startswith(MISMATCH):
                    n += self._scalar(f"update/{key}", value, u["update_step"], u["applied_at"])
            for column in sorted(c for c in u if c.startswith(MISMATCH)):
                n += self._scalar(
                    f"mismatch/{column.removeprefix(MISMATCH)}", u[column], u["update_step"], u["applied_at"]
                )
            self.last_update = u["update_step"]
        return n

    def _versions(self, con) -> int:
        n = 0
        for v in rows(
            con,
            """
            WITH published AS (
                SELECT version, published_at, lead(published_at) OVER (ORDER BY version) AS next_at
                FROM policy_versions WHERE run_id = $r)
            SELECT p.version, p.next_at, b.success_rate,
                   (SELECT count(*) FROM steps WHERE run_id = $r AND policy_version = p.version)
                       / epoch(p.next_at - p.published_at) AS steps_per_s
            FROM published AS p LEFT JOIN success_by_version AS b ON b.run_id = $r AND b.policy_version = p.version
            WHERE p.next_at IS NOT NULL ORDER BY p.version""",
            {"r": self.run_id},
        ):
            if v["version"] in self.versions_done:
                continue
            n += self._scalar("rollout/success_rate", v["success_rate"], v["version"], v["next_at"])
            n += self._scalar("rollout/env_steps_per_s", v["steps_per_s"], v["version"], v["next_at"])
            self.versions_done.add(v["version"])
        return n

    def _evaluations(self, con) -> int:
        n = 0
        for e in rows(
            con,
            "SELECT event_id, split, policy_version, success_rate, evaluated_at FROM evaluations "
            "WHERE run_id = $r ORDER BY evaluated_at",
            {"r": self.run_id},
        ):
            if e["event_id"] not in self.evaluations_done:
                n += self._scalar(
                    f"eval/{e['split']}/success_rate", e["success_rate"], e["policy_version"], e["evaluated_at"]
                )
                self.evaluations_done.add(e["event_id"])
        return n


def export_tensorboard(con: duckdb.DuckDBPyConnection, run_id: str, out_dir: Path | str) -> int:
    """The whole run's points, once; returns how many were written."""
    export = TensorBoardExport(out_dir, run_id)
    try:
        return export.sync(con)
    finally:
        export.close()


STEP_COLUMNS = """
    s.run_id, s.trajectory_id, s.group_id, s.task_id, s.step, s.policy_version, s.url, s.response_text,
    to_json(s.action)::VARCHAR AS action_json, to_json(s.memory)::VARCHAR AS memory_json, s.env_feedback,
    s.error_class, s.screenshot_sha256, t.outcome, t.reward, t.instruction, a.advantage"""


class UnreadableScreenshot(LookupError):
    """A step's screenshot is missing from the store or does not hash to its name."""


def export_dataset(
    con: duckdb.DuckDBPyConnection,
    get_screenshot,
    run_id: str,
    out_dir: Path | str,
    rows_per_file: int = 2000,
    skip_unreadable: bool = False,
    on_file=None,
) -> tuple[list[Path], int]:
    """The run's steps as Parquet files under `out_dir`, one row per step with its trajectory's outcome,
    reward and group advantage, and the screenshot itself (`image`: {bytes, path}, verified by
    `get_screenshot(sha) -> bytes`). The schema carries the `datasets` library's feature metadata, so
    `datasets.load_dataset("parquet", data_dir=out_dir)` gives PIL images; pyarrow reads it as is.

    A step whose screenshot cannot be read raises `UnreadableScreenshot` naming it (the files written
    so far are removed), or with `skip_unreadable` is left out. Returns (files, steps left out);
    `on_file(path)` is called after each file (progress)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    query = con.sql(
        f"""
        SELECT {STEP_COLUMNS}
        FROM steps AS s
        LEFT JOIN trajectories AS t USING (run_id, trajectory_id)
        LEFT JOIN (SELECT unnest(trajectory_ids) AS trajectory_id, unnest(advantages) AS advantage
                   FROM groups WHERE run_id = $r) AS a USING (trajectory_id)
        WHERE s.run_id = $r ORDER BY s.trajectory_id, s.step""",
        params={"r": run_id},
    )
    written, skipped = [], 0
    try:
        for part, record_batch in enumerate(query.to_arrow_reader(rows_per_file)):
            batch = pa.Table.from_batches([record_batch])
            keep, images = [], []
            for i, row in enumerate(batch.select(["trajectory_id", "step", "screenshot_sha256"]).to_pylist()):
                try:
                    images.append(
                        {"bytes": get_screenshot(row["screenshot_sha256"]), "path": f"{row['screenshot_sha256']}.png"}
                    )
                    keep.append(i)
                except (ScreenshotMissing, ScreenshotCorrupted) as exc:
                    if not skip_unreadable:
                        raise UnreadableScreenshot(
                            f"step {row['step']} of {row['trajectory_id']}: screenshot {row['screenshot_sha256'][:12]} "
                            f"is {'missing' if isinstance(exc, ScreenshotMissing) else 'corrupt'} in the store "
                            "(--skip-unreadable leaves such steps out)"
                        ) from None
                    skipped += 1
            table = batch.take(keep).append_column(pa.field("image", IMAGE), pa.array(images, type=IMAGE))
            table = table.replace_schema_metadata(
                {b"huggingface": json.dumps({"info": {"features": _features(table)}})}
            )
            path = out / f"steps-{part:05d}.parquet"
            pq.write_table(table, path, compression="zstd")
            written.append(path)
            if on_file:
                on_file(path)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return written, skipped


def _features(table: pa.Table) -> dict:
    """The `datasets` feature description of the table: the image column as Image, the rest as Values."""
    names = {
        pa.string(): "string",
        pa.large_string(): "large_string",
        pa.int64(): "int64",
        pa.int32(): "int32",
        pa.float64(): "float64",
        pa.float32(): "float32",
        pa.bool_(): "bool",
    }
    features = {}
    for field in table.schema:
        if field.name == "image":
            features[field.name] = {"_type": "Image"}
        else:
            features[field.name] = {"dtype": names.get(field.type, "string"), "_type": "Value"}
    return features
