"""`awrl view` as a person uses it, in real Chromium, over a run in the ledger and the real object store;
and the run's exports (TensorBoard, dataset) read back with those tools' own readers.

The run (`write_viewable_run`): 2 groups of 4 trajectories acting on rendered pages stored in the
radosgw fixture, one update, and one more trajectory whose screenshots are missing and corrupt.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from PIL import Image, ImageChops

from analysis.views import connect, load_sql
from pipeline.ledger import LedgerWriter
from pipeline.s3 import minio_client
from pipeline.store import ScreenshotStore
from schemas import EpisodeFinished, EpisodeStarted

from samples import render_page, sample_step, write_viewable_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--force-color-profile=srgb"]
BROKEN = "broken-t0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def viewed(module_settings, tmp_path_factory):
    """(settings, run_id, base URL, server pid): the run written, `awrl view` serving it."""
    settings = module_settings.model_copy(update={"ledger_uri": str(tmp_path_factory.mktemp("ledger"))})
    run_id = f"view-{uuid.uuid4().hex[:6]}"
    write_viewable_run(settings, run_id)
    _write_broken_trajectory(settings, run_id)
    port = _free_port()
    log = open(tmp_path_factory.mktemp("viewer") / "view.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("awrl")), "view", "--port", str(port)],
        env={**os.environ, **settings.environ()},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "awrl view exited"
        try:
            urllib.request.urlopen(base + "/", timeout=5)
            break
        except OSError:
            assert time.monotonic() < deadline, "awrl view did not answer in 60 s"
            time.sleep(0.5)
    yield settings, run_id, base, proc.pid
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    log.close()


def _write_broken_trajectory(settings, run_id: str) -> None:
    """One trajectory whose first screenshot is missing from the store and whose second is corrupt."""
    store = ScreenshotStore.from_settings(settings)
    missing = hashlib.sha256(b"never stored").hexdigest()
    corrupt = hashlib.sha256(render_page("corrupt me", seed=99)).hexdigest()
    body = b"not the bytes that hash to the key"
    minio_client(settings).put_object(settings.s3_bucket, store.key(corrupt), io.BytesIO(body), len(body))
    events = [
        EpisodeStarted(
            run_id=run_id,
            trajectory_id=BROKEN,
            group_id="broken",
            task_id="sample-task",
            worker_id="sample",
            instruction="x",
            horizon=10,
            policy_version=0,
        ),
        sample_step(run_id, "broken", BROKEN, 0, missing),
        sample_step(run_id, "broken", BROKEN, 1, corrupt),
        EpisodeFinished(
            run_id=run_id,
            trajectory_id=BROKEN,
            group_id="broken",
            task_id="sample-task",
            outcome="env_error",
            reward=0.0,
            num_steps=2,
            reason="browser_crash",
        ),
    ]
    writer = LedgerWriter(settings)
    for cls in (EpisodeStarted, type(events[1]), EpisodeFinished):
        writer._write(run_id, cls.__name__, [e for e in events if isinstance(e, cls)])


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    yield context.new_page()
    context.close()


def _ids(settings, run_id: str) -> dict:
    con = connect(settings.ledger_uri)
    first = con.execute(
        "SELECT trajectory_id, group_id FROM trajectories WHERE run_id = $r AND group_id = 'g0' "
        "ORDER BY num_steps DESC, trajectory_id LIMIT 1",
        {"r": run_id},
    ).fetchall()[0]
    counts = dict(
        con.execute(
            "SELECT outcome, count(*) FROM trajectories WHERE run_id = $r GROUP BY ALL", {"r": run_id}
        ).fetchall()
    )
    return {"trajectory": first[0], "group": first[1], "counts": counts, "con": con}


def test_every_page_loads_for_a_recorded_run(viewed, page):
    settings, run_id, base, _ = viewed
    ids = _ids(settings, run_id)
    for path, heading in [
        ("/", "Runs"),
        (f"/runs/{run_id}", run_id),
        (f"/runs/{run_id}/trajectories/{ids['trajectory']}", ids["trajectory"]),
        (f"/runs/{run_id}/groups/g0", "group g0"),
        (f"/runs/{run_id}/updates/0", "update 0"),
    ]:
        response = page.goto(base + path)
        assert response.status == 200, path
        assert page.locator("h1").inner_text().startswith(heading), path
        assert "Traceback" not in page.content()
    page.goto(f"{base}/")
    page.click(f"text={run_id}")  # links lead where they say
    assert page.url.endswith(f"/runs/{run_id}")
    curves = page.request.get(f"{base}/runs/{run_id}/curves.svg")
    assert curves.status == 200 and b"<svg" in curves.body()[:400]


def test_a_screenshot_renders_the_stored_pixels(viewed, page):
    settings, run_id, base, _ = viewed
    ids = _ids(settings, run_id)
    page.goto(f"{base}/runs/{run_id}/trajectories/{ids['trajectory']}")
    img = page.locator("img.plain").first
    sha = img.get_attribute("data-sha")
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img.element_handle())
    drawn = page.evaluate(
        """img => { const c = document.createElement('canvas');
        c.width = img.naturalWidth; c.height = img.naturalHeight;
        c.getContext('2d').drawImage(img, 0, 0); return c.toDataURL('image/png'); }""",
        img.element_handle(),
    )
    seen = Image.open(io.BytesIO(base64.b64decode(drawn.split(",", 1)[1]))).convert("RGB")
    stored = Image.open(io.BytesIO(ScreenshotStore.from_settings(settings).get(sha))).convert("RGB")
    assert seen.size == stored.size == (1280, 720)
    assert ImageChops.difference(seen, stored).getbbox() is None  # every pixel equal
    headers = page.request.get(f"{base}/screenshots/{sha}.png").headers
    assert "immutable" in headers["cache-control"] and sha in headers["etag"]
    # with the marks and the click drawn: the same size, other pixels
    page.check("#marks")
    marked = page.locator("img.drawn").first
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=marked.element_handle())
    assert marked.is_visible() and not img.is_visible()
    overlay = page.request.get(base + marked.get_attribute("src")).body()
    assert Image.open(io.BytesIO(overlay)).size == (1280, 720)
    assert ImageChops.difference(Image.open(io.BytesIO(overlay)).convert("RGB"), stored).getbbox() is not None


def test_the_trajectory_table_filters_by_outcome(viewed, page):
    from playwright.sync_api import expect

    settings, run_id, base, _ = viewed
    counts = _ids(settings, run_id)["counts"]
    page.goto(f"{base}/runs/{run_id}")
    assert page.locator("#trajectory-table tr").count() - 1 == sum(counts.values())
    for outcome in ("failure", "success", "env_error"):
        page.click(f"#outcome-filter >> text={outcome} (")
        # The page filters after the click: wait for it (a loaded machine read the cells before it had).
        cells = page.locator("#trajectory-table td.outcome")
        if counts[outcome]:
            expect(cells).to_have_text([outcome] * counts[outcome], timeout=60_000)
        else:
            expect(cells).to_have_count(0, timeout=60_000)


def test_the_memory_highlight_matches_the_drift_key_sets(viewed, page):
    settings, run_id, base, _ = viewed
    ids = _ids(settings, run_id)
    con = ids["con"]
    con.execute(load_sql("drift_step_keys"), {"run_id": run_id})
    keys = dict(
        con.execute(
            "SELECT step, num_keys FROM drift_step_keys WHERE trajectory_id = $t", {"t": ids["trajectory"]}
        ).fetchall()
    )
    memory = dict(
        con.execute(
            "SELECT step, memory_keys FROM steps WHERE run_id = $r AND trajectory_id = $t",
            {"r": run_id, "t": ids["trajectory"]},
        ).fetchall()
    )
    page.goto(f"{base}/runs/{run_id}/trajectories/{ids['trajectory']}")
    assert len(keys) >= 2
    for step, n in keys.items():
        table = page.locator(f"#step-{step} table.memory")
        shown = table.locator("tr:not(.dropped) td.key").all_inner_texts()
        assert len(shown) == n and sorted(shown) == sorted(memory[step])
        before = set(memory.get(step - 1, []))
        assert set(table.locator("tr.added td.key").all_inner_texts()) == set(memory[step]) - before
        assert set(table.locator("tr.dropped td.key").all_inner_texts()) == before - set(memory[step])


def test_a_group_page_shows_all_its_trajectories(viewed, page):
    settings, run_id, base, _ = viewed
    page.goto(f"{base}/runs/{run_id}/groups/g0")
    members = page.locator("#members .member")
    assert members.count() == 4  # G
    outcomes = [c.split(" ")[0] for c in members.locator("p").all_inner_texts()]
    assert outcomes == sorted(outcomes, key=lambda o: o != "success")  # successes first


def _status(base: str, path: str) -> tuple[int, str]:
    """A raw request: the path exactly as written (no client-side normalisation of `..`)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    return resp.status, body


def test_bad_input_is_a_404_page_without_a_traceback(viewed, page):
    settings, run_id, base, _ = viewed
    for path in [
        "/runs/no-such-run",
        f"/runs/{run_id}/trajectories/no-such",
        f"/runs/{run_id}/groups/nope",
        f"/runs/{run_id}/updates/99",
        "/runs/bad%20id",
        f"/runs/{run_id}?outcome=maybe",
        "/screenshots/../../etc/passwd",
        "/screenshots/..%2F..%2Fetc%2Fpasswd.png",
        "/screenshots/%2e%2e%2fstack.env.png",
        "/screenshots/" + "0" * 64 + ".png",
    ]:
        status, body = _status(base, path)
        assert status == 404, path
        assert "Traceback" not in body and 'File "' not in body, path
    # the broken trajectory still shows both steps, each with a placeholder that says which
    page.goto(f"{base}/runs/{run_id}/trajectories/{BROKEN}")
    placeholders = page.locator(".placeholder").all_inner_texts()
    assert len(placeholders) == 2
    assert placeholders[0].startswith("screenshot missing") and placeholders[1].startswith("screenshot corrupt")
    assert page.locator("li.step").count() == 2


def test_the_server_binds_loopback_only(viewed):
    *_, pid = viewed
    listening = [
        c.laddr
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for c in p.net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening)


def test_tensorboard_export_reads_back_as_the_updates_view(viewed, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings, run_id, *_ = viewed
    env = {**os.environ, **settings.environ()}
    awrl = str(Path(sys.executable).with_name("awrl"))
    subprocess.run([awrl, "export", "tensorboard", run_id, "--out", str(tmp_path)], env=env, check=True)
    events = EventAccumulator(str(tmp_path / run_id))
    events.Reload()
    con = connect(settings.ledger_uri)
    cursor = con.execute(
        "SELECT update_step, loss, grad_norm, stats, COLUMNS('^mismatch_') FROM updates WHERE run_id = $r",
        {"r": run_id},
    )
    names = [d[0] for d in cursor.description]
    for step, loss, grad_norm, stats, *mismatch in cursor.fetchall():
        expect = {
            "update/loss": loss,
            "update/grad_norm": grad_norm,
            **{f"update/{k}": v for k, v in stats.items() if not k.startswith("mismatch_")},
            **{f"mismatch/{k.removeprefix('mismatch_')}": v for k, v in zip(names[4:], mismatch) if v is not None},
        }
        assert {"mismatch/k3", "mismatch/ratio_max", "mismatch/stale_tokens"} <= set(expect)
        for tag, value in expect.items():
            assert [(e.step, e.value) for e in events.Scalars(tag)] == [(step, pytest.approx(value, rel=1e-6))]
    tags = set(events.Tags()["scalars"])
    assert "mismatch/stale_k3" not in tags and not any(t.startswith("update/mismatch") for t in tags)  # NULL: none
    training = con.execute(
        "SELECT policy_version, success_rate FROM success_by_version WHERE run_id = $r AND policy_version < 1",
        {"r": run_id},
    ).fetchall()  # v0 is superseded by v1
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("rollout/success_rate")] == training
    bad = subprocess.run(
        [awrl, "export", "tensorboard", "no-such-run", "--out", str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "no run 'no-such-run'" in bad.stderr and "Traceback" not in bad.stderr


def test_dataset_export_loads_with_pyarrow_and_datasets(viewed, tmp_path):
    import datasets
    import pyarrow.parquet as pq

    settings, run_id, *_ = viewed
    out = tmp_path / "ds"
    awrl = str(Path(sys.executable).with_name("awrl"))
    env = {**os.environ, **settings.environ()}
    # the broken trajectory's screenshots cannot be exported: the command says which, in one line
    failed = subprocess.run(
        [awrl, "export", "dataset", run_id, "--out", str(out)], env=env, capture_output=True, text=True
    )
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert "screenshot" in failed.stderr
    con = connect(settings.ledger_uri)
    good = con.execute(
        "SELECT count(*) FROM steps WHERE run_id = $r AND trajectory_id <> $b", {"r": run_id, "b": BROKEN}
    ).fetchall()[0][0]
    out = tmp_path / "ds-good"
    subprocess.run([awrl, "export", "dataset", run_id, "--out", str(out), "--skip-unreadable"], env=env, check=True)
    table = pq.read_table(out)
    assert table.num_rows == good
    for row in table.select(["screenshot_sha256", "image"]).to_pylist():
        assert hashlib.sha256(row["image"]["bytes"]).hexdigest() == row["screenshot_sha256"]
    loaded = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert len(loaded) == good and loaded[0]["image"].size == (1280, 720)
    assert set(loaded.column_names) >= {"trajectory_id", "step", "outcome", "reward", "advantage", "image"}


def test_the_update_page_shows_the_sampler_trainer_mismatch(viewed, page):
    from samples import MISMATCH

    settings, run_id, base, _ = viewed
    page.goto(f"{base}/runs/{run_id}/updates/0")
    fresh = page.locator("#mismatch-fresh td").all_inner_texts()
    assert fresh == ["fresh", "40"] + [
        f"{MISMATCH[f'mismatch_{k}']:.4g}"
        for k in ("nonfinite", "k1", "k2", "k3", "ratio_min", "ratio_max", "ratio_tail")
    ]
    assert page.locator("#mismatch-stale td").all_inner_texts()[:2] == ["stale", "0"]
    assert page.locator("#mismatch-stale td").nth(5).inner_text() == "-"  # no stale token: NULL


def test_the_update_page_shows_the_replay_asset_when_there_is_one(viewed, page):
    """The `replay` asset's file, where Dagster's IO manager writes it, as its schema has it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assets.replay import SCHEMA

    settings, run_id, base, _ = viewed
    page.goto(f"{base}/runs/{run_id}/updates/0")
    assert page.locator("#replay").inner_text().startswith("not replayed")
    row = {name: None for name in SCHEMA.names} | {
        "update_step": 0,
        "version_before": 0,
        "exact": True,
        "loss_recorded": 0.5,
        "loss_replayed": 0.5,
    }
    path = Path(settings.ledger_uri) / "assets" / "replay" / f"run_id={run_id}" / "data.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([row], schema=SCHEMA), path)
    page.goto(f"{base}/runs/{run_id}/updates/0")
    assert page.locator("#replay").inner_text().startswith("bit-exact: recorded loss 0.5, replayed 0.5")
    assert page.locator("#weights").inner_text() == "1" * 64
    assert page.locator("#update-trajectories tr").count() - 1 == 8  # the 2 groups' trajectories
