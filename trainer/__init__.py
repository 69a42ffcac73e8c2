"""trainer: see README for what lives here."""
