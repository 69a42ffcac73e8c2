"""How well the model judge agrees with the rule judge, per run (the `verdicts` view's
`awrl_judge_agreement`): a table per task family, and a check that warns when agreement is low.

No `from __future__ import annotations` here: Dagster reads the context and resource annotations
at definition time and rejects them as strings.
"""

import dagster as dg
import pyarrow as pa

from analysis.views import connect
from assets.io import Ledger
from assets.partitions import runs
from assets.tables import VIEW_KINDS, output

AGREEMENT_FLOOR = 0.85
"""Accuracy of the model judge against the rule below which the check warns. OpenWebRL's distilled 8B
judge agreed with GPT-4.1's labels 89.8% of the time and trained as well; a weaker judge was
reward-hacked, so agreement well below that is worth a look before trusting the run's rewards."""


@dg.asset(partitions_def=runs, group_name="analysis", kinds=VIEW_KINDS, deps=["trajectory_judged", "episode_finished"])
def judge_agreement(context: dg.AssetExecutionContext, ledger: Ledger) -> dg.Output[pa.Table]:
    """The model judge against the rule judge on the run's trajectories, per task family and `(all)`:
    confusion counts, accuracy, precision, recall, F1. Empty for a run no model judged (`awrl rejudge`
    judges a recorded run)."""
    with connect(ledger.settings(), run_id=context.partition_key) as con:
        table = con.sql("select * from awrl_judge_agreement('model', 'rule') where trajectories > 0").to_arrow_table()
    return output(table)


@dg.asset_check(asset=judge_agreement)
def judge_agrees_with_the_rule(judge_agreement: pa.Table) -> dg.AssetCheckResult:
    rows = judge_agreement.to_pylist()
    overall = next((r for r in rows if r["task_family"] == "(all)"), None)
    if overall is None:
        return dg.AssetCheckResult(passed=True, description="no trajectory judged by a model")
    return dg.AssetCheckResult(
        passed=overall["accuracy"] >= AGREEMENT_FLOOR,
        severity=dg.AssetCheckSeverity.WARN,
        description=f"model judge vs rule: accuracy {overall['accuracy']:.3f} over {overall['trajectories']} "
        f"trajectories (warns below {AGREEMENT_FLOOR})",
        metadata={"accuracy": overall["accuracy"], "f1": overall["f1"], "trajectories": overall["trajectories"]},
    )
