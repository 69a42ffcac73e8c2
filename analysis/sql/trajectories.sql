-- One row per trajectory: started, finished, or both (a running episode has no outcome yet).
-- `num_steps` is the finisher's count, else the steps recorded so far; policy versions are those
-- loaded at each step (StepRecorded.policy_version).
CREATE OR REPLACE VIEW trajectories AS
WITH step_facts AS (
    SELECT
        run_id,
        trajectory_id,
        count(*)                          AS steps_recorded,
        sum(len(token_policy_versions))   AS response_tokens,
        min(policy_version)               AS min_policy_version,
        max(policy_version)               AS max_policy_version,
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
