"""`awrl stack up | status | down` as a user runs it, and its fail-fast paths."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.stack.local import LocalStack
from pipeline.stack.process import ServiceProc, StackError, pid_alive, require_binary

AWRL = [sys.executable, "-m", "app.cli"]


def our_processes(data_dir: Path) -> list[int]:
    """PIDs whose command line or cwd mentions the stack's data dir."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(f"/proc/{pid}/cwd")
            zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if not zombie and (str(data_dir) in cmd or cwd.startswith(str(data_dir))):
            pids.append(int(pid))
    return pids


def test_up_status_down_leaves_nothing_running(tmp_path):
    data = tmp_path / "stack"
    env = {**os.environ, "AWRL_DATA_DIR": str(data)}
    up = subprocess.run(
        [*AWRL, "stack", "up", "--ephemeral", "--dotenv", str(tmp_path / ".env")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((data / "stack.json").read_text())
        assert {s["name"] for s in state["services"]} >= {"kafka", "s3"}
        dotenv = (tmp_path / ".env").read_text()
        assert "AWRL_S3_SECRET_KEY=" in dotenv and oct((tmp_path / ".env").stat().st_mode)[-3:] == "600"
        status = subprocess.run([*AWRL, "stack", "status"], env=env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout
        for s in state["services"]:
            assert str(s["pid"]) in status.stdout
    finally:
        down = subprocess.run([*AWRL, "stack", "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(pid_alive(ServiceProc(**s)) for s in state["services"])
    assert our_processes(data) == []


def test_taken_port_fails_fast_with_a_clear_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StackError, match=f"127.0.0.1:{port} is already taken"):
            LocalStack.up(tmp_path, durable=False, kafka_port=port)
    assert our_processes(tmp_path) == []


def test_missing_binary_is_named():
    with pytest.raises(StackError, match="/nonexistent/radosgw.*apt-get install radosgw"):
        require_binary("/nonexistent/radosgw", "apt-get install radosgw ceph-mon ceph-osd")


def test_the_policy_server_fails_fast_and_clearly(tmp_path):
    from pipeline.stack.vllm import VLLMServerConfig, start_vllm

    missing = VLLMServerConfig(model_dir=tmp_path, python=tmp_path / "no-venv" / "python")
    with pytest.raises(StackError, match=r"no-venv/python.*make vllm-env"):
        start_vllm(tmp_path, missing)
    no_model = VLLMServerConfig(model_dir=tmp_path / "empty", python=Path(sys.executable))
    with pytest.raises(StackError, match=r"empty is not an HF model directory"):
        start_vllm(tmp_path, no_model)
