"""assets: see README for what lives here."""
