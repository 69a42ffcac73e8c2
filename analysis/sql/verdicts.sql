-- Every judge's verdict on every trajectory (TrajectoryJudged), with the trajectory's task family and
-- the policy versions that acted in it. A run whose reward comes from a model judge has two rows a
-- trajectory: the model's (`gives_reward`) and the rule's, recorded beside it for agreement.
-- `success` is NULL where the judge gave no verdict (`error` says why: the episode ended judge_error).
CREATE OR REPLACE VIEW verdicts AS
SELECT
    v.run_id,
    v.trajectory_id,
    v.group_id,
    v.task_id,
    awrl_task_template(v.task_id) AS task_family,
    v.judge,
    v.judge_version,
    v.model,
    v.prompt_sha256,
    v.gives_reward,
    v.success,
    v.reason,
    v.error,
    v.attempts,
    v.latency_s,
    v.prompt_tokens,
    v.completion_tokens,
    v.response_text,
    t.max_policy_version AS policy_version,
    v.emitted_at AS judged_at,
    v.event_id
FROM trajectory_judged v
LEFT JOIN trajectories t USING (run_id, trajectory_id);

-- How well judge `a` agrees with judge `b` (the reference, e.g. 'rule'), per task family, over the
-- trajectories both gave a verdict on: confusion counts, accuracy, precision, recall and F1 of `a`.
--   SELECT * FROM awrl_judge_agreement('model', 'rule');
CREATE OR REPLACE MACRO awrl_judge_agreement(a, b) AS TABLE
WITH pairs AS (
    SELECT x.task_family, x.success AS said, y.success AS truth
    FROM verdicts x JOIN verdicts y USING (run_id, trajectory_id)
    WHERE x.judge = a AND y.judge = b AND x.success IS NOT NULL AND y.success IS NOT NULL
),
counts AS (
    SELECT
        task_family,
        count(*)                                  AS trajectories,
        count(*) FILTER (WHERE said AND truth)    AS true_positives,
        count(*) FILTER (WHERE said AND NOT truth) AS false_positives,
        count(*) FILTER (WHERE NOT said AND truth) AS false_negatives,
        count(*) FILTER (WHERE NOT said AND NOT truth) AS true_negatives
    FROM pairs GROUP BY ROLLUP (task_family)
)
SELECT
    coalesce(task_family, '(all)') AS task_family,
    trajectories, true_positives, false_positives, false_negatives, true_negatives,
    (true_positives + true_negatives) / nullif(trajectories, 0)           AS accuracy,
    true_positives / nullif(true_positives + false_positives, 0)          AS "precision",
    true_positives / nullif(true_positives + false_negatives, 0)          AS recall,
    2 * true_positives / nullif(2 * true_positives + false_positives + false_negatives, 0) AS f1
FROM counts ORDER BY task_family IS NULL, task_family;

-- The reward-hacking watch: by policy version, the share of trajectories the reward-giving judge
-- called a success while `reference` (e.g. 'rule') called it a failure. A share that grows with the
-- versions is a policy learning what the judge accepts rather than the task.
--   SELECT * FROM awrl_reward_hacking('rule');
CREATE OR REPLACE MACRO awrl_reward_hacking(reference) AS TABLE
SELECT
    x.run_id,
    x.policy_version,
    count(*) AS trajectories,
    avg((x.success AND NOT y.success)::INT) AS hacked_share,
    avg(x.success::INT) AS reward_success,
    avg(y.success::INT) AS reference_success
FROM verdicts x JOIN verdicts y USING (run_id, trajectory_id)
WHERE x.gives_reward AND y.judge = reference AND x.success IS NOT NULL AND y.success IS NOT NULL
GROUP BY x.run_id, x.policy_version ORDER BY x.run_id, x.policy_version;
