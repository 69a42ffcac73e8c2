-- `awrl ledger verify` and the Dagster checks: event ids the ledger's files hold more than once
-- (`duplicate_events`), one row per id. The views read each once; a copy still means a writer or a
-- compaction pass broke exactly-once. $run_id NULL: every run.
SELECT run_id, event_type, event_id, copies
FROM duplicate_events
WHERE $run_id IS NULL OR run_id = $run_id
ORDER BY run_id, event_type, event_id;
