-- Success on the run's own (training) tasks against policy version: per run and version, the finished
-- trajectories, their successes and the success rate with its 95% Wilson interval. The training half of
-- the learning curve; `evaluations` is the held-out half. An evaluation run (`<run>-eval-<stage>`) is a
-- run of its own and gets rows of its own.
--
-- A trajectory belongs to the oldest version that acted in it: its steps' `min_policy_version` (the
-- `trajectories` view; a step's version is read before its tokens, so this is also its oldest token's).
-- EpisodeStarted.policy_version is read before the first step's weight refresh, so a version published
-- in between drove the whole episode while the start event still names its predecessor. Later refreshes
-- only make later steps newer, and the trainer's staleness bound is on the oldest token too. A trajectory
-- that ended before its first step (an env error opening the page) falls back to the start version; one
-- with neither (its start event lost) is left out, as are running ones.
--
-- env_error counts as finished and not successful, as in report_success_over_time.sql and in
-- `evaluations` (an evaluation's episodes include its env errors), so the two halves of the curve share
-- one denominator; `env_errors` says how many of the failures were the environment's.
CREATE OR REPLACE VIEW success_by_version AS
WITH finished AS (
    SELECT
        t.run_id,
        coalesce(t.min_policy_version, s.policy_version) AS policy_version,
        t.outcome
    FROM trajectories AS t
    LEFT JOIN episode_started AS s USING (run_id, trajectory_id)
    WHERE t.outcome IS NOT NULL
),
counts AS (
    SELECT
        run_id,
        policy_version,
        count(*)                                  AS trajectories,
        count(*) FILTER (outcome = 'success')     AS successes,
        count(*) FILTER (outcome = 'env_error')   AS env_errors
    FROM finished
    WHERE policy_version IS NOT NULL
    GROUP BY run_id, policy_version
)
SELECT
    run_id,
    policy_version,
    trajectories,
    successes,
    env_errors,
    successes / trajectories                      AS success_rate,
    awrl_wilson(successes, trajectories).low      AS ci95_low,
    awrl_wilson(successes, trajectories).high     AS ci95_high
FROM counts;
