-- Token pass: mean response tokens per step, and the off-policy gap of every trained token:
-- gap = version_before of the update that trained it - token_policy_versions[j] of the token.
-- A trajectory in several updates counts once per update. Steps without tokens (scripted
-- policies) add nothing. Per-step summaries (`step_token_summary`), so no token array is decoded.
WITH per_step AS MATERIALIZED (
    SELECT
        trajectory_id,
        response_tokens                 AS n,
        token_version_sum               AS version_sum,
        token_version_min               AS version_min
    FROM step_token_summary
    WHERE run_id = $run_id
),
trained AS (
    SELECT version_before, unnest(trajectory_ids) AS trajectory_id
    FROM update_applied
    WHERE run_id = $run_id
),
gaps AS (
    SELECT
        sum(p.n)                                        AS trained_tokens,
        sum(t.version_before * p.n - p.version_sum)     AS gap_sum,
        max(t.version_before - p.version_min)           AS gap_max
    FROM trained AS t JOIN per_step AS p USING (trajectory_id)
    WHERE p.n > 0
)
SELECT
    (SELECT avg(n) FROM per_step WHERE n > 0)           AS mean_response_tokens,
    trained_tokens,
    gap_sum / nullif(trained_tokens, 0)                 AS gap_mean,
    gap_max
FROM gaps;
