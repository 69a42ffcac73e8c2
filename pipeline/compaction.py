"""Compaction: a run's small ledger files merged into large sorted ones, every row exactly once, and
readers never see a partial state, even when passes over one directory run at the same time.

A writer flushes every 0.25 s, so a run leaves thousands of files of a few rows. `compact` merges one
`run_id=/event_type=` directory's small files into one file per ~`target_rows`, sorted by (trajectory,
step) or (emitted_at) so that DuckDB's row-group statistics prune on the common filters.

The switch is one atomic write, of a manifest beside the files, `_compaction-<id>.json`:
1. the manifest is written "pending": the new file is invisible (`visibility` below);
2. the new file is written;
3. the pass lists the directory's manifests again and gives up (deletes its outputs and manifest) if a
   committed pass already took one of its sources;
4. the manifest is rewritten "committed", naming the sources: from now on the sources are hidden and
   the new file visible, for every reader that lists files after this (`pipeline.ledger.list_parquet`);
5. a later pass, once `grace_s` has passed (readers that listed before step 4 have finished), deletes
   the sources, then the manifest.
A crash before 4 leaves a pending manifest and an invisible file, which a pass deletes once the
manifest is `abandoned_s` old; after 4, the next pass finishes step 5.

Two passes can still both pass step 3 and commit (an object store without conditional writes, such as
radosgw, offers no lock that would stop them): both merged the same sources. So readers count only the
first committed pass of any that overlap, by (`committed_at`, manifest name), the same choice in every
listing; a later overlapping pass *loses*: its sources are not hidden by it and its outputs are
invisible. The next pass marks it "aborted" and deletes its outputs after the grace, before the winner's
manifest can go. The one assumption: the clocks of hosts that compact one ledger agree within
`min_age_s`, the age below which no pass merges a file (so no pass merges a loser's outputs).

Files the ledger writer's journal names (its last flush per partition, `pipeline.journal`) and files
younger than `min_age_s` are never compacted: the journal must find them as written.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
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
    """Leave files younger than this alone (a writer's newest flush, named by its journal; a pass that
    lost to an overlapping one, whose outputs may have been visible for a moment)."""
    grace_s: float = 60.0
    """Delete superseded files only this long after the switch: a query that listed the files before
    it may still be reading them (a longer query fails with a missing file, it never double counts)."""
    abandoned_s: float = 600.0
    """A pending manifest this old belongs to a pass that died: its outputs and it are deleted. Longer
    than any pass, so a slow pass is never cleaned up under its feet."""


@dataclass
class CompactionResult:
    files_before: int = 0
    files_after: int = 0
    rows: int = 0
    deleted: int = 0
    yielded: bool = False
    """The pass found its sources taken by a pass that committed first, and removed its own outputs."""


@dataclass(frozen=True)
class Manifest:
    path: str
    state: str
    """pending, committed (the winner of any overlap, or a loser not yet marked) or aborted."""
    prefix: str
    """Of the pass's output files' names."""
    sources: frozenset[str]
    """Full paths of the files the pass merged (committed and aborted passes)."""
    at: float
    """committed_at, aborted_at, or the pending manifest's mtime."""

    @property
    def directory(self) -> str:
        return self.path.rsplit("/", 1)[0]

    def outputs(self, paths) -> set[str]:
        return {p for p in paths if p.startswith(f"{self.directory}/{self.prefix}")}


@dataclass
class Visibility:
    hidden: set[str] = field(default_factory=set)
    """Sources of winning passes."""
    invisible: set[str] = field(default_factory=set)
    """Outputs of pending, aborted and losing passes."""
    winners: list[Manifest] = field(default_factory=list)
    losers: list[Manifest] = field(default_factory=list)


def read_manifests(fs: pafs.FileSystem, infos: dict[str, pafs.FileInfo | None]) -> list[Manifest]:
    """The manifests among one listing's files (path -> FileInfo, or None where the mtime is not needed)."""
    out = []
    for path in sorted(infos):
        name = path.rsplit("/", 1)[-1]
        if not (name.startswith(MANIFEST_PREFIX) and name.endswith(".json")):
            continue
        try:
            doc = json.loads(_read(fs, path))
        except FileNotFoundError:  # deleted by a finishing pass since the listing
            continue
        directory, info = path.rsplit("/", 1)[0], infos[path]
        at = doc.get("committed_at") or doc.get("aborted_at") or (info.mtime.timestamp() if info else time.time())
        prefix = doc.get("prefix") or f"part-compact-{name[len(MANIFEST_PREFIX):-len('.json')]}-"
        sources = frozenset(f"{directory}/{s}" for s in doc.get("sources", ()))
        out.append(Manifest(path, doc["state"], prefix, sources, at))
    return out


def visibility(manifests: list[Manifest], paths, first_commit_wins: bool = True) -> Visibility:
    """Which files a listing's manifests hide. Of committed passes whose sources overlap, the first to
    commit wins. `first_commit_wins=False` counts every committed pass, as this module did before it
    handled concurrent passes: only to show the duplication the rule prevents."""
    v = Visibility()
    for m in sorted(manifests, key=lambda m: (m.at, m.path)):
        if m.state == "committed" and (not first_commit_wins or not (m.sources & v.hidden)):
            v.winners.append(m)
            v.hidden |= m.sources
        else:
            (v.losers if m.state == "committed" else []).append(m)
            v.invisible |= m.outputs(paths)
    return v


def manifest_rule(fs: pafs.FileSystem, paths: set[str], first_commit_wins: bool = True) -> tuple[set[str], set[str]]:
    """(hidden, invisible) for one listing's files: `visibility` of the manifests among them."""
    v = visibility(read_manifests(fs, dict.fromkeys(paths)), paths, first_commit_wins)
    return v.hidden, v.invisible


def compact(fs: pafs.FileSystem, directory: str, protected: set[str], config: CompactionConfig = CompactionConfig(),
            put=None) -> CompactionResult:
    """One pass over one `run_id=/event_type=` directory (see the module docstring). `protected`: files
    the journal names; `put(path, bytes)`: an atomic write (local or S3)."""
    from pipeline.files import write_atomic

    put = put or write_atomic
    result = CompactionResult()
    paths = _listing(fs, directory)
    _finish(fs, paths, config, result, put)
    v = visibility(read_manifests(fs, paths), paths)
    live = sorted(p for p in paths if p.endswith(".parquet") and p not in v.hidden and p not in v.invisible)
    result.files_before = result.files_after = len(live)
    now = time.time()
    small = [p for p in live if p not in protected and now - paths[p].mtime.timestamp() >= config.min_age_s
             and pq.ParquetFile(p, filesystem=fs).metadata.num_rows < config.small_rows]
    if len(small) < config.min_files:
        return result
    cid = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:8]}"
    manifest = f"{directory}/{MANIFEST_PREFIX}{cid}.json"
    prefix = f"part-compact-{cid}-"
    outputs: list[str] = []
    put(manifest, json.dumps({"state": "pending", "prefix": prefix}).encode())
    try:
        for chunk in _chunks(fs, small, config.target_rows):  # one output's rows in memory at a time
            outputs.append(f"{prefix}{len(outputs):03d}.parquet")
            put(f"{directory}/{outputs[-1]}", _sorted_parquet(chunk))
            result.rows += chunk.num_rows
        taken = _taken(fs, directory, set(small))
    except FileNotFoundError:  # a source deleted under this pass: another pass merged it and finished
        taken = True
    if taken:
        for path in [f"{directory}/{o}" for o in outputs] + [manifest]:
            _delete(fs, path)
        result.rows, result.yielded = 0, True
        return result
    put(manifest, json.dumps({"state": "committed", "prefix": prefix, "outputs": outputs, "committed_at": time.time(),
                              "sources": [p.rsplit("/", 1)[-1] for p in small]}).encode())
    result.files_after = len(live) - len(small) + len(outputs)
    return result


def _taken(fs: pafs.FileSystem, directory: str, sources: set[str]) -> bool:
    """Step 3: has a committed pass merged any of `sources` since this pass listed them?"""
    manifests = read_manifests(fs, _listing(fs, directory))
    return any(m.state == "committed" and m.sources & sources for m in manifests)


def _listing(fs: pafs.FileSystem, directory: str) -> dict[str, pafs.FileInfo]:
    infos = fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    return {i.path: i for i in infos if i.type == pafs.FileType.File}


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


def _finish(fs: pafs.FileSystem, paths: dict[str, pafs.FileInfo], config: CompactionConfig, result: CompactionResult,
            put) -> None:
    """Earlier passes, in an order that keeps every listing exact: mark losers aborted (before any winner's
    manifest, which makes them lose, can go); past the grace, delete an aborted pass's outputs, then its
    manifest, and a winner's sources, then its manifest; delete abandoned pending passes' outputs, then them."""
    now = time.time()
    v = visibility(read_manifests(fs, paths), paths)
    for m in v.losers:
        put(m.path, json.dumps({"state": "aborted", "prefix": m.prefix, "aborted_at": now}).encode())
    for m in read_manifests(fs, paths):
        if m.state == "aborted" and now - m.at >= config.grace_s:
            doomed = m.outputs(paths)
        elif m.state == "pending" and now - m.at >= config.abandoned_s:
            doomed = m.outputs(paths)
        elif m.state == "committed" and m in v.winners and now - m.at >= config.grace_s:
            doomed = m.sources
        else:
            continue
        for f in sorted(doomed) + [m.path]:
            if f in paths:
                result.deleted += f != m.path
                _delete(fs, f)
                del paths[f]


def _delete(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except FileNotFoundError:  # a pass finishing beside this one got there first
        pass


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
