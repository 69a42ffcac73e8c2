-- Key-set stability. A trajectory with one recorded step is left out of the first-last ratio (it is
-- trivially stable). Adjacent pairs are consecutive recorded steps in step order.
WITH ends AS (
    SELECT arg_min(keyset, step) = arg_max(keyset, step) AS stable, count(*) AS n
    FROM drift_step_keys
    GROUP BY trajectory_id
),
adjacent AS (
    SELECT keyset = lag(keyset) OVER (PARTITION BY trajectory_id ORDER BY step) AS unchanged
    FROM drift_step_keys
)
SELECT
    (SELECT count(*) FROM drift_step_keys)                  AS steps,
    (SELECT count(*) FROM ends)                             AS trajectories,
    (SELECT count(*) FROM ends WHERE n >= 2)                AS multi_step_trajectories,
    (SELECT avg(stable::INT) FROM ends WHERE n >= 2)        AS first_last_stable_ratio,
    (SELECT count(unchanged) FROM adjacent)                 AS adjacent_pairs,
    (SELECT avg(unchanged::INT) FROM adjacent)              AS adjacent_unchanged_ratio,
    (SELECT regr_slope(num_keys, step) FROM drift_step_keys) AS keys_per_step_slope;
