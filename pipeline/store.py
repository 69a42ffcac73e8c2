"""Content-addressed screenshot store over the `minio` S3 SDK.

The key is the sha256 of the encoded image bytes, so identical pages (across steps, workers and runs)
are stored once, and a reader can prove that what it got is what was written. Pixels never travel
through the event log: events carry only the hash (the paper's ~700 s -> ~1 s per step fix).
The S3 client and the wait for a store that is down or full are `pipeline.s3`'s.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import cachetools
from minio import Minio
from minio.error import S3Error

from pipeline.hashing import sha256_hex
from pipeline.s3 import STORE_PATIENCE_S, minio_client, patiently
from pipeline.settings import StackSettings

READER_CACHE_BYTES = 256 * 1024 * 1024
"""What a reader's cache (`ScreenshotStore.cached_get`) holds at most: a batch of ~1,000 large screenshots."""
MAX_SCREENSHOT_BYTES = 16 * 1024 * 1024
"""Larger "screenshots" are rejected: a 4K PNG is ~10 MB, anything bigger is a bug or an attack."""


class ScreenshotCorrupted(RuntimeError):
    """The stored bytes do not hash to their key."""


class ScreenshotMissing(KeyError):
    """No object under this hash."""


class ScreenshotTooLarge(ValueError):
    """The image is over `MAX_SCREENSHOT_BYTES`; nothing was stored."""

    def __init__(self, size: int, limit: int = MAX_SCREENSHOT_BYTES):
        super().__init__(f"screenshot of {size} bytes exceeds the {limit}-byte limit")
        self.size, self.limit = size, limit


@dataclass
class StoreStats:
    puts: int = 0
    """Objects actually uploaded."""
    dedup_hits: int = 0
    """Puts skipped because the hash was already stored."""
    bytes_uploaded: int = 0
    waited_s: float = 0.0
    """Time spent paused because the store was unreachable or full."""


class ScreenshotStore:
    def __init__(
        self, client: Minio, bucket: str, prefix: str = "screenshots/sha256", patience_s: float = STORE_PATIENCE_S
    ):
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self.patience_s = patience_s
        self.stats = StoreStats()

    @classmethod
    def from_settings(cls, settings: StackSettings, patience_s: float = STORE_PATIENCE_S) -> ScreenshotStore:
        return cls(minio_client(settings), settings.s3_bucket, patience_s=patience_s)

    def _waited(self, seconds: float) -> None:
        self.stats.waited_s += seconds

    def ensure_bucket(self) -> None:
        if not self.client.bucket_exists(self.bucket):
            try:
                self.client.make_bucket(self.bucket)
            except S3Error as exc:  # created concurrently by another worker
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def key(self, sha256: str) -> str:
        return f"{self.prefix}/{sha256[:2]}/{sha256}"

    def exists(self, sha256: str) -> bool:
        try:
            self.client.stat_object(self.bucket, self.key(sha256))
            return True
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
                return False
            raise

    def put(self, data: bytes, content_type: str = "image/png") -> str:
        """Store `data` under its sha256 unless already there; return the hash."""
        if len(data) > MAX_SCREENSHOT_BYTES:
            raise ScreenshotTooLarge(len(data))
        digest = sha256_hex(data)
        if patiently(lambda: self.exists(digest), "checking a screenshot", self.patience_s, self._waited):
            self.stats.dedup_hits += 1
            return digest
        patiently(
            lambda: self.client.put_object(
                self.bucket, self.key(digest), io.BytesIO(data), len(data), content_type=content_type
            ),
            "storing a screenshot",
            self.patience_s,
            self._waited,
        )
        self.stats.puts += 1
        self.stats.bytes_uploaded += len(data)
        return digest

    def put_many(self, images: Iterable[bytes], workers: int = 8) -> list[str]:
        """Store in parallel (a PUT waits on the OSD; several in flight hide that latency)."""
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self.put, images))

    def get(self, sha256: str) -> bytes:
        """The bytes stored under `sha256`, verified; raises ScreenshotCorrupted on mismatch."""
        data = patiently(lambda: self._fetch(sha256), "reading a screenshot", self.patience_s, self._waited)
        actual = sha256_hex(data)
        if actual != sha256:
            raise ScreenshotCorrupted(f"object {self.key(sha256)} hashes to {actual}")
        return data

    def cached_get(self, max_bytes: int = READER_CACHE_BYTES) -> Callable[[str], bytes]:
        """`get` behind a thread-safe LRU cache of up to `max_bytes`. Bytes never change under their hash,
        so nothing can go stale: a reader that reads the same screenshots again (the trainer, every epoch
        and every anchor step) fetches and verifies each once, instead of spending its CPU on HTTP."""
        cache = cachetools.LRUCache(max_bytes, getsizeof=len)
        return cachetools.cached(cache, lock=threading.Lock())(self.get)

    def _fetch(self, sha256: str) -> bytes:
        try:
            resp = self.client.get_object(self.bucket, self.key(sha256))
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                raise ScreenshotMissing(sha256) from None
            raise
        try:
            return resp.read()
        finally:
            resp.close()
            resp.release_conn()

    def get_many(self, hashes: Iterable[str], workers: int = 8) -> dict[str, bytes]:
        """Fetch distinct hashes in parallel (the trainer's batch fetch); any corruption raises."""
        unique = list(dict.fromkeys(hashes))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return dict(zip(unique, pool.map(self.get, unique)))
