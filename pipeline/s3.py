"""The S3 client, the retry policy for a store that is down or busy, and the ledger's Arrow filesystem.

Every reader and writer of the object store (the screenshot store, checkpoints, the ledger) builds its
client with `minio_client` and waits out an unreachable or full store with `patiently`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import certifi
import pyarrow.fs as pafs
import tenacity
import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, S3Error, ServerError

from pipeline.settings import StackSettings

STORE_PATIENCE_S = 600.0
"""How long a writer waits out an unreachable or full object store before it gives up."""
STORE_READ_TIMEOUT_S = 60.0
"""How long one request may wait for the store's answer. A Ceph cluster that is out of space does not
refuse a write, it holds it; minio's default (300 s, then 5 retries) turned that into a 25-minute
silence. With this, a held request fails in a minute and `patiently` says so while it waits."""
_FULL = ("QuotaExceeded", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded")
_BUSY = ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout")
log = logging.getLogger("awrl.store")
T = TypeVar("T")


class StoreUnavailable(RuntimeError):
    """The object store stayed unreachable or full for longer than the caller would wait."""


def store_trouble(exc: BaseException) -> str | None:
    """Why `exc` is worth waiting out ("full", "not answering" or "unreachable"), or None for a real error."""
    if isinstance(exc, S3Error):
        return "full" if exc.code in _FULL else "unreachable" if exc.code in _BUSY else None
    if isinstance(getattr(exc, "reason", exc), urllib3.exceptions.ReadTimeoutError):
        return "not answering (a Ceph cluster out of space holds writes)"
    if isinstance(exc, ServerError | InvalidResponseError | urllib3.exceptions.HTTPError | ConnectionError):
        return "unreachable"
    return None


def patiently(
    fn: Callable[[], T], what: str, patience_s: float = STORE_PATIENCE_S, on_wait: Callable[[float], None] | None = None
) -> T:
    """`fn()`, retried with backoff while the store is unreachable or full, for up to `patience_s`.

    The paper's system deadlocked when its screenshot disk filled up. Here a writer pauses, says
    why (once, then every ~30 s), and resumes by itself when space is freed or the store is back;
    after `patience_s` it raises `StoreUnavailable` naming the cause. `on_wait(seconds)` gets the
    length of the pause, from the first attempt to the end (the writer's pause accounting)."""
    started = time.monotonic()
    last_said = [float("-inf")]
    paused = [False]

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception()
        if time.monotonic() - last_said[0] > 30:
            log.warning(
                "object store %s while %s (%s); paused, retrying for up to %.0f s",
                store_trouble(exc),
                what,
                _short(exc),
                patience_s - (time.monotonic() - started),
            )
            last_said[0] = time.monotonic()
        paused[0] = True

    try:
        for attempt in tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: store_trouble(e) is not None),
            wait=tenacity.wait_exponential(multiplier=0.25, max=5),
            stop=tenacity.stop_after_delay(patience_s),
            before_sleep=before_sleep,
            reraise=True,
        ):
            with attempt:
                return fn()
    except Exception as exc:
        if store_trouble(exc) is None:
            raise
        raise StoreUnavailable(
            f"object store {store_trouble(exc)} for {time.monotonic() - started:.0f} s while {what}: {_short(exc)}"
        ) from exc
    finally:
        if paused[0] and on_wait is not None:
            on_wait(time.monotonic() - started)
    raise AssertionError("unreachable")


def _short(exc: BaseException) -> str:
    if isinstance(exc, S3Error):
        return f"{exc.code} on bucket {exc.bucket_name}"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else '-'}"


def minio_client(settings: StackSettings) -> Minio:
    """minio's own HTTP pool, except that a read timeout is not retried inside it (`read=0`): it goes
    to `patiently`, which logs it and decides how long to wait."""
    access, secret = settings.s3_credentials()
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=10, read=STORE_READ_TIMEOUT_S),
        maxsize=10,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=5, read=0, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
    )
    return Minio(
        settings.s3_endpoint, access_key=access, secret_key=secret, secure=settings.s3_secure, http_client=http
    )


def remove_bucket(settings: StackSettings) -> None:
    """Delete `settings.s3_bucket` and everything in it (a test's or a benchmark run's own bucket)."""
    client, bucket = minio_client(settings), settings.s3_bucket
    if not client.bucket_exists(bucket):
        return
    names = (DeleteObject(o.object_name) for o in client.list_objects(bucket, recursive=True))
    errors = list(client.remove_objects(bucket, names))
    if errors:
        raise RuntimeError(f"could not empty bucket {bucket}: {errors[:3]}")
    client.remove_bucket(bucket)


def ledger_filesystem(settings: StackSettings, create: bool = True) -> tuple[pafs.FileSystem, str]:
    """The filesystem and root path of `settings.ledger_uri` (S3 through the stack's endpoint, or local;
    a local root is created unless `create` is false: readers must not write)."""
    uri = settings.ledger_uri
    if uri.startswith("s3://"):
        access, secret = settings.s3_credentials()
        fs = pafs.S3FileSystem(
            access_key=access,
            secret_key=secret,
            endpoint_override=settings.s3_endpoint,
            scheme="https" if settings.s3_secure else "http",
            region="us-east-1",
        )
        return fs, uri.removeprefix("s3://").rstrip("/")
    path = os.path.abspath(uri.removeprefix("file://"))
    if create:
        os.makedirs(path, exist_ok=True)
    return pafs.LocalFileSystem(), path
