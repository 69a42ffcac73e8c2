"""Checkpoints (standard Hugging Face model directories) in the object store, fetched into a local cache.

Layout: `s3://<bucket>/<prefix>/<run_id>/v000007/<file>` for every file of the (flat) directory, plus
`MANIFEST.json` (name, size and sha256 of each file), written last. The manifest is the commit point:
a checkpoint without one is incomplete (an upload in progress, or one that crashed) and is never
loaded, and every downloaded byte is checked against it.

A download lands in `<cache_dir>/<run_id>/v000007/`, built in a temporary directory beside it and
renamed into place, so the cache only ever holds complete, verified checkpoints; several processes
may fetch the same version at once (the first rename wins, the others use it). A cache hit costs
one GET (the manifest, to make sure the cached copy is what the store holds now: a trainer that
crashed between upload and publish uploads the same version again) and no file downloads.

Files go up with minio's `put_object`, multipart above `PART_SIZE`. Unlike pyarrow's multipart
writer (HTTP 411 from radosgw: it sends parts without Content-Length), minio sends each part with
its length, and radosgw accepts it (tested in tests/test_checkpoints.py with a > 16 MB file).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlparse

from minio import Minio
from minio.error import S3Error

from pipeline.s3 import minio_client
from pipeline.settings import StackSettings
from schemas.events import RUN_ID_PATTERN

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
PART_SIZE = 16 * 1024 * 1024
"""Multipart part size; minio holds up to 3 parts per file in memory while uploading them in parallel."""
CHUNK = 1024 * 1024
"""Download read size."""
_RUN_ID = re.compile(RUN_ID_PATTERN)
_VERSION_DIR = re.compile(r"v(\d{6,})")
_MISSING = ("NoSuchKey", "NoSuchObject", "ResourceNotFound")


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/awrl/checkpoints`, or `~/.cache/awrl/checkpoints`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "awrl" / "checkpoints"


class CheckpointMissing(FileNotFoundError):
    """No checkpoint (no object at all) under this URI."""


class CheckpointIncomplete(CheckpointMissing):
    """Objects but no manifest: an upload in progress or one that crashed; never loaded."""


class CheckpointCorrupted(RuntimeError):
    """A stored file does not match the manifest (sha256 or size)."""


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    size: int
    sha256: str


@dataclass
class CheckpointStats:
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    files_downloaded: int = 0
    bytes_downloaded: int = 0
    cache_hits: int = 0
    """Downloads answered from the local cache (the manifest still matched the store's)."""


class CheckpointStore:
    def __init__(
        self,
        client: Minio,
        bucket: str,
        prefix: str = "checkpoints",
        cache_dir: Path | None = None,
        workers: int = 4,
    ):
        """`workers`: files transferred in parallel (large files are also split into parallel parts)."""
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.workers = workers
        self.stats = CheckpointStats()

    @classmethod
    def from_settings(cls, settings: StackSettings, cache_dir: Path | None = None) -> CheckpointStore:
        return cls(minio_client(settings), settings.s3_bucket, cache_dir=cache_dir)

    # -- naming ----------------------------------------------------------------------------------
    def key(self, run_id: str, version: int) -> str:
        if not _RUN_ID.fullmatch(run_id):
            raise ValueError(f"run id {run_id!r} is not a plain name ({RUN_ID_PATTERN})")
        if version < 0:
            raise ValueError(f"version {version} is negative")
        return f"{self.prefix}/{run_id}/v{version:06d}"

    def uri(self, run_id: str, version: int) -> str:
        return f"s3://{self.bucket}/{self.key(run_id, version)}"

    def exists(self, run_id: str, version: int) -> bool:
        """Whether this version is complete in the store (its manifest is there)."""
        try:
            self.client.stat_object(self.bucket, f"{self.key(run_id, version)}/{MANIFEST}")
            return True
        except S3Error as exc:
            if exc.code in _MISSING:
                return False
            raise

    # -- upload ----------------------------------------------------------------------------------
    def upload(self, local_dir: Path, run_id: str, version: int) -> str:
        """Upload every file of an HF model directory, then its manifest; return the checkpoint's URI.

        Uploading a version again (a trainer that crashed after the upload but before publishing it)
        replaces it: the old manifest goes first, so readers see it as incomplete until the new one lands.
        Hidden entries (`.cache/`, `.gitattributes`) are skipped; other subdirectories are refused.
        """
        local_dir = Path(local_dir)
        files = _checkpoint_files(local_dir)
        key = self.key(run_id, version)
        self.client.remove_object(self.bucket, f"{key}/{MANIFEST}")
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            entries = list(pool.map(lambda p: self._put_file(p, f"{key}/{p.name}"), files))
        # Files left by an earlier attempt with other names (say, a different shard count) would be
        # ignored by readers anyway; remove them so the prefix holds exactly one checkpoint.
        names = {e.name for e in entries}
        for obj in self.client.list_objects(self.bucket, prefix=f"{key}/", recursive=True):
            if obj.object_name.rsplit("/", 1)[-1] not in names:
                self.client.remove_object(self.bucket, obj.object_name)
        manifest = _encode_manifest(run_id, version, entries)
        self.client.put_object(self.bucket, f"{key}/{MANIFEST}", io.BytesIO(manifest), len(manifest),
                               content_type="application/json")  # fmt: skip
        return self.uri(run_id, version)

    def _put_file(self, path: Path, object_name: str) -> ManifestEntry:
        size = path.stat().st_size
        with path.open("rb") as f:
            reader = _HashingReader(f)  # hash the very bytes sent, in the same pass
            self.client.put_object(self.bucket, object_name, reader, size, part_size=_part_size(size),
                                   content_type=_content_type(path.name))  # fmt: skip
        if reader.size != size:
            raise RuntimeError(f"{path} changed size during upload ({size} -> {reader.size} bytes)")
        self.stats.files_uploaded += 1
        self.stats.bytes_uploaded += size
        return ManifestEntry(path.name, size, reader.hexdigest())

    def put_state(self, path: Path, run_id: str, version: int, name: str | None = None) -> None:
        """Trainer-only state (optimizer moments, ~2x the weights) beside the checkpoint, not in it, so
        rollout refreshes never fetch it; `name` (default: the file's) may hold a folder, as a sharded
        state's files do. Put it before `upload`: the manifest commits both."""
        self.client.fput_object(
            self.bucket,
            f"{self.key(run_id, version)}.trainer/{name or path.name}",
            str(path),
            part_size=_part_size(path.stat().st_size),
        )

    def get_state_dir(self, run_id: str, version: int, folder: str, dest: Path) -> Path | None:
        """Every trainer state file under `folder` of a version, downloaded into `dest`; None if there
        are none."""
        prefix = f"{self.key(run_id, version)}.trainer/{folder.strip('/')}/"
        names = [o.object_name for o in self.client.list_objects(self.bucket, prefix=prefix, recursive=True)]
        if not names:
            return None
        dest.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(self.workers) as pool:
            list(pool.map(lambda n: self.client.fget_object(self.bucket, n, str(dest / n[len(prefix) :])), names))
        return dest

    # -- download --------------------------------------------------------------------------------
    def download(self, uri: str) -> Path:
        """A local directory holding the checkpoint at `uri`, verified against its manifest.

        `s3://` URIs are fetched into `<cache_dir>/<run_id>/v000007/` (unless already there); `file://`
        URIs and plain paths are returned as they are, once they hold an HF `config.json`.
        Raises CheckpointMissing / CheckpointIncomplete (no manifest) / CheckpointCorrupted.
        """
        parsed = urlparse(uri)
        if parsed.scheme in ("", "file"):
            return local_checkpoint(uri)
        if parsed.scheme != "s3":
            raise ValueError(f"unsupported checkpoint URI {uri!r} (s3://, file:// or a local path)")
        bucket, key = parsed.netloc, parsed.path.strip("/")
        parts = key.split("/")
        if len(parts) < 2 or not _RUN_ID.fullmatch(parts[-2]) or not _VERSION_DIR.fullmatch(parts[-1]):
            raise ValueError(f"{uri!r} does not end in <run_id>/v000007")
        final = self.cache_dir / parts[-2] / parts[-1]
        entries = self._manifest(bucket, key, uri)
        if _cached(final) == entries:
            self.stats.cache_hits += 1
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                list(pool.map(lambda e: self._get_file(bucket, f"{key}/{e.name}", e, tmp / e.name, uri), entries))
            (tmp / MANIFEST).write_bytes(_encode_manifest(parts[-2], int(parts[-1][1:]), entries))
            _make_readable(tmp)  # mkdtemp is owner-only; a vLLM container may run as another user
            _install(tmp, final, entries)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _manifest(self, bucket: str, key: str, uri: str) -> list[ManifestEntry]:
        try:
            resp = self.client.get_object(bucket, f"{key}/{MANIFEST}")
        except S3Error as exc:
            if exc.code not in _MISSING:
                raise
            if next(iter(self.client.list_objects(bucket, prefix=f"{key}/")), None) is None:
                raise CheckpointMissing(f"no checkpoint at {uri}") from None
            raise CheckpointIncomplete(
                f"{uri} has no {MANIFEST}: its upload is in progress or crashed; refusing to load it"
            ) from None
        try:
            data = resp.read()
        finally:
            resp.close()
            resp.release_conn()
        return _decode_manifest(data, uri)

    def _get_file(self, bucket: str, object_name: str, entry: ManifestEntry, dest: Path, uri: str) -> None:
        try:
            resp = self.client.get_object(bucket, object_name)
        except S3Error as exc:
            if exc.code in _MISSING:
                raise CheckpointCorrupted(f"{uri}: {entry.name} is in the manifest but not in the store") from None
            raise
        h, size = hashlib.sha256(), 0
        try:
            with dest.open("wb") as f:
                for chunk in resp.stream(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
        finally:
            resp.close()
            resp.release_conn()
        if size != entry.size or h.hexdigest() != entry.sha256:
            raise CheckpointCorrupted(
                f"{uri}: {entry.name} does not match the manifest (sha256 {h.hexdigest()}, {size} bytes;"
                f" expected {entry.sha256}, {entry.size} bytes)"
            )
        self.stats.files_downloaded += 1
        self.stats.bytes_downloaded += size

    # -- cache -----------------------------------------------------------------------------------
    def prune_cache(self, run_id: str, keep: int = 2) -> list[Path]:
        """Delete all but the `keep` newest cached versions of a run (and stale temporary
        directories); return what was removed. Checkpoints are large: rollout workers that refresh
        often should call this after each load."""
        run_dir = self.cache_dir / run_id
        if not run_dir.is_dir():
            return []
        versions = [p for p in run_dir.iterdir() if _VERSION_DIR.fullmatch(p.name)]
        versions.sort(key=lambda p: int(p.name[1:]))
        stale_tmp = [p for p in run_dir.glob(".v*.tmp") if time.time() - p.stat().st_mtime > 3600]
        removed = versions[: max(len(versions) - keep, 0)] + stale_tmp
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed


def local_checkpoint(uri: str | Path) -> Path:
    """The directory of a local checkpoint (a path or a file:// URI) holding an HF `config.json`."""
    uri = str(uri)
    parsed = urlparse(uri)
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else uri)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no HF checkpoint (config.json) in {path}")
    return path


# --- helpers -------------------------------------------------------------------------------------


class _HashingReader:
    """A file wrapper that hashes and counts what is read through it (minio reads parts sequentially)."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self._h = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._h.update(data)
        self.size += len(data)
        return data

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _checkpoint_files(local_dir: Path) -> list[Path]:
    if not (local_dir / "config.json").is_file():
        raise ValueError(f"{local_dir} is not an HF model directory (no config.json)")
    files, nested = [], []
    for path in sorted(local_dir.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_file():  # follows symlinks (hub snapshots link to blobs)
            if path.name == MANIFEST:
                continue  # a directory downloaded from the store carries its manifest: we write a fresh one
            files.append(path)
        else:
            nested.append(path.name)
    if nested:
        raise ValueError(f"checkpoint directories are flat; {local_dir} has subdirectories {nested}")
    return files


def _part_size(size: int) -> int:
    # minio picks 5 MiB parts by default; bigger ones mean fewer requests for GB shards. 0 = minio's
    # choice, which it also needs for objects too big for 10,000 parts of PART_SIZE.
    return PART_SIZE if PART_SIZE < size <= PART_SIZE * 10_000 else 0


def _content_type(name: str) -> str:
    return "application/json" if name.endswith(".json") else "application/octet-stream"


def _encode_manifest(run_id: str, version: int, entries: Iterable[ManifestEntry]) -> bytes:
    doc = {
        "format": MANIFEST_FORMAT,
        "run_id": run_id,
        "version": version,
        "files": [{"name": e.name, "size": e.size, "sha256": e.sha256} for e in entries],
    }
    return (json.dumps(doc, indent=2) + "\n").encode()


def _decode_manifest(data: bytes, where: str) -> list[ManifestEntry]:
    try:
        doc = json.loads(data)
        entries = [ManifestEntry(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in doc["files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorrupted(f"{where}: unreadable {MANIFEST} ({exc})") from None
    for e in entries:  # names become local paths: plain file names only
        if e.name in ("", ".", "..", MANIFEST) or "/" in e.name or "\\" in e.name or e.name.startswith("."):
            raise CheckpointCorrupted(f"{where}: {MANIFEST} names an invalid file {e.name!r}")
    return entries


def _cached(directory: Path) -> list[ManifestEntry] | None:
    """The manifest of a complete cached checkpoint (every file there, with its size); else None."""
    try:
        entries = _decode_manifest((directory / MANIFEST).read_bytes(), str(directory))
    except (OSError, CheckpointCorrupted):
        return None
    for e in entries:
        try:
            if (directory / e.name).stat().st_size != e.size:
                return None
        except OSError:
            return None
    return entries


def _make_readable(directory: Path) -> None:
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)


def _install(tmp: Path, final: Path, entries: list[ManifestEntry]) -> None:
    """Rename the verified `tmp` into place; if another process got there first with the same
    checkpoint, keep theirs. A stale or broken copy is replaced."""
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if _cached(final) == entries:
            return
    # An outdated copy (the version was uploaded again) or a damaged one: move it aside, then retry.
    aside = final.with_name(f".{final.name}.{os.getpid()}.{time.monotonic_ns()}.old.tmp")
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        pass
    try:
        os.rename(tmp, final)
    except OSError:
        if _cached(final) != entries:  # a concurrent process installed something else again
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
