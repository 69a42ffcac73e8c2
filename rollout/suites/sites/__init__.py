"""Our own multi-page sites (shop, wiki, forms) on 127.0.0.1, with generated tasks and rule judges.

Modules: `world` (seeded content), `web` (sessions, layout), `shop` / `wiki` / `forms` (the sites),
`server` (one threaded HTTP server, judge-only `/__state`), `judge` (rule verdicts),
`task_templates` + `generate` (the task files in `tasks/`), `suite` (`SitesSuite`).
"""

from rollout.suites.sites.suite import SitesSuite

__all__ = ["SitesSuite"]
