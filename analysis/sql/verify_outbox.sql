-- `awrl ledger verify`: events the producers' outboxes still hold (`pipeline.outbox`: an event leaves
-- its outbox once the ledger's receipts name it), one row each; $outboxes, $event_ids and $run_ids are
-- read from the outbox files, side by side. `in_ledger`: the files hold it, only its confirmation is
-- late; otherwise it is still to be delivered, or lost if its producer never runs again.
WITH pending AS (
    SELECT unnest($outboxes) AS outbox, unnest($event_ids) AS event_id, unnest($run_ids) AS run_id
)
SELECT
    run_id,
    event_id,
    outbox,
    event_id IN (SELECT event_id FROM stored_event_ids) AS in_ledger
FROM pending
WHERE $run_id IS NULL OR run_id = $run_id
ORDER BY run_id, outbox, event_id;
