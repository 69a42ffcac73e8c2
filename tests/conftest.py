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


WARM_MODULES = ("test_learning", "test_vllm_live", "test_readme")
"""The modules that use `boxes_warm_start`: one xdist worker builds it and runs them, first (the
learning test is the suite's long pole)."""


LONG_MODULES = ("test_compose_live",)
"""Next, on the other worker: the compose stack (images, demo, app and dagster profiles), the second
longest pole; what is left fills in behind the two."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The warm start's users first, then the long modules; and a module that starts using the warm start
    must join them."""
    users = {item.module.__name__ for item in items if "boxes_warm_start" in item.fixturenames}
    assert users <= set(WARM_MODULES), f"add {sorted(users - set(WARM_MODULES))} to WARM_MODULES (tests/conftest.py)"
    items.sort(key=lambda item: (item.module.__name__ not in WARM_MODULES, item.module.__name__ not in LONG_MODULES))


@pytest.hookimpl(optionalhook=True)  # known only where xdist is loaded
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs on two xdist workers. Whole modules go to one worker (their module fixtures, a
    recorded run several tests read, are built once), and the warm start's modules go together."""
    from xdist.scheduler import LoadScopeScheduling

    class Modules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "warm start" if Path(module).stem in WARM_MODULES else module

    return Modules(config, log)


_FAULT_ROWS: list = []
"""The fault matrix's rows as reported (on xdist's controller, from the workers' reports)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A fault test's accounting rows travel with its report, so the controller can print them."""
    from dataclasses import asdict

    from faults import TABLE

    report = yield
    while TABLE:
        report.user_properties.append(("fault_row", asdict(TABLE.pop(0))))
    return report


def pytest_runtest_logreport(report):
    from faults import Accounting

    _FAULT_ROWS.extend(Accounting(**v) for k, v in report.user_properties if k == "fault_row")


def pytest_terminal_summary(terminalreporter):
    """The fault matrix's accounting table, when fault tests ran."""
    from faults import markdown

    if _FAULT_ROWS:
        terminalreporter.write_sep("=", "fault matrix: events produced vs rows in the ledger")
        terminalreporter.write_line(markdown(_FAULT_ROWS))
        if path := os.environ.get("AWRL_FAULT_TABLE"):  # bench/faults.sh keeps it
            Path(path).write_text(markdown(_FAULT_ROWS) + "\n")
