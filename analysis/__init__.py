"""DuckDB analysis over the Parquet ledger: views, memory-drift metrics and run reports.

    from analysis import connect, drift_metrics
    con = connect("s3://awrl/ledger")                 # or a directory, or a StackSettings
    con.sql("SELECT outcome, avg(num_steps) FROM trajectories GROUP BY ALL").show()
    drift_metrics(con, "run-7").to_dict()

The SQL lives in `analysis/sql/*.sql`; the CLI verbs (`awrl sql | drift | report`) in `app.analysis_cli`.
"""

from analysis.drift import DriftConfig, DriftReport, drift_metrics
from analysis.views import RAW_VIEWS, VIEWS, connect


def write_report(con, run_id, out_dir, config: DriftConfig = DriftConfig()):
    """`analysis.report.write_report`, imported on first use (matplotlib takes a second to load)."""
    from analysis.report import write_report as write

    return write(con, run_id, out_dir, config)


__all__ = ["DriftConfig", "DriftReport", "RAW_VIEWS", "VIEWS", "connect", "drift_metrics", "write_report"]
