-- One row per trajectory: started, finished, or both. This view is the one definition of the table:
-- the Dagster asset `trajectories` is its rows for one run. Choices made once, here:
-- - `outcome` is NULL while the episode runs (no EpisodeFinished yet): SQL's unknown, not a fourth
--   outcome, so `count(outcome)` counts finished episodes and `WHERE outcome = ...` never matches one
--   still running.
-- - `num_steps` is the finisher's count, else the steps recorded so far (`steps_recorded` is always
--   the latter).
-- - `min_policy_version` / `max_policy_version` span the versions that acted in it: each step's
--   `policy_version` (read before its tokens) and every token's version (a refresh can land during a
--   step, so later tokens can be newer). Not EpisodeStarted.policy_version: it is read before the
--   first step's refresh, so it can name a version that produced nothing (success_by_version.sql).
--   NULL for an episode with no step (an env error opening the page).
CREATE OR REPLACE VIEW trajectories AS
WITH step_facts AS (
    SELECT
        run_id,
        trajectory_id,
        count(*)                          AS steps_recorded,
        sum(len(token_policy_versions))   AS response_tokens,
        least(min(policy_version), min(list_min(token_policy_versions)))    AS min_policy_version,
        greatest(max(policy_version), max(list_max(token_policy_versions))) AS max_policy_version,
        count(error_class)                AS step_errors,
        any_value(group_id)               AS group_id,
        any_value(task_id)                AS task_id
    FROM step_recorded
    GROUP BY run_id, trajectory_id
),
ends AS (
    SELECT
        run_id,
        trajectory_id,
        coalesce(s.group_id, f.group_id)  AS group_id,
        coalesce(s.task_id, f.task_id)    AS task_id,
        s.instruction,
        s.worker_id,
        s.horizon,
        s.emitted_at                      AS started_at,
        f.outcome,
        f.reward,
        f.num_steps,
        f.reason,
        f.answer,
        f.emitted_at                      AS finished_at
    FROM episode_started AS s
    FULL JOIN episode_finished AS f USING (run_id, trajectory_id)
)
SELECT
    run_id,
    trajectory_id,
    coalesce(e.group_id, st.group_id)                     AS group_id,
    coalesce(e.task_id, st.task_id)                       AS task_id,
    e.outcome,
    e.reward,
    coalesce(e.num_steps, st.steps_recorded, 0)           AS num_steps,
    coalesce(st.steps_recorded, 0)                        AS steps_recorded,
    coalesce(st.response_tokens, 0)                       AS response_tokens,
    coalesce(st.step_errors, 0)                           AS step_errors,
    st.min_policy_version,
    st.max_policy_version,
    CASE WHEN e.outcome = 'env_error' THEN e.reason END   AS env_error_reason,
    e.reason,
    e.answer,
    e.instruction,
    e.worker_id,
    e.horizon,
    e.started_at,
    e.finished_at
FROM ends AS e
FULL JOIN step_facts AS st USING (run_id, trajectory_id);
