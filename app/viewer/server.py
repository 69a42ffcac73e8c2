"""The viewer's routes (Starlette), over `analysis.browse` and the screenshot store.

Requests share one DuckDB connection (`ViewerConnections`), one query function at a time (its views include
registered Arrow tables, which a cursor would not see), made again when older than
`ViewerConfig.refresh_s` so that a live run's new Parquet files show up. Screenshots are served by
content hash with a year's immutable cache header: a hash names its bytes forever. Anything not found,
or not well formed, is a 404 page that says what; no page ever shows a traceback.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import uvicorn
from pydantic import BaseModel, ConfigDict
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from analysis import browse
from analysis.views import connect
from app.viewer.render import Screenshots, curves_svg, drawn_step, replay_rows
from pipeline.settings import StackSettings
from schemas.events import RUN_ID_PATTERN

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SHA256 = re.compile(r"^[0-9a-f]{64}$")
IMMUTABLE = {"Cache-Control": "public, max-age=31536000, immutable"}


class ViewerConfig(BaseModel):
    """Where the viewer listens and how fresh it keeps the ledger."""

    model_config = ConfigDict(frozen=True)

    host: str = "127.0.0.1"
    """Address to bind: loopback unless told otherwise (the ledger holds every prompt and screenshot)."""
    port: int = 8765
    """TCP port (`AWRL_VIEWER_URL` should name the same one, for the links other commands print)."""
    refresh_s: float = 10.0
    """A request reconnects to the ledger when its connection is older than this, to see new files."""


class ViewerConnections:
    """One connection to the ledger's views, reconnected when stale, used by one query at a time."""

    def __init__(self, settings: StackSettings, refresh_s: float):
        self.settings, self.refresh_s = settings, refresh_s
        self._con: duckdb.DuckDBPyConnection | None = None
        self._at = 0.0
        self._lock = threading.Lock()

    def query(self, fn, *args):
        """`fn(connection, *args)` on a connection at most `refresh_s` old."""
        with self._lock:
            if self._con is None or time.monotonic() - self._at > self.refresh_s:
                fresh = connect(self.settings, read_only=True)
                if self._con is not None:
                    self._con.close()
                self._con, self._at = fresh, time.monotonic()
            return fn(self._con, *args)


def make_app(settings: StackSettings, config: ViewerConfig = ViewerConfig()) -> Starlette:
    """The viewer as an ASGI application (for uvicorn, or a test client)."""
    connections = ViewerConnections(settings, config.refresh_s)
    shots = Screenshots(settings)
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.globals["page_path"] = browse.page_path
    templates.env.filters["num"] = _num

    def page(request: Request, name: str, **context) -> Response:
        return templates.TemplateResponse(request, name, context)

    query = connections.query

    def run_id(request: Request) -> str:
        value = request.path_params["run_id"]
        if not re.match(RUN_ID_PATTERN, value):
            raise HTTPException(404, f"{value!r} is not a run id")
        return value

    def runs_page(request: Request) -> Response:
        return page(request, "runs.html", runs=query(browse.runs))

    def run_page(request: Request) -> Response:
        rid = run_id(request)
        found = query(browse.run, rid)
        if found is None:
            raise HTTPException(404, f"no run {rid!r} in the ledger")
        outcome = request.query_params.get("outcome") or None
        if outcome is not None and outcome not in browse.OUTCOMES:
            raise HTTPException(404, f"no outcome {outcome!r} (one of {', '.join(browse.OUTCOMES)})")
        return page(
            request,
            "run.html",
            run=found,
            outcome=outcome,
            outcomes=browse.OUTCOMES,
            counts=query(browse.counts, rid),
            trajectories=query(browse.trajectories, rid, outcome),
            groups=query(browse.groups, rid),
            updates=query(browse.updates, rid),
            others=[r["run_id"] for r in query(browse.runs) if r["run_id"] != rid],
        )

    def curves(request: Request) -> Response:
        rid = run_id(request)
        return Response(
            curves_svg(query(browse.version_curves, rid), rid),
            media_type="image/svg+xml",
            headers={"Cache-Control": "no-cache"},
        )

    def trajectory_page(request: Request) -> Response:
        rid, tid = run_id(request), request.path_params["trajectory_id"]
        found = query(browse.trajectory, rid, tid)
        if found is None:
            raise HTTPException(404, f"no trajectory {tid!r} in run {rid!r}")
        with ThreadPoolExecutor(8) as pool:  # each screenshot fetched and verified once, in parallel
            problems = dict(
                zip(
                    (s["screenshot_sha256"] for s in found["steps"]),
                    pool.map(shots.problem, [s["screenshot_sha256"] for s in found["steps"]]),
                )
            )
        return page(request, "trajectory.html", run_id=rid, t=found, problems=problems)

    def group_page(request: Request) -> Response:
        rid, gid = run_id(request), request.path_params["group_id"]
        found = query(browse.group, rid, gid)
        if found is None:
            raise HTTPException(404, f"no group {gid!r} in run {rid!r}")
        return page(request, "group.html", run_id=rid, group_id=gid, **found)

    def update_page(request: Request) -> Response:
        rid, step = run_id(request), request.path_params["update_step"]
        found = query(browse.update, rid, step)
        if found is None:
            raise HTTPException(404, f"no update {step} in run {rid!r}")
        return page(request, "update.html", run_id=rid, u=found, replay=replay_rows(settings, rid, step))

    def screenshot(request: Request) -> Response:
        sha = request.path_params["sha"]
        if not SHA256.match(sha):
            raise HTTPException(404, "not a sha256 (64 lower-case hex digits)")
        data, problem = shots.get(sha)
        if problem:
            raise HTTPException(404, problem)
        return Response(data, media_type="image/png", headers={**IMMUTABLE, "ETag": f'"{sha}"'})

    def step_drawn(request: Request) -> Response:
        """A step's screenshot with its Set-of-Mark boxes and its click drawn (a step never changes)."""
        rid, tid, n = run_id(request), request.path_params["trajectory_id"], request.path_params["step"]
        found = query(browse.trajectory, rid, tid)
        step = next((s for s in found["steps"] if s["step"] == n), None) if found else None
        if step is None:
            raise HTTPException(404, f"no step {n} of trajectory {tid!r} in run {rid!r}")
        data, problem = shots.get(step["screenshot_sha256"])
        if problem:
            raise HTTPException(404, problem)
        return Response(drawn_step(data, step), media_type="image/png", headers=IMMUTABLE)

    routes = [
        Route("/", runs_page),
        Route("/runs/{run_id}", run_page),
        Route("/runs/{run_id}/curves.svg", curves),
        Route("/runs/{run_id}/trajectories/{trajectory_id}", trajectory_page),
        Route("/runs/{run_id}/trajectories/{trajectory_id}/steps/{step:int}.png", step_drawn),
        Route("/runs/{run_id}/groups/{group_id}", group_page),
        Route("/runs/{run_id}/updates/{update_step:int}", update_page),
        Route("/screenshots/{sha}.png", screenshot),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    async def not_found(request: Request, exc: HTTPException) -> Response:
        return templates.TemplateResponse(
            request, "error.html", {"status": exc.status_code, "detail": exc.detail}, status_code=exc.status_code
        )

    async def failed(request: Request, exc: Exception) -> Response:
        log.exception("%s failed", request.url.path)  # the traceback goes to the log, never to the page
        return templates.TemplateResponse(
            request, "error.html", {"status": 500, "detail": _one_line(exc)}, status_code=500
        )

    return Starlette(routes=routes, exception_handlers={HTTPException: not_found, Exception: failed})


def serve(settings: StackSettings, config: ViewerConfig = ViewerConfig()) -> None:
    """Serve until interrupted (uvicorn, one process)."""
    uvicorn.run(make_app(settings, config), host=config.host, port=config.port, log_level="warning")


def _num(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _one_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
