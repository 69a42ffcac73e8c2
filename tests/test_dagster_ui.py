"""`dagster dev` as the user runs it, driven through its web UI in real Chromium.

A tmp ledger holds one run; the sensor (running by default in the daemon) must add it as a partition
and refresh it; then the test launches "Materialize all" from the asset graph like a person would and
waits for the run to succeed. A screenshot of the graph goes to the tmp dir and to /tmp/dagster_ui.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from test_assets import ASSETS, RUN, write_sample_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RUNS = "{ runsOrError { ... on Runs { results { runId status tags { key value } } } } }"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graphql(base: str, query: str) -> dict:
    req = urllib.request.Request(
        f"{base}/graphql", data=json.dumps({"query": query}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)["data"]


def _wait(what: str, check, timeout: float, every: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def dagster_dev_server(tmp_path: Path, env: dict[str, str]):
    """`dagster dev -m assets` on a free port, with `env` (the ledger and stack settings, `AWRL_*`);
    yields its URL. Run outside the checkout: `dagster dev` loads a `./.env` over its environment, and
    the checkout may hold one (`awrl stack up` writes it), naming another stack. Stopped with SIGINT (it
    ignores SIGTERM), then its process group killed."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    base = f"http://127.0.0.1:{_free_port()}"
    log = open(tmp_path / "dagster_dev.log", "wb")
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("dagster")),
            "dev",
            "-m",
            "assets",
            "-h",
            "127.0.0.1",
            "-p",
            base.rsplit(":", 1)[1],
        ],
        cwd=tmp_path,
        env={**os.environ, **env, "DAGSTER_HOME": str(home)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )

    def up():
        assert proc.poll() is None, (tmp_path / "dagster_dev.log").read_text()[-3000:]
        try:
            return urllib.request.urlopen(f"{base}/server_info", timeout=5).status == 200
        except OSError:
            return False

    try:
        _wait("the webserver", up, timeout=180)
        print(f"dagster dev answered after {time.monotonic() - started:.1f} s")
        yield base
    except BaseException:  # what the daemon said, e.g. why the sensor never ticked
        log.flush()
        print("dagster dev's log, last lines:\n" + (tmp_path / "dagster_dev.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        stopping = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
            print(f"dagster dev stopped on SIGINT in {time.monotonic() - stopping:.1f} s")
        except subprocess.TimeoutExpired:
            print("dagster dev ignored SIGINT for 30 s: killing its process group")
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the parent
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()


def open_ui(p, base: str, path: str):
    """A Chromium page on the Dagster UI at `path`, past the first-visit dialog."""
    browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{base}{path}")
    return browser, page


def skip_welcome(page):
    try:  # first visit of a fresh browser: a "join the community" dialog covers the page
        page.get_by_role("button", name="Skip").click(timeout=5_000)
    except Exception:
        pass


def launch_all_partitions(page, button: str):
    """Click `button` (Materialize ...), pick every partition, launch: as a person does."""
    materialize = page.get_by_role("button", name=button)
    materialize.wait_for(timeout=90_000)
    skip_welcome(page)
    materialize.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("button", name="All", exact=True).click()
    dialog.get_by_role("button", name="Launch 1 run").click()
    dialog.wait_for(state="hidden", timeout=30_000)


SENSOR_WAIT_S = 240
"""The daemon loads the code location in its own process before the sensor's first tick (TICK_S after
start): on a loaded 2-core machine that took more than 90 s once."""


def wait_for_partitions(base: str, asset: str) -> list[str]:
    """The partitions of `asset`, once the sensor has added at least one."""
    query = '{ assetNodeOrError(assetKey: {path: ["%s"]}) { ... on AssetNode { partitionKeys } } }' % asset  # noqa: UP031 - GraphQL: an f-string doubles every brace
    t0 = time.monotonic()
    keys = _wait(
        "the sensor to add the run partition",
        lambda: _graphql(base, query)["assetNodeOrError"]["partitionKeys"],
        timeout=SENSOR_WAIT_S,
    )
    print(f"sensor added the partition after {time.monotonic() - t0:.1f} s")
    return keys


def finished_runs(base: str):
    """Every run, once all have ended and one was launched from the UI (not by the sensor)."""
    runs = _graphql(base, RUNS)["runsOrError"]["results"]
    ui = [r for r in runs if not any(t["key"] == "dagster/sensor_name" for t in r["tags"])]
    done = all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs)
    return runs if ui and done else None


@pytest.fixture()
def dagster_dev(tmp_path):
    ledger = tmp_path / "ledger"
    write_sample_run(str(ledger))
    with dagster_dev_server(tmp_path, {"AWRL_LEDGER_URI": str(ledger)}) as base:
        yield base, tmp_path, ledger


def test_sensor_and_ui_materialize_a_run(dagster_dev):
    from playwright.sync_api import sync_playwright

    base, tmp_path, ledger = dagster_dev
    t0 = time.monotonic()
    assert wait_for_partitions(base, "steps") == [RUN]

    with sync_playwright() as p:
        browser, page = open_ui(p, base, "/asset-groups")  # the global graph: every group, events at the top
        launch_all_partitions(page, "Materialize all")
        print(f"run launched from the UI after {time.monotonic() - t0:.1f} s")
        runs = _wait("the launched runs to finish", lambda: finished_runs(base), timeout=180)
        assert {r["status"] for r in runs} == {"SUCCESS"}, runs
        print(f"{len(runs)} runs succeeded after {time.monotonic() - t0:.1f} s")
        assert any(t["key"] == "dagster/sensor_name" for r in runs for t in r["tags"]), "sensor launched no run"

        page.reload()
        try:
            # the global graph draws each group as one box: events -> trajectories, training -> analysis
            page.get_by_text("analysis", exact=True).last.wait_for(timeout=60_000)
            page.wait_for_timeout(2_000)
        finally:  # the picture, also of a page that did not show what the test waited for
            page.screenshot(path=str(tmp_path / "asset_graph.png"))
            shutil.copy(tmp_path / "asset_graph.png", "/tmp/dagster_ui.png")
        browser.close()
    for asset in ASSETS:
        assert (ledger / "assets" / asset / f"run_id={RUN}" / "data.parquet").exists(), asset
