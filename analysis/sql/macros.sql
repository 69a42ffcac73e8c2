-- Helpers the drift queries share; also usable from `awrl sql`.

-- Content words of a text: lower-cased runs of [a-z0-9] (camelCase split first), at least `min_len`
-- characters, not in `stop`. "Find the blue-kettle price" -> [blue, kettle, price].
CREATE OR REPLACE MACRO awrl_words(s, stop, min_len) AS
    list_filter(
        string_split_regex(lower(regexp_replace(s, '([a-z0-9])([A-Z])', '\1_\2', 'g')), '[^a-z0-9]+'),
        lambda w: len(w) >= min_len AND NOT list_contains(stop, w));

-- A memory key in the one spelling the placeholder patterns are written against:
-- "currentStep", "Current step", "current-step" -> current_step.
CREATE OR REPLACE MACRO awrl_key_norm(k) AS
    trim(regexp_replace(lower(regexp_replace(k, '([a-z0-9])([A-Z])', '\1_\2', 'g')), '[^a-z0-9]+', '_', 'g'), '_');

-- Wilson score interval of `k` successes in `n` trials, {low, high} (z = 1.96: 95%): the SQL twin of
-- rollout.evaluate.wilson_interval (a test checks they agree). Unlike p +- z*se it stays inside
-- [0, 1] and is not zero-width at 0/n or n/n, where training success starts and may end; n = 0 says
-- nothing: (0, 1).
CREATE OR REPLACE MACRO awrl_wilson_bound(k, n, z, sign) AS
    greatest(0.0, least(1.0, (k / n + z * z / (2 * n)) / (1 + z * z / n)
                             + sign * z * sqrt(k / n * (1 - k / n) / n + z * z / (4 * n * n)) / (1 + z * z / n)));
CREATE OR REPLACE MACRO awrl_wilson(k, n, z := 1.96) AS
    CASE WHEN n = 0 THEN {'low': 0.0, 'high': 1.0}
         ELSE {'low': awrl_wilson_bound(k, n, z, -1), 'high': awrl_wilson_bound(k, n, z, 1)} END;

-- A task's template from its id, for tables that group by it: the suite's prefix and the seed dropped.
-- "sites.shop.add_item.00" -> shop.add_item; "miniwob.click-test.0" -> click-test; "boxes-pick-3" -> boxes-pick.
CREATE OR REPLACE MACRO awrl_task_template(task_id) AS
    regexp_replace(regexp_replace(task_id, '[.-][0-9]+$', ''), '^(sites|miniwob)\.', '');
