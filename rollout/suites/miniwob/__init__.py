"""MiniWoB++ suite: the `miniwob` package's tasks served locally, judged by the page's reward."""

from rollout.suites.miniwob.oracle import ORACLE_TASKS, oracle_plan_step
from rollout.suites.miniwob.suite import MiniWobSuite

__all__ = ["ORACLE_TASKS", "MiniWobSuite", "oracle_plan_step"]
