"""Checkpoints in the object store against the real radosgw: round trip (multipart for the big file),
incomplete and corrupted checkpoints refused, the local cache, and a LocalPolicy refresh from s3://."""

from __future__ import annotations

import io
import json
import os
import uuid
from pathlib import Path

import pytest
import torch

from pipeline.checkpoints import (
    MANIFEST,
    CheckpointCorrupted,
    CheckpointIncomplete,
    CheckpointMissing,
    CheckpointStore,
    default_cache_dir,
)
from pipeline.hashing import sha256_hex, weights_sha256

BIG = 17 * 1024 * 1024 + 5  # above the 16 MiB part size: a multipart upload


@pytest.fixture()
def store(stack, tmp_path) -> CheckpointStore:
    return CheckpointStore.from_settings(stack.settings(), cache_dir=tmp_path / "cache")


@pytest.fixture()
def run_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A flat directory shaped like an HF checkpoint, with a > 16 MB file and an empty one."""
    d = tmp_path_factory.mktemp("hf")
    (d / "config.json").write_text(json.dumps({"model_type": "test"}))
    (d / "model.safetensors").write_bytes(os.urandom(BIG))
    (d / "tokenizer.json").write_text('{"vocab": {}}')
    (d / "added_tokens.json").write_bytes(b"")
    (d / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # hidden: not part of the checkpoint
    return d


def _count_gets(monkeypatch, store: CheckpointStore) -> list[str]:
    names: list[str] = []
    real = store.client.get_object

    def counting(bucket, name, *args, **kwargs):
        names.append(name)
        return real(bucket, name, *args, **kwargs)

    monkeypatch.setattr(store.client, "get_object", counting)
    return names


def test_round_trip_with_multipart_file(store, run_id, hf_dir):
    uri = store.upload(hf_dir, run_id, 7)
    assert uri == f"s3://{store.bucket}/checkpoints/{run_id}/v000007" == store.uri(run_id, 7)
    assert store.exists(run_id, 7) and not store.exists(run_id, 8)
    names = {"config.json", "model.safetensors", "tokenizer.json", "added_tokens.json"}
    stored = {o.object_name.rsplit("/", 1)[-1]: o for o in store.client.list_objects(
        store.bucket, prefix=f"checkpoints/{run_id}/v000007/", recursive=True)}  # fmt: skip
    assert set(stored) == names | {MANIFEST}
    # minio's multipart upload (2 parts of 16 MiB) is accepted by radosgw: the ETag tells.
    assert store.client.stat_object(store.bucket, stored["model.safetensors"].object_name).etag.endswith("-2")

    local = store.download(uri)
    assert local == store.cache_dir / run_id / "v000007"
    assert {p.name for p in local.iterdir()} == names | {MANIFEST}
    for name in names:
        assert (local / name).read_bytes() == (hf_dir / name).read_bytes()
    manifest = json.loads((local / MANIFEST).read_text())
    assert (manifest["run_id"], manifest["version"]) == (run_id, 7)
    assert {f["name"]: (f["size"], f["sha256"]) for f in manifest["files"]} == {
        n: ((hf_dir / n).stat().st_size, sha256_hex((hf_dir / n).read_bytes())) for n in names}  # fmt: skip
    assert not [p for p in local.parent.iterdir() if p.name.startswith(".")]  # no temporary leftovers

    # Local checkpoints pass through untouched.
    assert store.download(str(local)) == local
    assert store.download(local.resolve().as_uri()) == local.resolve()
    with pytest.raises(FileNotFoundError, match="config.json"):
        store.download(str(hf_dir.parent))


def test_checkpoint_without_manifest_is_refused(store, run_id, hf_dir):
    with pytest.raises(CheckpointMissing, match="no checkpoint"):
        store.download(store.uri(run_id, 1))
    store.upload(hf_dir, run_id, 1)
    store.client.remove_object(store.bucket, f"{store.key(run_id, 1)}/{MANIFEST}")  # as if it crashed before
    assert not store.exists(run_id, 1)
    with pytest.raises(CheckpointIncomplete, match="in progress or crashed"):
        store.download(store.uri(run_id, 1))
    assert not (store.cache_dir / run_id / "v000001").exists()
    # The retried upload completes it.
    store.upload(hf_dir, run_id, 1)
    assert (store.download(store.uri(run_id, 1)) / "model.safetensors").stat().st_size == BIG


def test_corrupted_object_is_detected_and_named(store, run_id, hf_dir):
    uri = store.upload(hf_dir, run_id, 2)
    evil = b'{"vocab": {"evil": 1}}'
    store.client.put_object(store.bucket, f"{store.key(run_id, 2)}/tokenizer.json", io.BytesIO(evil), len(evil))
    with pytest.raises(CheckpointCorrupted, match="tokenizer.json"):
        store.download(uri)
    run_dir = store.cache_dir / run_id
    assert not list(run_dir.iterdir())  # neither the checkpoint nor its temporary directory


def test_cache_hit_downloads_only_the_manifest(store, run_id, hf_dir, tmp_path, monkeypatch):
    uri = store.upload(hf_dir, run_id, 3)
    gets = _count_gets(monkeypatch, store)
    local = store.download(uri)
    assert len(gets) == 5  # manifest + 4 files
    mtimes = {p.name: p.stat().st_mtime_ns for p in local.iterdir()}
    gets.clear()
    assert store.download(uri) == local
    assert gets == [f"{store.key(run_id, 3)}/{MANIFEST}"]
    assert {p.name: p.stat().st_mtime_ns for p in local.iterdir()} == mtimes
    assert store.stats.cache_hits == 1 and store.stats.files_downloaded == 4

    # The same version uploaded again with other content (a trainer that crashed before publishing
    # it) replaces the cached copy; a file the new upload lacks is gone from the store too.
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "config.json").write_text(json.dumps({"model_type": "test", "changed": True}))
    (changed / "model.safetensors").write_bytes(b"small now")
    store.upload(changed, run_id, 3)
    stored = {o.object_name.rsplit("/", 1)[-1] for o in store.client.list_objects(
        store.bucket, prefix=f"{store.key(run_id, 3)}/", recursive=True)}  # fmt: skip
    assert stored == {"config.json", "model.safetensors", MANIFEST}
    local = store.download(uri)
    assert {p.name for p in local.iterdir()} == {"config.json", "model.safetensors", MANIFEST}
    assert (local / "model.safetensors").read_bytes() == b"small now"


def test_prune_cache_keeps_the_newest(store, run_id, hf_dir):
    for v in (1, 2, 10):
        (store.cache_dir / run_id / f"v{v:06d}").mkdir(parents=True)
    removed = store.prune_cache(run_id, keep=2)
    assert [p.name for p in removed] == ["v000001"]
    assert sorted(p.name for p in (store.cache_dir / run_id).iterdir()) == ["v000002", "v000010"]


def test_names_and_defaults(store, monkeypatch, tmp_path):
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="run id"):
            store.uri(bad, 0)
    with pytest.raises(ValueError, match="v000007"):
        store.download(f"s3://{store.bucket}/checkpoints/run/latest")
    with pytest.raises(ValueError, match="unsupported"):
        store.download("http://example.com/ckpt")
    with pytest.raises(ValueError, match="config.json"):
        store.upload(tmp_path, "run", 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "awrl" / "checkpoints"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "awrl" / "checkpoints"


def test_local_policy_refreshes_from_s3(store, run_id, tmp_path):
    from model.hf_io import ensure_policy, load_policy, save_policy
    from rollout.policy.local import LocalPolicy

    base = ensure_policy()
    model, tokenizer, _ = load_policy(base)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    expected = weights_sha256(model.state_dict())
    uri = store.upload(save_policy(model, tokenizer, tmp_path / "v1"), run_id, 1)

    with pytest.raises(ValueError, match="CheckpointStore"):
        LocalPolicy(base, max_new_tokens=4).load_weights(1, uri)
    policy = LocalPolicy(base, max_new_tokens=4, checkpoints=store)
    assert weights_sha256(policy.model.state_dict()) != expected
    live = policy.model
    policy.load_weights(1, uri)
    assert policy.version == 1 and policy.model is live
    assert weights_sha256(policy.model.state_dict()) == expected
    policy.load_weights(2, str(base))  # local paths still load as before
    assert policy.version == 2 and weights_sha256(policy.model.state_dict()) != expected
