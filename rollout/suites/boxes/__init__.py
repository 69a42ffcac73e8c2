"""Boxes: a synthetic visual task with a known optimum (no browser), for controlled learning tests."""

from rollout.suites.boxes.suite import BoxesSuite, layout, make_task

__all__ = ["BoxesSuite", "layout", "make_task"]
