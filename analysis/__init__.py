"""analysis: see README for what lives here."""
