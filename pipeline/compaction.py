"""Compaction: a run's small ledger files merged into large sorted ones, every row exactly once, and
readers never see a partial state.

A writer flushes every 0.25 s, so a run leaves thousands of files of a few rows. `compact` merges one
`run_id=/event_type=` directory's small files into one file per ~`target_rows`, sorted by (trajectory,
step) or (emitted_at) so that DuckDB's row-group statistics prune on the common filters.

The switch is one atomic write, of a manifest beside the files, `_compaction-<id>.json`:
1. the manifest is written "pending": the new file is invisible (`visible` below);
2. the new file is written;
3. the manifest is rewritten "committed", naming the sources: from now on the sources are hidden and
   the new file visible, for every reader that lists files after this (`pipeline.ledger.list_parquet`);
4. a later pass, once `grace_s` has passed (readers that listed before step 3 have finished), deletes
   the sources, then the manifest.
A crash before 3 leaves a pending manifest and an invisible file, which the next pass deletes; after 3,
the next pass finishes step 4.

Files the ledger writer's journal names (its last flush per partition, `pipeline.journal`) and files
younger than `min_age_s` are never compacted: the journal must find them as written.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

MANIFEST_PREFIX = "_compaction-"


@dataclass(frozen=True)
class CompactionConfig:
    target_rows: int = 200_000
    """Rows per compacted file (at most; the last file of a pass holds the rest)."""
    small_rows: int = 50_000
    """Files with fewer rows than this are merged."""
    min_files: int = 2
    """Compact a directory only if it has at least this many small files."""
    min_age_s: float = 60.0
    """Leave files younger than this alone (a writer's newest flush, named by its journal)."""
    grace_s: float = 60.0
    """Delete superseded files only this long after the switch: a query that listed the files before
    it may still be reading them (a longer query fails with a missing file, it never double counts)."""


@dataclass
class CompactionResult:
    files_before: int = 0
    files_after: int = 0
    rows: int = 0
    deleted: int = 0


def manifest_rule(fs: pafs.FileSystem, paths: set[str]) -> tuple[set[str], set[str]]:
    """(hidden, pending outputs) from the manifests among `paths` (one listing's files): sources of a
    committed manifest are hidden, the output of a pending one is not yet visible."""
    hidden, pending = set(), set()
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if not (name.startswith(MANIFEST_PREFIX) and name.endswith(".json")):
            continue
        directory = path.rsplit("/", 1)[0]
        try:
            doc = json.loads(_read(fs, path))
        except FileNotFoundError:  # deleted by a finishing pass since the listing
            continue
        if doc["state"] == "committed":
            hidden.update(f"{directory}/{s}" for s in doc["sources"])
        else:
            pending.update(p for p in paths if p.startswith(f"{directory}/{doc['prefix']}"))
    return hidden, pending


def compact(fs: pafs.FileSystem, directory: str, protected: set[str], config: CompactionConfig = CompactionConfig(),
            put=None) -> CompactionResult:
    """One pass over one `run_id=/event_type=` directory (see the module docstring). `protected`: files
    the journal names; `put(path, bytes)`: an atomic write (local or S3)."""
    from pipeline.files import write_atomic

    put = put or write_atomic
    result = CompactionResult()
    infos = fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    paths = {i.path: i for i in infos if i.type == pafs.FileType.File}
    _finish(fs, directory, paths, config, result)
    hidden, pending = manifest_rule(fs, set(paths))
    live = sorted(p for p in paths if p.endswith(".parquet") and p not in hidden and p not in pending)
    result.files_before = len(live)
    now = time.time()
    small = [p for p in live if p not in protected and now - paths[p].mtime.timestamp() >= config.min_age_s
             and pq.ParquetFile(p, filesystem=fs).metadata.num_rows < config.small_rows]
    if len(small) < config.min_files:
        result.files_after = len(live)
        return result
    cid = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:8]}"
    manifest = f"{directory}/{MANIFEST_PREFIX}{cid}.json"
    outputs: list[str] = []
    put(manifest, json.dumps({"state": "pending", "prefix": f"part-compact-{cid}-"}).encode())
    for chunk in _chunks(fs, small, config.target_rows):  # one output's rows in memory at a time
        name = f"part-compact-{cid}-{len(outputs):03d}.parquet"
        put(f"{directory}/{name}", _sorted_parquet(chunk))
        outputs.append(name)
        result.rows += chunk.num_rows
    put(manifest, json.dumps({"state": "committed", "outputs": outputs, "committed_at": time.time(),
                              "sources": [p.rsplit("/", 1)[-1] for p in small]}).encode())
    result.files_after = len(live) - len(small) + len(outputs)
    return result


def _chunks(fs: pafs.FileSystem, paths: list[str], rows: int):
    """The files' rows, in file order, as tables of about `rows` rows (whole files: a file is never split)."""
    parts, n = [], 0
    for path in paths:
        parts.append(pq.read_table(path, filesystem=fs))
        n += parts[-1].num_rows
        if n >= rows:
            yield pa.concat_tables(parts, promote_options="permissive")
            parts, n = [], 0
    if parts:
        yield pa.concat_tables(parts, promote_options="permissive")


def _sorted_parquet(table: pa.Table) -> bytes:
    """Sorted by (trajectory, step) for steps, else by emission time, so row-group statistics prune;
    derived columns computed for rows of files written before they existed."""
    from pipeline.summaries import with_summaries

    table = with_summaries(table.column("event_type")[0].as_py(), table)
    keys = [("trajectory_id", "ascending"), ("step", "ascending")] if "step" in table.column_names else []
    table = table.sort_by(keys + [("emitted_at", "ascending"), ("event_id", "ascending")])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=64_000)
    return sink.getvalue().to_pybytes()


def _finish(fs: pafs.FileSystem, directory: str, paths: dict, config: CompactionConfig,
            result: CompactionResult) -> None:
    """Earlier passes: delete the sources of committed manifests past their grace, then the manifest;
    delete the outputs of pending manifests left by a crash (older than `min_age_s`), then it."""
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if not (name.startswith(MANIFEST_PREFIX) and name.endswith(".json")):
            continue
        doc = json.loads(_read(fs, path))
        if doc["state"] == "committed" and time.time() - doc["committed_at"] >= config.grace_s:
            doomed = [f"{directory}/{s}" for s in doc["sources"]]
        elif doc["state"] == "pending" and time.time() - paths[path].mtime.timestamp() >= config.min_age_s:
            doomed = [p for p in paths if p.startswith(f"{directory}/{doc['prefix']}")]
        else:
            continue
        for f in doomed:
            if f in paths:
                fs.delete_file(f)
                result.deleted += 1
                del paths[f]
        fs.delete_file(path)
        del paths[path]


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def compact_run(fs: pafs.FileSystem, root: str, run_id: str, config: CompactionConfig = CompactionConfig(),
                put=None) -> dict[str, CompactionResult]:
    """`compact` every event type's directory of one run; the journal's named files stay as they are."""
    from pipeline.journal import Journal

    protected = Journal(fs, root, put).named_files()
    run_dir = f"{root}/run_id={run_id}"
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True)):
        name = info.path.rsplit("/", 1)[-1]
        if info.type == pafs.FileType.Directory and name.startswith("event_type="):
            out[name.removeprefix("event_type=")] = compact(fs, info.path, protected, config, put)
    return out
