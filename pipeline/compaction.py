"""Compaction: a run's small ledger files merged into large sorted ones, every row exactly once, and
readers never see a partial state, whatever the passes, finishers and readers over one directory do
and however long any of them stalls at any step.

A writer flushes every 0.25 s, so a run leaves thousands of files of a few rows. `compact` merges one
`run_id=/event_type=` directory's small files into one file per ~`target_rows`, sorted by (trajectory,
step) or (emitted_at) so that DuckDB's row-group statistics prune on the common filters; a merge keeps
the first row of each `event_id` (a duplicate that reached the ledger goes at the next pass).

Each pass has a manifest beside the files, `_compaction-<id>.json`, rewritten whole (an atomic put; no
conditional write needed) through these states:
1. `pending`, naming the sources the pass chose: its *claim*, written before it reads them;
2. the pass lists the directory and gives up (deletes its manifest) if another manifest that is not a
   tombstone names one of its sources, or if a source is no longer visible;
3. it reads its sources and writes its outputs (named by its prefix: invisible until 5);
4. `committing`, naming its outputs, then the check of 2 again (and its outputs present);
5. `committed`: the commit point. Its sources are hidden and its outputs visible (`visibility`);
6. a later pass, past `grace_s`, deletes the sources, then the manifest (the outputs become plain files).

The invariant: no two passes commit a common source, and a pass commits only sources that were visible
and still existed after its claim. 1-2 and 4 are Dekker's entry protocol: of two passes whose sources
overlap, the one that writes its manifest later lists after the other's write and gives up; both can
pass their checks only if the other's manifest was gone by then: it gave up (and never commits), or it
committed and was finished, so its sources were deleted before its manifest, before our claim, and our
read or check finds them missing. No check is outrun by a stall: what a pass sees in a check was written
before the check, and what it misses was written after its own manifest, whose writer then sees that.
A pending claim older than `abandoned_s` (a pass that died) may be *superseded*: a new pass claims the
same sources naming the old manifest, and ignores it in its checks while it is still `pending`; the old
pass, if it was only stalled, sees the newer claim at its step 4 and gives up, and the new one gives up
if the old reached `committing` first. A claim that can never commit (a source gone, or committed by
another pass) loses its outputs and becomes a tombstone (`aborted`), kept, so that outputs its pass may
still write if it was only stalled stay invisible. So neither `abandoned_s` nor `grace_s` bounds anything
correctness needs: the first says when a claim may be taken over, the second how long a query that
listed before a finish may read the deleted files (a longer one fails with a missing file; it never
miscounts). A pass killed between steps 4 and 5 leaves its sources claimed (visible, not compacted):
nothing can tell it from one stalled there.

What a reader relies on: it lists the files, then reads each listed manifest (`view_steps`). A committed
manifest hides its sources only if all its outputs are in that listing: a pass that committed after the
listing hides nothing from it, and its outputs are not in it. A manifest that vanished in between (its
pass finished or gave up, deleting its sources or its outputs first) means listing again. Every other
manifest's outputs are invisible. Files that match no manifest are visible. So every reader reads each
row once, as one of: the sources, the outputs of the one pass that committed them.

Files the ledger writer's journal names (its last flush per partition, `pipeline.ledger_journal`) and files
younger than `min_age_s` are never compacted: the journal must find them as written. Each step of a pass
is a `yield` of `compaction_steps`, which `compact` runs through; tests drive the same generator one
step at a time to interleave passes and readers in every order.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

MANIFEST_PREFIX = "_compaction-"
Steps = Generator[str, None, object]
"""A protocol run one storage action at a time: each `yield` names the action about to happen."""


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
    abandoned_s: float = 600.0
    """A pending claim this old may be taken over by a new pass (the old one, if it resumes, gives way).
    Only liveness depends on it."""


@dataclass(frozen=True)
class Safeguards:
    """The protocol's checks, each switchable off only so that a test can show the fault it prevents."""

    claims: bool = True
    """Steps 2 and 4 look at other passes' claims and at the sources' visibility; off: only at committed
    manifests naming a source (this module's check before issue 41)."""
    listed_outputs: bool = True
    """A committed pass hides its sources only from a reader that listed all of its outputs."""
    dedupe: bool = True
    """A merge keeps the first row of each `event_id`."""


SAFE = Safeguards()


@dataclass
class CompactionResult:
    files_before: int = 0
    files_after: int = 0
    rows: int = 0
    deleted: int = 0
    yielded: bool = False
    """The pass found its sources claimed or gone, and removed its own outputs and manifest."""


@dataclass(frozen=True)
class Manifest:
    path: str
    state: str
    """pending, committing, committed or aborted (a tombstone)."""
    prefix: str
    """Of the pass's output files' names."""
    sources: frozenset[str] = frozenset()
    outputs: frozenset[str] = frozenset()
    """Full paths, named from `committing` on."""
    supersedes: frozenset[str] = frozenset()
    """Paths of the abandoned pending manifests whose sources this pass took over."""
    at: float = 0.0
    """committed_at, or when the claim (or tombstone) was written."""

    @property
    def directory(self) -> str:
        return self.path.rsplit("/", 1)[0]

    def files(self, paths) -> set[str]:
        return {p for p in paths if p.startswith(f"{self.directory}/{self.prefix}")}

    def doc(self, **changes) -> bytes:
        m = replace(self, **changes)

        def names(paths):
            return sorted(p.rsplit("/", 1)[-1] for p in paths)

        return json.dumps(
            {
                "state": m.state,
                "prefix": m.prefix,
                "sources": names(m.sources),
                "at": m.at,
                "outputs": names(m.outputs),
                "supersedes": names(m.supersedes),
            }
        ).encode()


@dataclass
class Visibility:
    hidden: set[str] = field(default_factory=set)
    """Sources of committed passes."""
    invisible: set[str] = field(default_factory=set)
    """Outputs of every other manifest."""
    winners: list[Manifest] = field(default_factory=list)


@dataclass(frozen=True)
class View:
    """One listing, and the manifests in it as read after it."""

    paths: dict[str, pafs.FileInfo | None]
    manifests: list[Manifest]

    def visibility(self, safeguards: Safeguards = SAFE) -> Visibility:
        return visibility(self.manifests, self.paths, safeguards)

    def live(self, safeguards: Safeguards = SAFE) -> list[str]:
        v = self.visibility(safeguards)
        return sorted(p for p in self.paths if p.endswith(".parquet") and p not in v.hidden and p not in v.invisible)


def visibility(manifests: list[Manifest], paths, safeguards: Safeguards = SAFE) -> Visibility:
    """Which of a listing's files its manifests hide (see the module docstring)."""
    v = Visibility()
    for m in manifests:
        if m.state == "committed" and (m.outputs <= paths.keys() if safeguards.listed_outputs else True):
            v.winners.append(m)
            v.hidden |= m.sources
        else:
            v.invisible |= m.files(paths)
    return v


def run(steps: Steps):
    """A protocol's steps run through without pausing; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def view_steps(fs: pafs.FileSystem, root: str, recursive: bool = False) -> Steps:
    """A listing, then each manifest in it read; listed again if one vanished in between (a pass finished
    or gave up meanwhile, so the listing may hold its sources and its outputs both)."""
    while True:
        yield f"list {root}"
        try:
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=recursive, allow_not_found=True))
        except FileNotFoundError:
            infos = []
        paths = {i.path: i for i in infos if i.type == pafs.FileType.File}
        manifests = []
        for path in sorted(p for p in paths if _is_manifest(p)):
            yield f"read {path}"
            try:
                manifests.append(_parse(path, json.loads(_read(fs, path)), paths[path]))
            except FileNotFoundError:
                break
        else:
            return View(paths, manifests)


def visible_files(fs: pafs.FileSystem, root: str) -> list[str]:
    """The Parquet files a reader of `root` (recursively) reads: each row exactly once."""
    return run(view_steps(fs, root, recursive=True)).live()


def read_manifests(fs: pafs.FileSystem, infos: dict[str, pafs.FileInfo | None]) -> list[Manifest]:
    """The manifests among one listing's files (those deleted since the listing are left out)."""
    out = []
    for path in sorted(p for p in infos if _is_manifest(p)):
        try:
            out.append(_parse(path, json.loads(_read(fs, path)), infos[path]))
        except FileNotFoundError:
            continue
    return out


def manifest_rule(fs: pafs.FileSystem, paths: set[str], safeguards: Safeguards = SAFE) -> tuple[set[str], set[str]]:
    """(hidden, invisible) for one listing's files. `visible_files` also lists again when a manifest
    vanished after the listing; this does not."""
    infos = dict.fromkeys(paths)
    v = visibility(read_manifests(fs, infos), infos, safeguards)
    return v.hidden, v.invisible


def compact(
    fs: pafs.FileSystem, directory: str, protected: set[str], config: CompactionConfig = CompactionConfig(), put=None
) -> CompactionResult:
    """One pass over one `run_id=/event_type=` directory (see the module docstring). `protected`: files
    the journal names; `put(path, bytes)`: an atomic write (local or S3)."""
    from pipeline.files import write_atomic

    return run(compaction_steps(fs, directory, protected, config, put or write_atomic))


def compaction_steps(
    fs: pafs.FileSystem,
    directory: str,
    protected: set[str],
    config: CompactionConfig,
    put,
    clock: Callable[[], float] = time.time,
    name: str | None = None,
    safeguards: Safeguards = SAFE,
) -> Steps:
    """`compact`, one storage action per step; returns its `CompactionResult`. `clock` dates claims and
    commits; `name`, the pass's id (unique, by default from the time and a random part)."""
    result = CompactionResult()
    yield from _finish(fs, (yield from view_steps(fs, directory)), config, clock(), put, result, safeguards)
    view = yield from view_steps(fs, directory)
    live = view.live(safeguards)
    result.files_before = result.files_after = len(live)
    candidates, supersedes = _claimable(view, live, protected, config, clock(), safeguards)
    small = []
    for path in candidates:
        yield f"inspect {path}"
        try:
            if pq.ParquetFile(path, filesystem=fs).metadata.num_rows < config.small_rows:
                small.append(path)
        except FileNotFoundError:  # finished by another pass since the listing
            pass
    if len(small) < config.min_files:
        return result
    cid = name or f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:8]}"
    me = Manifest(
        f"{directory}/{MANIFEST_PREFIX}{cid}.json",
        "pending",
        f"part-compact-{cid}-",
        frozenset(small),
        supersedes=frozenset(m.path for m in supersedes if m.sources & set(small)),
        at=clock(),
    )
    yield f"claim {me.path}"
    put(me.path, me.doc())
    if not (yield from _still_ours(fs, me, safeguards)):
        return (yield from _give_up(fs, me, [], result))
    outputs: list[str] = []
    if not (yield from _merge(fs, me, small, config, put, safeguards, result, outputs)):
        return (yield from _give_up(fs, me, outputs, result))
    me = replace(me, state="committing", outputs=frozenset(outputs))
    yield f"committing {me.path}"
    put(me.path, me.doc())
    if not (yield from _still_ours(fs, me, safeguards)):
        return (yield from _give_up(fs, me, outputs, result))
    yield f"commit {me.path}"
    put(me.path, me.doc(state="committed", at=clock()))
    result.files_after = len(live) - len(small) + len(outputs)
    return result


def _claimable(
    view: View, live: list[str], protected: set[str], config: CompactionConfig, now: float, safeguards: Safeguards
):
    """Live files no standing claim names (oldest first: a run's first steps first), and the abandoned
    pending claims whose files they include."""
    abandoned = [m for m in view.manifests if m.state == "pending" and now - m.at >= config.abandoned_s]
    standing = [m for m in view.manifests if m.state != "aborted" and m not in abandoned and safeguards.claims]
    claimed = set().union(*(m.sources for m in standing))
    files = [
        p
        for p in live
        if p not in protected
        and p not in claimed
        and (view.paths[p] is None or now - view.paths[p].mtime.timestamp() >= config.min_age_s)
    ]
    return files, abandoned


def _still_ours(fs: pafs.FileSystem, me: Manifest, safeguards: Safeguards) -> Steps:
    """Steps 2 and 4: no other live manifest claims one of our sources (but the abandoned claims we took
    over, while still pending), and our sources are visible, our outputs present."""
    view = yield from view_steps(fs, me.directory)
    for m in view.manifests:
        if m.path == me.path or m.state == "aborted" or not m.sources & me.sources:
            continue
        if safeguards.claims and not (m.state == "pending" and m.path in me.supersedes):
            return False
        if not safeguards.claims and m.state == "committed":
            return False
    live = set(view.live(safeguards))
    return not safeguards.claims or (me.sources <= live and me.outputs <= view.paths.keys())


def _merge(
    fs: pafs.FileSystem,
    me: Manifest,
    small: list[str],
    config: CompactionConfig,
    put,
    safeguards: Safeguards,
    result: CompactionResult,
    outputs: list[str],
) -> Steps:
    """Step 3: the sources' rows, in file order, as `outputs` of about `target_rows` rows (a file is never
    split; one output's rows in memory at a time); False if a source is gone."""
    parts, n = [], 0
    for i, path in enumerate(small):
        yield f"read {path}"
        try:
            parts.append(pq.ParquetFile(path, filesystem=fs).read(use_threads=False))  # small files: no pool
        except FileNotFoundError:  # finished by a pass we did not see: ours cannot commit
            return False
        n += parts[-1].num_rows
        if n >= config.target_rows or i == len(small) - 1:
            table = pa.concat_tables(parts, promote_options="permissive")
            outputs.append(f"{me.directory}/{me.prefix}{len(outputs):03d}.parquet")
            yield f"write {outputs[-1]}"
            data, rows = _sorted_parquet(table, safeguards.dedupe)
            put(outputs[-1], data)
            result.rows += rows
            parts, n = [], 0
    return True


def _give_up(fs: pafs.FileSystem, me: Manifest, outputs, result: CompactionResult) -> Steps:
    """Outputs first, then the manifest: a reader that lists between sees them still invisible."""
    for path in sorted(outputs) + [me.path]:
        yield f"delete {path}"
        _delete(fs, path)
    result.rows, result.yielded = 0, True
    return result


def _finish(
    fs: pafs.FileSystem,
    view: View,
    config: CompactionConfig,
    now: float,
    put,
    result: CompactionResult,
    safeguards: Safeguards,
) -> Steps:
    """Step 6 for committed passes past the grace (sources, then the manifest). A pending or committing
    pass that can never commit (a source gone, or committed by another pass) loses its outputs and is
    left a tombstone, so that outputs it may still write stay invisible."""
    v = view.visibility()
    committed = [m for m in view.manifests if m.state == "committed"]
    for m in view.manifests:
        if m in v.winners and now - m.at >= config.grace_s:
            for path in sorted(m.sources & view.paths.keys()) + [m.path]:
                yield f"delete {path}"
                result.deleted += path != m.path
                _delete(fs, path)
        elif (
            m.state in ("pending", "committing")
            and safeguards.claims
            and (
                not m.sources <= view.paths.keys()
                or any(c.sources & m.sources for c in committed)
                or _legacy_abandoned(m, now, config)
            )
        ):
            for path in sorted(m.files(view.paths)):
                yield f"delete {path}"
                result.deleted += 1
                _delete(fs, path)
            yield f"tombstone {m.path}"
            put(m.path, m.doc(state="aborted", at=now))
        elif m.state == "aborted" and now - m.at >= config.grace_s:
            for path in sorted(m.files(view.paths)):  # a loser's, as this module left them before
                yield f"delete {path}"
                _delete(fs, path)


def _legacy_abandoned(m: Manifest, now: float, config: CompactionConfig) -> bool:
    """A pending manifest written before claims named their sources: it claims nothing, so only age tells."""
    return not m.sources and now - m.at >= config.abandoned_s


def _is_manifest(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith(MANIFEST_PREFIX) and name.endswith(".json")


def _parse(path: str, doc: dict, info: pafs.FileInfo | None) -> Manifest:
    directory, name = path.rsplit("/", 1)

    def full(names):
        return frozenset(f"{directory}/{n}" for n in names or ())

    at = doc.get("at", doc.get("committed_at") or doc.get("aborted_at"))
    if at is None:  # a pending manifest from before claims were dated
        at = info.mtime.timestamp() if info is not None else time.time()
    prefix = doc.get("prefix") or f"part-compact-{name[len(MANIFEST_PREFIX) : -len('.json')]}-"
    return Manifest(
        path, doc["state"], prefix, full(doc.get("sources")), full(doc.get("outputs")), full(doc.get("supersedes")), at
    )


def _sorted_parquet(table: pa.Table, dedupe: bool = True) -> tuple[bytes, int]:
    """Sorted by (trajectory, step) for steps, else by emission time, so row-group statistics prune;
    the first row of each event_id only; derived columns computed for rows of files written before they
    existed. Returns the file and its row count."""
    from pipeline.summaries import with_summaries

    if dedupe:
        index = pa.table({"e": table.column("event_id"), "i": pa.array(range(table.num_rows), pa.int64())})
        table = table.take(pc.sort_indices(index.group_by("e", use_threads=False).aggregate([("i", "min")])["i_min"]))
    table = with_summaries(table.column("event_type")[0].as_py(), table)
    keys = [("trajectory_id", "ascending"), ("step", "ascending")] if "step" in table.column_names else []
    table = table.sort_by(keys + [("emitted_at", "ascending"), ("event_id", "ascending")])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=64_000)
    return sink.getvalue().to_pybytes(), table.num_rows


def _delete(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except FileNotFoundError:  # a pass finishing beside this one got there first
        pass


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def compact_run(
    fs: pafs.FileSystem, root: str, run_id: str, config: CompactionConfig = CompactionConfig(), put=None
) -> dict[str, CompactionResult]:
    """`compact` every event type's directory of one run; the journal's named files stay as they are."""
    from pipeline.ledger_journal import Journal

    protected = Journal(fs, root, put).named_files()
    run_dir = f"{root}/run_id={run_id}"
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True)):
        name = info.path.rsplit("/", 1)[-1]
        if info.type == pafs.FileType.Directory and name.startswith("event_type="):
            out[name.removeprefix("event_type=")] = compact(fs, info.path, protected, config, put)
    return out
