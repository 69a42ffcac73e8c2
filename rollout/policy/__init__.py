"""Policy backends behind one contract (`rollout.types.Policy`)."""
