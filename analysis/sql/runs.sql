-- One row per run in the ledger: when it started, what started it, its suite, the versions it
-- published, its episodes and their success. A run is any run_id with events of its own (a training
-- run, its demonstrations `<run>-demos`, its evaluations `<run>-eval-<stage>`, a plain rollout).
-- `command` and `config_json` come from the run's first `RunStarted` (what `awrl runs show` prints);
-- runs recorded before that event existed, and plain rollouts, have none.
CREATE OR REPLACE VIEW runs AS
WITH seen AS (
    SELECT run_id, emitted_at FROM run_started
    UNION ALL SELECT run_id, emitted_at FROM task_group_dispatched
    UNION ALL SELECT run_id, emitted_at FROM episode_started
    UNION ALL SELECT run_id, emitted_at FROM episode_finished
    UNION ALL SELECT run_id, emitted_at FROM update_applied
    UNION ALL SELECT run_id, emitted_at FROM policy_version_published
    UNION ALL SELECT run_id, emitted_at FROM evaluation_completed
),
spans AS (
    SELECT run_id, min(emitted_at) AS started_at, max(emitted_at) AS last_event_at FROM seen GROUP BY run_id
),
starts AS (
    SELECT run_id, arg_min(command, emitted_at) AS command, arg_min(config_json, emitted_at) AS config_json
    FROM run_started GROUP BY run_id
),
suites AS (
    SELECT run_id, string_agg(DISTINCT suite, ',' ORDER BY suite) AS suite FROM task_group_dispatched GROUP BY run_id
),
versions AS (
    SELECT run_id, max(version) AS versions FROM policy_version_published GROUP BY run_id
),
episodes AS (
    SELECT run_id, count(*) AS episodes, avg((outcome = 'success')::INT) AS success
    FROM episode_finished GROUP BY run_id
)
SELECT
    run_id,
    started_at,
    last_event_at,
    command,
    coalesce(suites.suite, json_extract_string(config_json, '$.suite'),
             json_extract_string(config_json, '$.rollout.suite')) AS suite,
    coalesce(versions.versions, 0)   AS versions,
    coalesce(episodes.episodes, 0)   AS episodes,
    episodes.success,
    config_json
FROM spans
LEFT JOIN starts USING (run_id)
LEFT JOIN suites USING (run_id)
LEFT JOIN versions USING (run_id)
LEFT JOIN episodes USING (run_id)
ORDER BY started_at;
