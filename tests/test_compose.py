"""docker-compose.yml is validated by the real compose implementation (no engine runs here)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import compose
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The package's bin/docker-compose is a Python wrapper that always exits 0; call the binary itself.
BINARY = Path(compose.__file__).parent / "docker-compose"


def config(env_file: Path, *profiles: str) -> subprocess.CompletedProcess:
    args = [str(BINARY), "-f", str(ROOT / "docker-compose.yml"), "--env-file", str(env_file)]
    for p in profiles:
        args += ["--profile", p]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWRL_")}
    return subprocess.run([*args, "config", "--quiet"], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("profiles", [(), ("app",), ("app", "dagster")])
def test_compose_file_is_valid(profiles):
    result = config(ROOT / ".env.example", *profiles)
    assert result.returncode == 0, result.stderr


def test_missing_secret_is_refused(tmp_path):
    env = tmp_path / ".env"
    lines = (ROOT / ".env.example").read_text().splitlines()
    env.write_text("\n".join(l for l in lines if not l.startswith("AWRL_S3_SECRET_KEY=")))
    result = config(env)
    assert result.returncode != 0 and "AWRL_S3_SECRET_KEY" in result.stderr


def test_ports_are_bound_to_loopback_by_default():
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${AWRL_BIND:-127.0.0.1}" in text
