"""Shared fixtures: one real local stack (Tansu + Ceph radosgw) per test session, stopped by PID."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from pipeline.settings import StackSettings
from pipeline.stack.local import LocalStack


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> LocalStack:
    s = LocalStack.up(tmp_path_factory.mktemp("stack"), durable=False)
    yield s
    s.down()


@pytest.fixture()
def settings(stack: LocalStack) -> StackSettings:
    """Settings with a topic prefix and a bucket of its own (`isolation.own_settings`), so each test
    sees only its own messages and objects, and leaves no object behind."""
    from isolation import own_settings

    with own_settings(stack) as s:
        yield s


@pytest.fixture(scope="module")
def module_settings(stack: LocalStack) -> StackSettings:
    """As `settings`, for a module's shared fixtures (a recorded run several tests read)."""
    from isolation import own_settings

    with own_settings(stack) as s:
        yield s


@pytest.fixture(scope="session")
def boxes_warm_start(stack, tmp_path_factory) -> Path:
    """The controlled task's warm start, built once: SFT on oracle demonstrations of "click any box"
    (`app.learning.controlled`). tests/test_learning.py learns from it; tests/test_vllm_live.py serves
    it, so that groups have mixed rewards and its trainer has something to update on."""
    from app.learning import controlled_warm_start
    from pipeline.bus import create_topics

    settings = stack.settings().model_copy(update={"topic_prefix": f"t{uuid.uuid4().hex[:8]}"})
    create_topics(settings)
    run_id = f"warm-{uuid.uuid4().hex[:6]}"
    return controlled_warm_start(settings, tmp_path_factory.mktemp("warm-start"), run_id)


@pytest.fixture(scope="module")
def sites():
    """Our multi-page sites, served for one test module."""
    from rollout.suites.sites import SitesSuite

    suite = SitesSuite()
    suite.start()
    yield suite
    suite.stop()


def pytest_terminal_summary(terminalreporter):
    """The fault matrix's accounting table, when fault tests ran."""
    from faults import TABLE, markdown

    if TABLE:
        terminalreporter.write_sep("=", "fault matrix: events produced vs rows in the ledger")
        terminalreporter.write_line(markdown(TABLE))
        if path := os.environ.get("AWRL_FAULT_TABLE"):  # bench/faults.sh keeps it
            Path(path).write_text(markdown(TABLE) + "\n")
