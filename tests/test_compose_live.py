"""`docker compose up` on a real Docker engine, checked from the host as a user would.

A `dockerd` of its own (data under a temporary directory, stopped by PID), the images built from
Debian's packages and PyPI (`make images`), then the user's compose file with the stand-ins of
`docker-compose.local.yml` (the registry images cannot be pulled here) and the app profile of
`docker-compose.cpu.yml` (no GPU here):
- `up`: every long-running service healthy, the one-shot `demo` exiting 0, and its run read from the
  host through the published store port with `awrl runs` and `awrl sql`;
- `--profile app up`: rollout pool, torchrun trainer (2 ranks) and ledger writer train a run through the
  writer's crash, losing and repeating no event, and the host replays the run's updates;
- `dagster dev` on the host and `--profile dagster up` (on PostgreSQL) show the compose runs.

Skipped, with the reason, where no engine can start (not root, no `dockerd` or `debootstrap`: `make
setup` installs both); `AWRL_COMPOSE_LIVE=0` skips it too. `AWRL_DOCKER_ROOT=DIR` keeps the engine's
data (and so its images) between runs."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from dotenv import dotenv_values

from pipeline.ledger import read_events
from pipeline.settings import StackSettings

from faults import ledger_ids
from test_compose import BINARY
from test_dagster_ui import _wait, dagster_dev_server, wait_for_partitions

ROOT = Path(__file__).resolve().parents[1]
FILES = [
    a
    for f in ("docker-compose.yml", "docker-compose.local.yml", "docker-compose.cpu.yml")
    for a in ("-f", str(ROOT / f))
]
"""The user's file, the registry stand-ins and the app profile without a GPU (which changes nothing in
the default profile: `tests/test_compose.py`)."""
PROJECT = "awrl-live"
WAIT_S = 45 * 60.0
"""Bounds a hang only: every wait is for a state (healthy, exited), never a duration."""
LONG_RUNNING = ("kafka", "minio")
DAGSTER_PORT = 3000
"""The dagster profile's webserver, published on 127.0.0.1 (docker-compose.yml)."""
AWRL = str(ROOT / ".venv" / "bin" / "awrl")
# Debian's CLI: it builds with the engine's own BuildKit (a CLI without the buildx plugin cannot).
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"

pytestmark = [
    pytest.mark.skipif(os.environ.get("AWRL_COMPOSE_LIVE") == "0", reason="AWRL_COMPOSE_LIVE=0"),
    pytest.mark.timeout(2 * WAIT_S),  # the images, the stack and the demo are set up inside the first test's
]


def _engine_missing() -> str | None:
    if os.geteuid() != 0:
        return "dockerd needs root"
    for tool in ("dockerd", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install docker.io debootstrap)"
    return None


class EngineUnavailable(Exception):
    """No storage driver let `dockerd` start here: the test is skipped with this reason."""


DRIVERS = (os.environ["AWRL_DOCKER_STORAGE"],) if os.environ.get("AWRL_DOCKER_STORAGE") else ("overlay2", "vfs")
"""overlay2 first (it shares layers); vfs, which works on any filesystem but copies every layer, where
overlay2 cannot mount."""


class Engine:
    """A Docker engine of this test's own, on a socket of its own."""

    def __init__(self, root: Path):
        self.root = root
        # containerd's sockets live under the exec root: a unix socket path must stay under 108 bytes
        self.run_dir = Path(tempfile.mkdtemp(prefix="awrl-dx-", dir="/tmp"))
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.run_dir}/docker.sock"}
        for key in [k for k in self.env if k.startswith("AWRL_")]:
            del self.env[key]  # compose interpolates only the test's env file
        self.log = (root / "dockerd.log").open("ab")
        for driver in DRIVERS:
            self.proc = self._dockerd(driver)
            if self._answers(within_s=120):
                return
            self._kill()
        self.log.close()
        tail = (root / "dockerd.log").read_text(errors="replace").strip().splitlines()[-1:]
        shutil.rmtree(self.run_dir, ignore_errors=True)
        raise EngineUnavailable(f"dockerd did not start with {' or '.join(DRIVERS)}: {' '.join(tail)[-300:]}")

    def _dockerd(self, driver: str) -> subprocess.Popen:
        argv = ["dockerd", "--data-root", str(self.root / "data"), "--exec-root", str(self.run_dir / "exec"),
                "--pidfile", str(self.run_dir / "dockerd.pid"), "-H", self.env["DOCKER_HOST"],
                "--storage-driver", driver]  # fmt: skip
        return subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def _answers(self, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.docker("info", check=False).returncode == 0:
                return True
            time.sleep(1.0)
        return False

    def _kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        # dockerd bind-mounts its data root onto itself (which os.path.ismount cannot see), and only a
        # clean exit undoes it
        subprocess.run(["umount", "--lazy", str(self.root / "data")], capture_output=True, check=False)

    def docker(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [DOCKER, *args], env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    @staticmethod
    def compose_argv(env_file: Path) -> list[str]:
        """`docker compose` on the user's file with the stand-ins, as this test's project."""
        return [str(BINARY), "-p", PROJECT, "--env-file", str(env_file), *FILES]

    def compose(self, env_file: Path, *args: str, check: bool = True, timeout: float = 600):
        out = subprocess.run(
            [*self.compose_argv(env_file), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        assert not check or out.returncode == 0, f"docker compose {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # dockerd stops its containers and its containerd
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self._kill()
        self.log.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    missing = _engine_missing()
    if missing:
        pytest.skip(missing)
    kept = os.environ.get("AWRL_DOCKER_ROOT")
    root = Path(kept) if kept else tmp_path_factory.mktemp("docker")
    root.mkdir(parents=True, exist_ok=True)
    try:
        engine = Engine(root)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield engine
    finally:
        engine.stop()
        if not kept:
            shutil.rmtree(root, ignore_errors=True)  # image layers: gigabytes


@pytest.fixture(scope="module")
def images(engine) -> dict[str, float]:
    """`make images` once per engine (a kept engine keeps them): each image's size in MB."""
    names = ("asyncwebrl-base:bookworm", "asyncwebrl:dev", "asyncwebrl-dagster:dev", "asyncwebrl-s3:dev",
             "asyncwebrl-postgres:dev")  # fmt: skip
    if any(engine.docker("image", "inspect", n, check=False).returncode for n in names):
        started = time.monotonic()
        built = subprocess.run(
            ["make", "images", f"DOCKER={DOCKER}"],
            cwd=ROOT,
            env=engine.env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
        print(f"make images: {time.monotonic() - started:.0f} s")
    return {n: int(engine.docker("image", "inspect", "-f", "{{.Size}}", n).stdout) / 1e6 for n in names}


APP_ENV = {
    "AWRL_TRAINER_NPROC": "2",
    "AWRL_ROLLOUT_POLICY": "demo",
    "AWRL_ROLLOUT_NOISE": "0.5",
    "AWRL_SUITE": "boxes",
    "AWRL_GROUPS_PER_UPDATE": "1",
}
"""The app profile's settings in .env (docker-compose.cpu.yml's): 2 trainer ranks, and groups that
differ from the first episode (the oracle's actions, half of them random, scored by the local model)."""


def _env_file(where: Path) -> Path:
    """.env.example with fresh secrets (what a user's `cp .env.example .env` and edit gives), a run id
    of its own for the app profile, and its models folder under `where`."""
    text = (ROOT / ".env.example").read_text()
    for placeholder in ("change-me-access-key", "change-me-secret-key", "change-me-postgres-password"):
        text = text.replace(placeholder, secrets.token_hex(12))
    settings = {**APP_ENV, "AWRL_RUN_ID": f"live-{secrets.token_hex(3)}", "AWRL_MODELS_DIR": str(where / "models")}
    lines = [line for line in text.splitlines() if line.partition("=")[0] not in settings]
    path = where / ".env"
    path.write_text("\n".join([*lines, *(f"{k}={v}" for k, v in settings.items())]) + "\n")
    return path


def _states(engine: Engine, env_file: Path) -> dict[str, dict]:
    out = engine.compose(env_file, "ps", "-a", "--format", "json").stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    if len(rows) == 1 and isinstance(rows[0], list):  # some compose versions print one array
        rows = rows[0]
    return {r["Service"]: r for r in rows}


def _host_settings(env_file: Path) -> StackSettings:
    """The stack's settings as the host reads them from .env (the published store port)."""
    env = _host_env(env_file)
    return StackSettings(**{k: env[f"AWRL_{k.upper()}"] for k in ("s3_endpoint", "s3_access_key", "s3_secret_key",
                                                                  "s3_bucket", "ledger_uri")})  # fmt: skip


def _host_env(env_file: Path) -> dict[str, str]:
    """The host's `awrl`, configured by the same .env as compose (the published store port)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AWRL_")}, **dotenv_values(env_file)}


@pytest.fixture(scope="module")
def stack(engine, images, tmp_path_factory):
    """`docker compose up` with the stand-ins, until the demo's one-shot service has exited."""
    env_file = _env_file(tmp_path_factory.mktemp("compose"))
    started = time.monotonic()
    engine.compose(env_file, "up", "-d", "--no-build")
    try:
        _wait(
            "the broker and the store to be healthy",
            lambda: _healthy(engine, env_file, LONG_RUNNING),
            WAIT_S,
        )
        times = {"healthy_s": time.monotonic() - started}
        demo = _wait(
            "the demo to exit",
            lambda: (s := _states(engine, env_file).get("demo")) and s.get("State") == "exited" and s,
            WAIT_S,
            every=5.0,
        )
        times["demo_s"] = time.monotonic() - started
        print(f"compose: {times}, images (MB): {images}")
        yield env_file, demo, times
    finally:
        logs = engine.compose(env_file, "logs", "--no-color", "--tail", "200", check=False).stdout
        (tmp_path_factory.getbasetemp() / "compose.log").write_text(logs)
        engine.compose(env_file, "down", "-v", check=False)


def test_compose_up_runs_the_demo_and_the_host_reads_it(stack):
    env_file, demo, times = stack
    assert demo.get("ExitCode") == 0, f"the demo exited {demo.get('ExitCode')}"
    env = _host_env(env_file)
    runs = subprocess.run([AWRL, "runs"], env=env, capture_output=True, text=True, timeout=300)
    assert runs.returncode == 0, runs.stderr
    assert "demo" in runs.stdout, runs.stdout
    count = subprocess.run(
        [AWRL, "sql", "SELECT count(*) AS n FROM trajectories"], env=env, capture_output=True, text=True, timeout=300
    )
    assert count.returncode == 0, count.stderr
    numbers = [int(w) for w in count.stdout.replace("│", " ").split() if w.isdigit()]
    assert numbers and max(numbers) > 0, count.stdout


LOG_IDS = """
import json, sys
from pipeline.consumer import read_log
from pipeline.settings import StackSettings
from pipeline.topics import ROLLOUT, TASKS, TRAINER
s = StackSettings()
ids = {e.event_id for t in (TASKS, ROLLOUT, TRAINER) for e in read_log(s, t) if e.run_id == sys.argv[1]}
print(json.dumps(sorted(ids)))
"""
"""The run's event ids in the broker's log, read on the compose network (no broker port is published)."""


def _container(engine: Engine, env_file: Path, service: str) -> dict:
    cid = engine.compose(env_file, "ps", "-q", service).stdout.strip()
    assert cid, f"no {service} container"
    return json.loads(engine.docker("inspect", cid).stdout)[0]


def _healthy(engine: Engine, env_file: Path, services: tuple[str, ...]) -> bool:
    states = _states(engine, env_file)
    return all(states.get(s, {}).get("Health") == "healthy" for s in services)


def _alive(engine: Engine, env_file: Path, services: tuple[str, ...]) -> bool:
    """True; fails the test with the service's last log lines if one has crashed (and been restarted)."""
    for service in services:
        if _container(engine, env_file, service)["RestartCount"]:
            logs = engine.compose(env_file, "logs", "--no-color", "--tail", "60", service, check=False).stdout
            raise AssertionError(f"{service} crashed:\n{logs}")
    return True


def _updates(settings: StackSettings, run_id: str):
    return read_events(settings, run_id, "UpdateApplied", columns=["update_step", "world_size"])


def test_the_app_profile_trains_on_cpu_through_a_ledger_writer_crash(engine, stack, tmp_path):
    """The app profile without a GPU (docker-compose.cpu.yml): the rollout pool, the trainer under
    torchrun with 2 ranks and the ledger writer, each a container healthy by its heartbeat. The writer's
    process is SIGKILLed from the host once the run's first events are in the ledger: a crash, which its
    restart policy answers (`docker kill` would count as a manual stop). After 2 updates and a step
    sampled by a trained version (the pool loads each one from the store), pool and trainer are
    stopped: every event the broker acknowledged is in the ledger once, and the host's `awrl replay`
    reproduces the run's updates bit for bit from the compose store."""
    env_file, _, _ = stack
    run_id = dotenv_values(env_file)["AWRL_RUN_ID"]
    app = ("rollout", "trainer", "ledger")
    engine.compose(env_file, "--profile", "app", "up", "-d", "--no-build", *app)
    settings = _host_settings(env_file)
    _wait("the run's first events in the ledger", lambda: ledger_ids(settings, run_id), WAIT_S, every=1.0)
    before = _container(engine, env_file, "ledger")
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    _wait(
        "compose's restart policy to bring the ledger writer back",
        lambda: (
            (c := _container(engine, env_file, "ledger"))["RestartCount"] > before["RestartCount"]
            and c["State"]["Running"]
        ),
        WAIT_S,
    )
    working = ("rollout", "trainer")
    _wait(
        "2 updates in the ledger",
        lambda: _alive(engine, env_file, working) and _updates(settings, run_id).num_rows >= 2,
        WAIT_S,
        every=5.0,
    )
    newer = pc.field("policy_version") > 0
    _wait(
        "a step sampled by a trained version",
        lambda: (
            _alive(engine, env_file, working)
            and read_events(settings, run_id, "StepRecorded", columns=["step"], where=newer).num_rows
        ),
        WAIT_S,
        every=5.0,
    )
    _wait("the app services to be healthy", lambda: _healthy(engine, env_file, app), WAIT_S, every=5.0)
    assert set(_updates(settings, run_id).column("world_size").to_pylist()) == {2}
    engine.compose(env_file, "--profile", "app", "stop", "rollout", "trainer", timeout=900)
    read = engine.compose(env_file, "run", "--rm", "--no-deps", "demo", "python", "-c", LOG_IDS, run_id)
    logged = json.loads(read.stdout.splitlines()[-1])
    assert logged, "the run's events should be in the broker's log"
    _wait("every acknowledged event in the ledger", lambda: set(ledger_ids(settings, run_id)) >= set(logged), WAIT_S)
    ids = ledger_ids(settings, run_id)
    assert len(ids) == len(set(ids)), "an event was written twice"
    assert set(ids) == set(logged)
    replay = subprocess.run(
        [AWRL, "replay", run_id, "--out", str(tmp_path)],
        env=_host_env(env_file),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]


def _compose_runs(env_file: Path) -> set[str]:
    listed = subprocess.run(
        [AWRL, "runs", "--format", "json"], env=_host_env(env_file), capture_output=True, text=True, timeout=300
    )
    assert listed.returncode == 0, listed.stderr
    return {r["run_id"] for r in json.loads(listed.stdout)}


def test_dagster_dev_on_the_host_shows_the_compose_runs(stack, tmp_path):
    """The card's second command: `dagster dev` on the host, reading the same .env, adds the runs of
    the compose store's ledger as partitions."""
    env_file, _, _ = stack
    run_ids = _compose_runs(env_file)
    env = {k: v for k, v in _host_env(env_file).items() if k.startswith("AWRL_")}
    with dagster_dev_server(tmp_path, env) as base:
        keys = wait_for_partitions(base, "steps")
    assert keys and set(keys) <= run_ids, (keys, run_ids)


def test_the_dagster_profile_serves_the_compose_runs_from_postgres(engine, stack):
    """`docker compose --profile dagster up`: the webserver and the daemon (whose sensor adds the
    partitions) share PostgreSQL, here Debian's server in the stand-in image; both healthy, and the
    webserver's published port shows the compose runs as partitions."""
    env_file, _, _ = stack
    dagster = ("postgres", "dagster-webserver", "dagster-daemon")
    engine.compose(env_file, "--profile", "dagster", "up", "-d", "--no-build", *dagster)
    _wait("the dagster profile to be healthy", lambda: _healthy(engine, env_file, dagster), WAIT_S, every=5.0)
    keys = wait_for_partitions(f"http://127.0.0.1:{DAGSTER_PORT}", "steps")
    assert keys and set(keys) <= _compose_runs(env_file), keys
