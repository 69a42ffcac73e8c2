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
