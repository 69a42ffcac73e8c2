"""One local HTTP server for all three sites (`/shop/`, `/wiki/`, `/forms/`), on 127.0.0.1 only.

Per-episode state lives in a `Session` keyed by the `sid` cookie set on the first visit, so a fresh
browser context is a fresh episode. `/__state` returns that session's state as JSON for the judge
and answers 403 unless the `X-Judge-Token` header carries the token drawn at server start: an agent
that navigates there learns nothing. Requests of one session are serialised by its lock; different
sessions (concurrent episodes) run in parallel threads.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from collections import OrderedDict
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qsl, urlsplit

from rollout.suites.serving import QuietHTTPServer
from rollout.suites.sites import forms, shop, wiki
from rollout.suites.sites.web import STATIC, Request, Response, Session, esc, page

COOKIE = "sid"
MAX_SESSIONS = 20_000
"""Oldest sessions are dropped beyond this: an everlasting pool must not grow the server forever."""
SITES = {"shop": shop.handle, "wiki": wiki.handle, "forms": forms.handle}


class SessionStore:
    def __init__(self, limit: int = MAX_SESSIONS):
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self._limit = limit

    def get(self, sid: str | None) -> Session | None:
        with self._lock:
            return self._sessions.get(sid) if sid else None

    def get_or_create(self, sid: str | None) -> tuple[Session, bool]:
        with self._lock:
            if sid and sid in self._sessions:
                self._sessions.move_to_end(sid)
                return self._sessions[sid], False
            s = Session(secrets.token_hex(16))
            self._sessions[s.sid] = s
            while len(self._sessions) > self._limit:
                self._sessions.popitem(last=False)
            return s, True


class SitesServer:
    """`start()` binds a free port on 127.0.0.1 and serves from a daemon thread."""

    def __init__(self, port: int = 0):
        self.port = port
        self.token = secrets.token_hex(16)
        self.sessions = SessionStore()
        self._httpd: QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SitesServer:
        if self._httpd is None:
            self._httpd = QuietHTTPServer(("127.0.0.1", self.port), _Handler)
            self._httpd.app = self  # type: ignore[attr-defined]
            self.port = self._httpd.server_address[1]
            self._thread = threading.Thread(target=self._httpd.serve_forever, name="sites-http", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
            if self._thread is not None:
                self._thread.join(timeout=5)

    def respond(self, method: str, raw_path: str, headers, body: bytes) -> tuple[Response, str | None]:
        """The response, and a new session id to set as cookie (None if the visitor had one)."""
        parts = urlsplit(raw_path)
        path = parts.path or "/"
        if path.startswith("/static/"):
            return _static(path), None
        sid = _sid(headers.get("Cookie", ""))
        if path == "/__state":
            return self._state(headers, sid), None
        session, new = self.sessions.get_or_create(sid)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        form = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)) if method == "POST" else {}
        req = Request(method, path, query, form, session)
        site = path.strip("/").split("/")[0]
        with session.lock:
            resp = SITES[site](req) if site in SITES else _index(req)
        return resp, session.sid if new else None

    def _state(self, headers, sid: str | None) -> Response:
        given = headers.get("X-Judge-Token", "")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return Response("Forbidden", status=403, content_type="text/plain; charset=utf-8")
        session = self.sessions.get(sid)
        state = session.state() if session else Session("").state()
        return Response(json.dumps(state), content_type="application/json")


def _sid(header: str) -> str | None:
    try:
        cookie = SimpleCookie(header)
    except CookieError:  # a malformed cookie header is a new visitor, not a crash
        return None
    return cookie[COOKIE].value if COOKIE in cookie else None


def _static(path: str) -> Response:
    name = path.removeprefix("/static/")
    f = STATIC / name
    if "/" in name or not f.is_file():
        return Response("Not found", status=404, content_type="text/plain; charset=utf-8")
    return Response(
        f.read_text(encoding="utf-8"), content_type="text/css; charset=utf-8", headers={"Cache-Control": "max-age=3600"}
    )


def _index(req: Request) -> Response:
    if req.path not in ("/", ""):
        body = f"<h1>Page not found</h1><p>There is nothing at {esc(req.path)}.</p>"
        return page(req, site="index", brand="Local sites", home="/", title="Not found", body=body, status=404)
    items = "".join(f'<li><a href="/{s}/">{s.title()}</a></li>' for s in SITES)
    return page(req, site="index", brand="Local sites", home="/", title="Sites", body=f"<h1>Sites</h1><ul>{items}</ul>")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._serve("POST")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        try:
            resp, new_sid = self.server.app.respond(method, self.path, self.headers, body)  # type: ignore[attr-defined]
        except Exception as exc:  # a site bug must show as a page, not a dropped connection
            resp, new_sid = Response(f"Internal error: {type(exc).__name__}", 500, "text/plain; charset=utf-8"), None
        data = resp.body.encode("utf-8")
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.content_type)
        self.send_header("Content-Length", str(len(data)))
        if resp.content_type.startswith("text/html"):
            self.send_header("Cache-Control", "no-store")  # back/forward must show current state
        for k, v in resp.headers.items():
            self.send_header(k, v)
        if new_sid:
            self.send_header("Set-Cookie", f"{COOKIE}={new_sid}; Path=/; HttpOnly; SameSite=Lax")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass
