-- Learning curves: each evaluated policy's success rate with its Wilson 95% interval, in run order.
CREATE OR REPLACE VIEW evaluations AS
SELECT
    run_id,
    stage,
    policy_version,
    successes::DOUBLE / greatest(episodes, 1) AS success_rate,
    ci95_low,
    ci95_high,
    episodes,
    successes,
    suite,
    split,
    difficulty,
    train_s,
    eval_run_id,
    checkpoint_sha256,
    emitted_at AS evaluated_at,
    event_id
FROM evaluation_completed;
