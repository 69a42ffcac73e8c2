-- Every event id the ledger's files hold more than once, with how many copies, computed once when the
-- connection opens. The raw views read each of these ids once (`analysis.views`: only the types
-- listed here pay for it); `awrl ledger verify` and the Dagster checks report them (`verify_duplicates.sql`).
-- A copy comes from a writer that lost its partition mid-batch, a late resend the writer no longer
-- remembered, or two compaction passes that both committed.
CREATE OR REPLACE TEMP TABLE duplicate_events AS
SELECT run_id, event_type, event_id, count(*) AS copies
FROM stored_event_ids
GROUP BY ALL
HAVING count(*) > 1;
