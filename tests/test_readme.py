"""The README, walked as a new user walks it: every command block marked `<!-- walk -->` runs literally,
in the README's order, in one bash shell (so `RUN=...` carries over), in a fresh directory, on a fresh
embedded stack that `make demo` starts and the README's last block stops.

The one thing given from outside is the demo's budget, through `DEMO_ARGS` (which the README documents
and the Makefile reads): the controlled boxes task from the session's shared warm start (the
`boxes_warm_start` fixture, also used by test_learning.py and test_vllm_live.py), 8 optimizer steps of RL and
small evaluations, so that the walk costs about 3 minutes yet trains real versions that replay can
check bit for bit. `make demo` itself, the CLI verbs and their output formats are what the README says.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.stack.local import LocalStack

REPO = Path(__file__).resolve().parents[1]
WALK = re.compile(r"<!-- walk -->\n```bash\n(.*?)```", re.DOTALL)


def walked_blocks() -> list[str]:
    return WALK.findall((REPO / "README.md").read_text())


def test_the_walk_is_the_users_story():
    blocks = walked_blocks()
    firsts = [b.split()[0] for b in blocks]
    assert blocks[0].strip() == "make demo" and blocks[-1].strip() == ".venv/bin/awrl stack down", firsts
    text = "\n".join(blocks)
    for verb in ("awrl runs", "awrl export", "awrl drift", "awrl sql", "awrl replay", "awrl runs show"):
        assert verb in text, verb


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_readme_walk(boxes_warm_start, tmp_path):
    for name in (".venv", "Makefile", "pyproject.toml", "constraints"):
        (tmp_path / name).symlink_to(REPO / name)  # a checkout whose `make setup` is already done
    blocks = walked_blocks()
    script = "set -euo pipefail\n" + "".join(f"echo '>>> block {i}'\n{b}" for i, b in enumerate(blocks))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWRL_") and k != "DEMO_ARGS"}
    env["DEMO_ARGS"] = (
        f"--config controlled --warm-start {boxes_warm_start} --rl-updates 8 --rl-minutes 15 "
        "--eval-episodes 8 --rl-eval-points 1"
    )
    try:
        out = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1100
        )
    finally:
        stack = LocalStack.load(tmp_path / ".awrl" / "stack")
        if stack is not None:  # the walk failed before its last block
            stack.down()
    print(out.stdout[-6000:])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    parts = re.split(r">>> block \d+\n", out.stdout)[1:]
    assert len(parts) == len(blocks)
    demo, runs, exports, drift, queries, replay, show, down = parts
    for row in (
        "success after sft",
        "success after rl",
        "events in ledger",
        "dagster assets materialized",
        "dagster checks passed",
    ):
        assert row in demo, row
    assert "failed:" not in demo, demo  # every asset check green on the demo's own run
    assert "see it: awrl view, then http://127.0.0.1:8765/runs/" in demo  # the viewer's page of the run
    assert "demo" in runs and "boxes" in runs and "see them: awrl view" in runs
    assert "points to runs-tb" in exports and list((tmp_path / "runs-tb").glob("*/events.out.tfevents.*"))
    assert re.search(r"wrote \d+ steps in \d+ file", exports)
    assert list((tmp_path / "datasets").glob("*/steps-*.parquet"))
    assert "generic key ratio" in drift and "keys per step slope" in drift
    for column in ("mean_keys", "trajectories", "keys_added", "values_changed"):
        assert column in queries, column
    assert "exact" in replay and "NO" not in replay, replay
    config = yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert config["suite"] == "boxes" and config["run_id"] == "" and config["train"]["groups_per_update"] == 4
    assert "stopped" in down
    assert (tmp_path / ".env").exists() and list((tmp_path / ".awrl" / "learning").glob("*/curve.png"))
