-- Per step: its response tokens and the min / max / sum of their policy versions. Files the ledger
-- wrote with token summaries (`pipeline/summaries.py`) give four integers a step; older files decode
-- `token_policy_versions` instead (same values; the drift's token pass is ~10x slower on them).
CREATE OR REPLACE VIEW step_token_summary AS
SELECT run_id, trajectory_id, step, response_tokens, token_version_min, token_version_max, token_version_sum
FROM step_recorded_summarized
UNION ALL
SELECT run_id, trajectory_id, step, len(token_policy_versions), list_min(token_policy_versions),
       list_max(token_policy_versions), list_sum(token_policy_versions)
FROM step_recorded_unsummarized;
