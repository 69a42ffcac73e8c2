"""Memory-schema drift metrics of one run (AsyncWebRL, arXiv 2606.05597, "Memory-schema drift").

The paper's diagnosis: with the per-trajectory normaliser 1/|tau| the agent's `memory` object grows
about one generic key per step (`task_1`, `current_step`, ...) instead of fixing task-specific keys at
step 0 and updating their values. These metrics make that visible from the ledger alone:

- `generic_key_ratio`: over the distinct (trajectory, key) pairs of the run (each key a trajectory
  ever used, counted once per trajectory however many steps carried it), the fraction that are
  generic. A key is generic when (a) its normalised spelling (camelCase split, lower-cased, runs of
  other characters -> `_`) fully matches one of `DriftConfig.generic_key_patterns`, or (b) the
  trajectory's instruction is known (EpisodeStarted) and the key shares no content word with it.
  Content words: lower-cased `[a-z0-9]` runs of at least `min_word_len` characters not in
  `stop_words`; a key without any content word shares none.
- `first_last_stable_ratio`: fraction of trajectories with >= 2 recorded steps whose key set at the
  first recorded step equals the key set at the last one.
- `adjacent_unchanged_ratio`: fraction of pairs of consecutive recorded steps (same trajectory, step
  order) with equal key sets.
- `keys_by_step` / `keys_per_step_slope`: mean number of keys at each step index, and the
  least-squares slope of keys against step index over all steps (~1 under 1/|tau| in the paper).
- `mean_response_tokens`: mean response length in tokens over steps that have tokens.
- `success_mean_steps`, `failure_mean_steps`: mean |tau| (EpisodeFinished.num_steps) by outcome;
  `length_downweight` = failure / success mean: how much less each token of an average failure
  weighs than one of a success under 1/|tau| (the paper's 12.5 / 5.1 = 2.4x).
- `offpolicy_gap_mean`, `offpolicy_gap_max`: over every (update, token) with the token in a step of
  a trajectory the update trained: UpdateApplied.version_before - the token's policy version.
  None when the run has no update.
- `clip_rate_mean`, `clip_rate_by_update`: UpdateApplied.stats[clip_stat] per update, and its mean
  over the updates that reported it; None when none did.

Everything is SQL over the ledger views (`analysis/sql/drift_*.sql`), with the config bound as
parameters. The memory column is decoded once into a temp table; the token pass reads the ledger's
per-step token summaries (`step_token_summary`), and decodes token arrays only in files written before
the ledger stored them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import duckdb

from analysis.views import load_sql

GENERIC_KEY_PATTERNS: tuple[str, ...] = (
    r"(task|step|item|page|result|fact|note|entry|field|info|data|memory|subtask|goal|key|value)_?\d+",  # slots
    r"(current|next|last|previous|prev)_(step|page|action|url|task|goal|state|status|position|location)",
    r"(search_)?(query|term|results?)|search",
    r"status|state|progress|plan|notes?|info|summary|history|context|todo|done|remaining|observations?",
    r"next_action|action_history|actions_taken|visited(_pages|_urls)?|url|page",
    r"task|goal|objective|instruction|answer|final_answer|target",
)
"""Keys that carry no task content, in the normalised spelling (`current_step`): numbered slots
(`task_1`, `step3`), cursors (`current_page`, `next_action`), search bookkeeping (`search_query`),
one-word containers (`status`, `progress`, `notes`), navigation logs and the task restated (`goal`)."""

STOP_WORDS: tuple[str, ...] = (
    "a",
    "an",
    "the",
    "of",
    "to",
    "in",
    "on",
    "at",
    "for",
    "from",
    "by",
    "with",
    "about",
    "into",
    "and",
    "or",
    "but",
    "not",
    "no",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "it",
    "its",
    "this",
    "that",
    "these",
    "those",
    "there",
    "here",
    "as",
    "than",
    "then",
    "if",
    "so",
    "do",
    "does",
    "did",
    "has",
    "have",
    "had",
    "i",
    "me",
    "my",
    "you",
    "your",
    "we",
    "our",
    "they",
    "them",
    "their",
    "he",
    "she",
    "his",
    "her",
    "what",
    "which",
    "who",
    "whom",
    "when",
    "where",
    "why",
    "how",
    "all",
    "any",
    "each",
    "some",
    "one",
    "find",
    "search",
    "look",
    "go",
    "get",
    "show",
    "tell",
    "give",
    "please",
    "page",
    "site",
    "website",
)
"""English function words, plus instruction verbs and web words that name no task content."""


@dataclass(frozen=True)
class DriftConfig:
    generic_key_patterns: tuple[str, ...] = GENERIC_KEY_PATTERNS
    """Regexes (full match, on the normalised key) of generic placeholder keys."""
    stop_words: tuple[str, ...] = STOP_WORDS
    """Words that never count as shared content between a key and the instruction."""
    min_word_len: int = 2
    """Shorter tokens (`1`, `x`) are not content words."""
    clip_stat: str = "clip_frac"
    """UpdateApplied.stats key holding the fraction of tokens whose ratio was clipped."""
    token_metrics: bool = True
    """Compute the token metrics (response tokens per step, off-policy gap). From the ledger's token
    summaries they cost little; over files from before the summaries they decode every step's token
    array (on 1M steps of ~240 tokens, about two thirds of the report's time: bench/ledger_scale.py)."""

    @property
    def generic_regex(self) -> str:
        return "(?:" + "|".join(f"(?:{p})" for p in self.generic_key_patterns) + ")"


@dataclass
class DriftReport:
    run_id: str
    steps: int = 0
    trajectories: int = 0
    distinct_keys: int = 0
    """(trajectory, key) pairs the generic ratio is over."""
    generic_key_ratio: float | None = None
    generic_by_pattern: int = 0
    generic_by_overlap_only: int = 0
    first_last_stable_ratio: float | None = None
    multi_step_trajectories: int = 0
    adjacent_unchanged_ratio: float | None = None
    adjacent_pairs: int = 0
    keys_per_step_slope: float | None = None
    keys_by_step: list[dict] = field(default_factory=list)
    mean_response_tokens: float | None = None
    successes: int = 0
    failures: int = 0
    success_mean_steps: float | None = None
    failure_mean_steps: float | None = None
    length_downweight: float | None = None
    updates: int = 0
    trained_tokens: int = 0
    offpolicy_gap_mean: float | None = None
    offpolicy_gap_max: int | None = None
    clip_rate_mean: float | None = None
    clip_rate_by_update: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def drift_metrics(con: duckdb.DuckDBPyConnection, run_id: str, config: DriftConfig = DriftConfig()) -> DriftReport:
    """All metrics of the module docstring for `run_id` over a connection from `analysis.connect`."""
    report = DriftReport(run_id=run_id)
    con.execute(load_sql("drift_step_keys"), {"run_id": run_id})
    try:
        _memory(con, run_id, config, report)
    finally:
        con.execute("DROP TABLE IF EXISTS drift_step_keys")
    _lengths(con, run_id, report)
    _clip(con, run_id, config, report)
    if config.token_metrics:
        _tokens(con, run_id, report)
    return report


def _rows(con: duckdb.DuckDBPyConnection, name: str, params: dict) -> list[dict]:
    cur = con.execute(load_sql(name), params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


def _memory(con, run_id: str, config: DriftConfig, report: DriftReport) -> None:
    s = _rows(con, "drift_stability", {})[0]
    report.steps, report.trajectories = s["steps"], s["trajectories"]
    report.multi_step_trajectories, report.adjacent_pairs = s["multi_step_trajectories"], s["adjacent_pairs"]
    report.first_last_stable_ratio = s["first_last_stable_ratio"]
    report.adjacent_unchanged_ratio = s["adjacent_unchanged_ratio"]
    report.keys_per_step_slope = s["keys_per_step_slope"]
    report.keys_by_step = _rows(con, "drift_keys_by_step", {})
    g = _rows(
        con,
        "drift_generic",
        {
            "run_id": run_id,
            "generic_regex": config.generic_regex,
            "stop_words": list(config.stop_words),
            "min_word_len": config.min_word_len,
        },
    )[0]
    report.distinct_keys = int(g["keys"])
    report.generic_by_pattern = int(g["generic_by_pattern"])
    report.generic_by_overlap_only = int(g["generic_by_overlap_only"])
    report.generic_key_ratio = g["generic"] / g["keys"] if g["keys"] else None


def _lengths(con, run_id: str, report: DriftReport) -> None:
    by = {r["outcome"]: r for r in _rows(con, "drift_lengths", {"run_id": run_id})}
    if "success" in by:
        report.successes, report.success_mean_steps = by["success"]["trajectories"], by["success"]["mean_steps"]
    if "failure" in by:
        report.failures, report.failure_mean_steps = by["failure"]["trajectories"], by["failure"]["mean_steps"]
    if report.success_mean_steps and report.failure_mean_steps is not None:
        report.length_downweight = report.failure_mean_steps / report.success_mean_steps


def _tokens(con, run_id: str, report: DriftReport) -> None:
    t = _rows(con, "drift_tokens", {"run_id": run_id})[0]
    report.mean_response_tokens = t["mean_response_tokens"]
    report.trained_tokens = int(t["trained_tokens"] or 0)
    if report.trained_tokens:
        report.offpolicy_gap_mean = float(t["gap_mean"])
        report.offpolicy_gap_max = int(t["gap_max"])


def _clip(con, run_id: str, config: DriftConfig, report: DriftReport) -> None:
    rows = _rows(con, "drift_clip", {"run_id": run_id, "clip_key": config.clip_stat})
    report.updates = len(rows)
    report.clip_rate_by_update = [r for r in rows if r["clip_rate"] is not None]
    rates = [r["clip_rate"] for r in report.clip_rate_by_update]
    report.clip_rate_mean = sum(rates) / len(rates) if rates else None
