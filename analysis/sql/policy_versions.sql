-- One row per published checkpoint, with its lineage (parent version, the updates that made it) and
-- the seconds since the previous one of the same run (a number, not an INTERVAL: Parquet has no
-- interval type, and the Dagster asset `policy_versions`, this view's rows for one run, is Parquet).
CREATE OR REPLACE VIEW policy_versions AS
SELECT
    run_id,
    version,
    update_step,
    parent_version,
    update_ids,
    checkpoint_uri,
    checkpoint_sha256,
    publish_s,
    emitted_at AS published_at,
    epoch(emitted_at - lag(emitted_at) OVER (PARTITION BY run_id ORDER BY version)) AS seconds_since_previous,
    event_id
FROM policy_version_published;
