"""The content-addressed screenshot store against the real radosgw."""

from __future__ import annotations

import io

import pytest
from minio import Minio
from minio.error import S3Error

from pipeline.hashing import sha256_hex
from pipeline.store import MAX_SCREENSHOT_BYTES, ScreenshotCorrupted, ScreenshotStore, ScreenshotTooLarge

from samples import render_page


@pytest.fixture(scope="module")
def pages():
    return [render_page(f"page {i}", lines=3, size=(320, 180), seed=i) for i in range(200)]


def test_put_twice_stores_once_and_reads_back_verified(stack, pages):
    store = ScreenshotStore.from_settings(stack.settings())
    store.prefix = "test-dedup"
    hashes = [store.put(p) for p in pages] + [store.put(p) for p in pages]
    assert hashes[:200] == hashes[200:] == [sha256_hex(p) for p in pages]
    assert (store.stats.puts, store.stats.dedup_hits) == (200, 200)
    objects = list(store.client.list_objects(store.bucket, prefix="test-dedup/", recursive=True))
    assert len(objects) == 200
    fetched = store.get_many(hashes)
    assert [fetched[h] for h in hashes[:200]] == pages


def test_tampered_object_fails_verification(stack, pages):
    store = ScreenshotStore.from_settings(stack.settings())
    digest = store.put(pages[0])
    evil = b"not the screenshot"
    store.client.put_object(store.bucket, store.key(digest), io.BytesIO(evil), len(evil))
    with pytest.raises(ScreenshotCorrupted, match=digest[:8]):
        store.get(digest)


def test_a_readers_cache_fetches_each_screenshot_once_and_keeps_only_verified_bytes(stack, pages):
    store = ScreenshotStore.from_settings(stack.settings())
    store.prefix = "test-cache"
    first, second, third = (store.put(p) for p in pages[:3])
    get = store.cached_get(max_bytes=len(pages[0]) + len(pages[1]))  # room for two
    assert get(first) == pages[0]
    evil = b"not the screenshot"
    store.client.put_object(store.bucket, store.key(first), io.BytesIO(evil), len(evil))
    assert get(first) == pages[0]  # served from the cache: fetched once, verified then
    store.client.put_object(store.bucket, store.key(second), io.BytesIO(evil), len(evil))
    with pytest.raises(ScreenshotCorrupted):  # a failed read is not cached: it fails again, never passes
        get(second)
    with pytest.raises(ScreenshotCorrupted):
        get(second)
    assert get(third) == pages[2]
    get(store.put(pages[3]))  # the least recently used, `first`, leaves the cache
    with pytest.raises(ScreenshotCorrupted):
        get(first)


def test_oversized_screenshot_rejected(stack):
    store = ScreenshotStore.from_settings(stack.settings())
    size = MAX_SCREENSHOT_BYTES + 1
    with pytest.raises(ScreenshotTooLarge, match=f"{size} bytes exceeds the {MAX_SCREENSHOT_BYTES}-byte limit") as err:
        store.put(b"\0" * size)
    assert isinstance(err.value, ValueError) and (err.value.size, err.value.limit) == (size, MAX_SCREENSHOT_BYTES)
    assert not store.exists(sha256_hex(b"\0" * size))


def test_wrong_secret_is_rejected_by_the_server(stack):
    s = stack.settings()
    access, secret = s.s3_credentials()
    client = Minio(s.s3_endpoint, access_key=access, secret_key=secret[::-1] + "x", secure=False)
    with pytest.raises(S3Error) as err:
        client.bucket_exists(s.s3_bucket)
    assert err.value.code in ("SignatureDoesNotMatch", "AccessDenied", "InvalidAccessKeyId")


def test_a_held_request_is_told_apart_from_an_unreachable_store():
    """A full Ceph cluster holds writes; the client's read timeout surfaces it, named, to `patiently`."""
    import urllib3

    from pipeline.s3 import store_trouble

    held = urllib3.exceptions.ReadTimeoutError(None, "/awrl/x", "Read timed out.")
    refused = urllib3.exceptions.NewConnectionError(None, "Connection refused")
    assert store_trouble(urllib3.exceptions.MaxRetryError(None, "/awrl/x", held)).startswith("not answering")
    assert store_trouble(urllib3.exceptions.MaxRetryError(None, "/awrl/x", refused)) == "unreachable"
    assert store_trouble(ValueError("a bug")) is None
