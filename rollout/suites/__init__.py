"""Task suites: our own multi-page sites and MiniWoB++, each implementing `rollout.types.Suite`."""
