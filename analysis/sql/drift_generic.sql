-- Generic-placeholder keys among the distinct (trajectory, key) pairs of a run. A key is generic when
-- its normalised spelling fully matches $generic_regex, or when the trajectory's instruction is known
-- and the key shares no content word with it. Classification runs once per distinct
-- (instruction, key), which is far fewer than the pairs.
WITH pairs AS (
    SELECT DISTINCT trajectory_id, unnest(map_keys(memory)) AS key
    FROM step_recorded
    WHERE run_id = $run_id
),
instructions AS (
    SELECT trajectory_id, any_value(instruction) AS instruction
    FROM episode_started
    WHERE run_id = $run_id
    GROUP BY trajectory_id
),
kinds AS (
    SELECT key, instruction, count(*) AS n
    FROM pairs LEFT JOIN instructions USING (trajectory_id)
    GROUP BY ALL
),
classified AS (
    SELECT
        n,
        regexp_full_match(awrl_key_norm(key), $generic_regex) AS by_pattern,
        instruction IS NOT NULL AND NOT list_has_any(
            awrl_words(key, $stop_words, $min_word_len),
            awrl_words(instruction, $stop_words, $min_word_len)) AS by_overlap
    FROM kinds
)
SELECT
    coalesce(sum(n), 0)                                             AS keys,
    coalesce(sum(n) FILTER (WHERE by_pattern OR by_overlap), 0)     AS generic,
    coalesce(sum(n) FILTER (WHERE by_pattern), 0)                   AS generic_by_pattern,
    coalesce(sum(n) FILTER (WHERE by_overlap AND NOT by_pattern), 0) AS generic_by_overlap_only
FROM classified;
