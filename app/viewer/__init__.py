"""`awrl view`: a local web application over the ledger and the screenshot store.

    awrl view                      # http://127.0.0.1:8765, the ledger and store of AWRL_* settings
    awrl view --port 9000 --ledger /path/to/ledger

Pages: the runs; a run (curves by policy version, its trajectories filterable by outcome, its groups,
its updates); a trajectory (each step's screenshot, fetched by hash and verified, with or without the
Set-of-Mark boxes and the click drawn, the thought, action, feedback and memory with the keys added and
dropped); a group side by side; an update with its trajectories and the replay result if one was run.
The queries are `analysis.browse`'s; nothing here computes a number the ledger's views do not.
"""

from app.viewer.server import ViewerConfig, make_app, serve

__all__ = ["ViewerConfig", "make_app", "serve"]
