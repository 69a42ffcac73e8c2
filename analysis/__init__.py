"""DuckDB analysis over the ledger, drift metrics and replay (ledger and replay issues)."""
