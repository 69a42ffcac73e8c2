-- Drift pass 1: each step's key count and key-set fingerprint, for one run, as a temp table (the
-- stability queries read it several times). The fingerprint is the XOR of the 64-bit hashes of the
-- keys: order-free, so no sort of 1M lists of strings (2-3x the cost), and two different key sets
-- collide with odds ~2^-64 per comparison. An empty memory gets 0.
CREATE OR REPLACE TEMP TABLE drift_step_keys AS
SELECT
    trajectory_id,
    step,
    cardinality(memory)                                                                       AS num_keys,
    coalesce(list_aggregate(list_transform(map_keys(memory), lambda k: hash(k)), 'bit_xor'), 0) AS keyset
FROM step_recorded
WHERE run_id = $run_id;
