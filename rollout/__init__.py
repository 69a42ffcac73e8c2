"""Rollout: the everlasting browser pool, task suites and policy backends (built in the rollout issue)."""
