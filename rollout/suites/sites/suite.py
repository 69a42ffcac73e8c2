"""`SitesSuite`: the shop, wiki and forms sites as one `rollout.types.Suite`.

One local server serves all three sites; tasks come from the generated `tasks/*.jsonl` files. The
episode ends only when the agent answers or stops (or the horizon runs out), so a lost agent wanders
on and failures run longer than successes, as on the real web. The final verdict is a rule judge over
the session state, fetched through the episode's own browser context so its cookie picks the session.
"""

from __future__ import annotations

from pathlib import Path

from rollout.suites.sites.judge import judge_task
from rollout.suites.sites.server import SitesServer
from rollout.suites.tasks_io import load_tasks
from rollout.types import Verdict
from schemas.observation import Observation, Task

TASKS_DIR = Path(__file__).with_name("tasks")
SPLITS = ("train", "heldout")


class SitesSuite:
    name = "sites"
    needs_browser = True
    allowed_hosts = {"127.0.0.1"}

    def __init__(self, tasks_dir: Path = TASKS_DIR, port: int = 0):
        self.tasks_dir = Path(tasks_dir)
        self._port = port
        self._server: SitesServer | None = None
        self._tasks: list[Task] | None = None

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("SitesSuite.start() has not been called")
        return self._server.base_url

    def start(self) -> None:
        if self._server is None:
            self._server = SitesServer(self._port).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def tasks(self, split: str | None = None) -> list[Task]:
        if split is not None and split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
        if self._tasks is None:
            files = sorted(self.tasks_dir.glob("*.jsonl"))
            if not files:
                raise FileNotFoundError(
                    f"no task files in {self.tasks_dir}; run python -m rollout.suites.sites.generate"
                )
            self._tasks = [t for f in files for t in load_tasks(f)]
        return [t for t in self._tasks if split is None or t.split == split]

    async def reset(self, page, task: Task) -> str:
        await page.goto(self.base_url + task.start_path, wait_until="load")
        return task.instruction

    async def judge(self, page, task: Task, answer: str | None, final: bool) -> Verdict | None:
        if not final:
            return None
        return judge_task(task, await self.state(page), answer)

    async def state(self, page) -> dict:
        """The episode's session state; `page.request` shares the context's cookies."""
        assert self._server is not None, "SitesSuite.start() has not been called"
        resp = await page.request.get(self.base_url + "/__state", headers={"X-Judge-Token": self._server.token})
        if resp.status != 200:
            raise RuntimeError(f"/__state answered {resp.status}")
        return await resp.json()

    def oracle_step(self, obs: Observation) -> dict:
        plan = obs.task.oracle if obs.task is not None else []
        return dict(plan[obs.step]) if 0 <= obs.step < len(plan) else {"op": "stop"}
