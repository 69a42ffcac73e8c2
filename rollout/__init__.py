"""rollout: see README for what lives here."""
