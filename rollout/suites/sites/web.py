"""The small web layer the three sites share: request, response, per-episode session, page layout.

Agents only see screenshots, so every state change must show on the next page: `Session.flash`
carries a one-shot message ("Added ... to your cart") into the next rendered page.
"""

from __future__ import annotations

import html
import threading
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from urllib.parse import urlencode

TEMPLATES = Path(__file__).with_name("templates")
STATIC = Path(__file__).with_name("static")
_LAYOUT = Template((TEMPLATES / "layout.html").read_text(encoding="utf-8"))


@dataclass
class Session:
    """One episode's state: a fresh browser context gets a fresh cookie and so a fresh session."""

    sid: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    cart: dict[str, int] = field(default_factory=dict)
    orders: list[dict] = field(default_factory=list)
    drafts: dict[str, dict[str, str]] = field(default_factory=dict)
    submissions: list[dict] = field(default_factory=list)
    flash: list[tuple[str, str]] = field(default_factory=list)

    def say(self, text: str, kind: str = "ok") -> None:
        self.flash.append((kind, text))

    def state(self) -> dict:
        """What the judge sees (`/__state`)."""
        return {"cart": dict(self.cart), "orders": list(self.orders), "submissions": list(self.submissions)}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    form: dict[str, str]
    session: Session

    def arg(self, key: str) -> str:
        return (self.form.get(key) or self.query.get(key) or "").strip()


@dataclass
class Response:
    body: str = ""
    status: int = 200
    content_type: str = "text/html; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


def redirect(location: str) -> Response:
    # 303: the browser follows a POST with a GET, so reloading never repeats an action.
    return Response(status=303, headers={"Location": location})


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def url(path: str, **params: str) -> str:
    kept = {k: v for k, v in params.items() if v}
    return path + ("?" + urlencode(kept) if kept else "")


def link(href: str, text: str) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>'


def search_box(action: str) -> str:
    # Never prefilled: an agent (or the oracle) that clicks and types must not append to old text.
    return (
        f'<form class="search" action="{esc(action)}" method="get" role="search">'
        '<input type="search" name="q" placeholder="Search" aria-label="Search">'
        '<button type="submit">Go</button></form>'
    )


def page(
    req: Request,
    *,
    site: str,
    brand: str,
    home: str,
    title: str,
    body: str,
    search: str = "",
    extra: str = "",
    nav: str = "",
    status: int = 200,
) -> Response:
    flashes = "".join(f'<div class="flash {k}" role="status">{esc(t)}</div>' for k, t in req.session.flash)
    req.session.flash.clear()
    text = _LAYOUT.substitute(
        title=esc(f"{title} - {brand}"),
        site=site,
        home=home,
        brand=esc(brand),
        search=search,
        extra=extra,
        nav=nav,
        flash=flashes,
        body=body,
    )
    return Response(text, status=status)


def not_found(req: Request, site: str, brand: str, home: str) -> Response:
    body = (
        f"<h1>Page not found</h1><p>There is nothing at {esc(req.path)}.</p><p>{link(home, 'Go to the home page')}</p>"
    )
    return page(req, site=site, brand=brand, home=home, title="Not found", body=body, status=404)
