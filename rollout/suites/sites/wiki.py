"""`Wikiverse` (`/wiki/...`): ~30 generated country articles with facts, a search box and links.

Each article has an infobox (capital, population, founded, language, ...) and a "Borders" section
linking its neighbours in a fixed order, so multi-hop questions ("the first country listed under
Borders") have one right answer. The content is fictional: a model cannot answer from memory.
"""

from __future__ import annotations

from rollout.suites.sites.web import Request, Response, esc, link, not_found, page, search_box
from rollout.suites.sites.world import Country, world

HOME = "/wiki/"
BRAND = "Wikiverse"


def handle(req: Request) -> Response:
    parts = [p for p in req.path.split("/") if p][1:]
    if req.method == "GET":
        if not parts:
            return _home(req)
        if parts == ["search"]:
            return _search(req)
        if len(parts) == 2 and parts[0] == "article" and parts[1] in world().by_slug:
            return _article(req, world().by_slug[parts[1]])
    return not_found(req, "wiki", BRAND, HOME)


def _page(req: Request, title: str, body: str) -> Response:
    return page(req, site="wiki", brand=BRAND, home=HOME, title=title, body=body, search=search_box("/wiki/search"))


def href(c: Country) -> str:
    return f"/wiki/article/{c.slug}"


def summary(c: Country) -> str:
    return (
        f"{c.name} is a country in the {c.region} region. Its capital and largest city is {c.capital}. "
        f"The official language is {c.language} and the currency is the {c.currency}."
    )


def _home(req: Request) -> Response:
    featured = world().countries[0]
    body = (
        f"<h1>Welcome to {BRAND}</h1><p>The free encyclopedia of {len(world().countries)} countries. "
        "Use the search box above to find an article.</p>"
        f"<h2>Featured article</h2><p>{link(href(featured), featured.name)}: {esc(summary(featured))}</p>"
    )
    return _page(req, "Main page", body)


def _search(req: Request) -> Response:
    q = req.arg("q")
    words = q.lower().split()
    in_title = [c for c in world().countries if words and all(w in c.name.lower() for w in words)]
    in_text = [
        c
        for c in world().countries
        if c not in in_title and words and all(w in (summary(c) + " " + " ".join(c.borders)).lower() for w in words)
    ]
    hits = in_title + in_text
    items = "".join(
        f"<li>{link(href(c), c.name)}<br><span class='muted'>{esc(summary(c))}</span></li>" for c in hits[:8]
    )
    found = f"<ul>{items}</ul>" if hits else "<p><b>No articles match.</b> Check the spelling or try one word.</p>"
    title = f"Search results for \u201c{q}\u201d"
    return _page(req, title, f"<h1>{esc(title)}</h1><p class='muted'>{len(hits)} articles found</p>{found}")


def _infobox(c: Country) -> str:
    rows = [
        ("Capital", c.capital),
        ("Population", f"{c.population:,}"),
        ("Founded", str(c.founded)),
        ("Language", c.language),
        ("Currency", c.currency.title()),
        ("Region", c.region),
    ]
    cells = "".join(f"<tr><th>{k}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="infobox"><tr><th colspan=2>{esc(c.name)}</th></tr>{cells}</table>'


def _article(req: Request, c: Country) -> Response:
    by_name = world().by_country_name
    borders = "".join(f"<li>{link(href(by_name[n]), n)}</li>" for n in c.borders)
    body = (
        f"<h1>{esc(c.name)}</h1>{_infobox(c)}<p>{esc(summary(c))}</p>"
        f"<p>{esc(c.name)} was founded in {c.founded} and today has a population of {c.population:,}.</p>"
        f"<h2>Borders</h2><p>{esc(c.name)} shares borders with:</p><ul>{borders}</ul>"
    )
    return _page(req, c.name, body)
