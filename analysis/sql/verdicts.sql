-- Every judge's verdict on every trajectory. A trajectory the rule judge rewarded has its verdict in
-- EpisodeFinished (success or failure; not the environment's errors); a model judge's run records the
-- model's verdict (`gives_reward`) and the rule's beside it as TrajectoryJudged, and `awrl rejudge`
-- adds verdicts of another judge to a recorded run the same way (giving no reward).
-- `success` is NULL where a judge gave no verdict (`error` says why: the episode ended judge_error).
CREATE OR REPLACE VIEW verdicts AS
WITH judged AS (
    SELECT run_id, trajectory_id, group_id, task_id, judge, judge_version, model, prompt_sha256, gives_reward,
           success, reason, error, attempts, latency_s, prompt_tokens, completion_tokens, response_text,
           emitted_at, event_id
    FROM trajectory_judged
),
by_rule AS (
    SELECT f.run_id, f.trajectory_id, f.group_id, f.task_id, 'rule' AS judge, 'rule' AS judge_version, '' AS model,
           '' AS prompt_sha256, true AS gives_reward, f.outcome = 'success' AS success, f.reason,
           NULL::VARCHAR AS error, 1::BIGINT AS attempts, 0.0::DOUBLE AS latency_s, NULL::BIGINT AS prompt_tokens,
           NULL::BIGINT AS completion_tokens, '' AS response_text, f.emitted_at, f.event_id
    FROM episode_finished f
    WHERE f.outcome IN ('success', 'failure')
      AND NOT EXISTS (SELECT 1 FROM judged j WHERE j.run_id = f.run_id AND j.trajectory_id = f.trajectory_id
                                                AND (j.gives_reward OR j.judge = 'rule'))
)
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
FROM (SELECT * FROM judged UNION ALL BY NAME SELECT * FROM by_rule) v
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
WHERE x.gives_reward AND x.judge <> reference AND y.judge = reference
  AND x.success IS NOT NULL AND y.success IS NOT NULL
GROUP BY x.run_id, x.policy_version ORDER BY x.run_id, x.policy_version;
