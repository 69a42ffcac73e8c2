"""The deterministic content of the shop and the wiki, generated from one seed.

Task files name products and articles, so this content must come out identical on every machine:
only `random.Random(WORLD_SEED)` draws it, in a fixed order. Changing `WORLD_SEED` or any list here
changes the world, and `python -m rollout.suites.sites.generate` must then be rerun.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

WORLD_SEED = 20260605

CATEGORIES: dict[str, tuple[str, int, int]] = {
    # category -> (noun in product names, price range in whole dollars)
    "Laptops": ("Laptop", 380, 1600),
    "Headphones": ("Headphones", 25, 320),
    "Coffee Makers": ("Coffee Maker", 20, 260),
    "Backpacks": ("Backpack", 18, 160),
    "Desk Lamps": ("Desk Lamp", 12, 130),
    "Running Shoes": ("Trail Runner", 40, 210),
}
BRANDS = ["Acme", "Borealis", "Cobalt", "Dynamo", "Everline"]
ADJECTIVES = [
    "Swift",
    "Nova",
    "Quiet",
    "Aero",
    "Summit",
    "Pulse",
    "Vista",
    "Echo",
    "Orbit",
    "Terra",
    "Zen",
    "Flux",
    "Prime",
    "Lumen",
    "Drift",
    "Core",
    "Halo",
    "Ridge",
    "Spark",
    "Tide",
]
PER_CATEGORY = 10
"""Products per category: every brand gets exactly two, so each brand+category filter has a choice."""

_SYLLABLES = [
    "val",
    "dor",
    "ka",
    "mir",
    "tes",
    "lo",
    "ran",
    "bel",
    "qui",
    "zar",
    "os",
    "te",
    "nu",
    "vic",
    "hal",
    "mor",
    "sen",
    "ta",
    "gri",
    "pel",
    "dru",
    "ven",
    "ari",
    "sol",
]
_COUNTRY_ENDS = ["ia", "land", "ora", "an", "istan", "eth", "ovia", "mark"]
_CITY_ENDS = ["burg", "holm", " City", "port", "ford", "mouth", "stad", "ville"]
LANGUAGES = ["Aldic", "Berenese", "Corvish", "Dalmic", "Estran", "Fennic", "Galtic", "Horvan", "Istrian", "Jorvic"]
CURRENCIES = ["crown", "mark", "florin", "thaler", "ducat", "real", "shilling", "dinar"]
REGIONS = ["Northern Reach", "Western Shore", "Central Plains", "Eastern Highlands", "Southern Isles"]
N_ARTICLES = 30


@dataclass(frozen=True)
class Product:
    sku: str
    name: str
    brand: str
    category: str
    price: float
    rating: float
    reviews: int

    @property
    def price_text(self) -> str:
        return f"${self.price:,.2f}"


@dataclass(frozen=True)
class Country:
    slug: str
    name: str
    capital: str
    population: int
    founded: int
    language: str
    currency: str
    region: str
    borders: tuple[str, ...]
    """Names of neighbouring countries, in the order the article lists them."""


@dataclass(frozen=True)
class World:
    products: tuple[Product, ...]
    countries: tuple[Country, ...]

    @functools.cached_property
    def by_sku(self) -> dict[str, Product]:
        return {p.sku: p for p in self.products}

    @functools.cached_property
    def by_slug(self) -> dict[str, Country]:
        return {c.slug: c for c in self.countries}

    @functools.cached_property
    def by_country_name(self) -> dict[str, Country]:
        return {c.name: c for c in self.countries}

    def in_category(self, category: str) -> list[Product]:
        return [p for p in self.products if p.category == category]


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@functools.lru_cache(maxsize=1)
def world() -> World:
    rng = random.Random(WORLD_SEED)
    return World(products=tuple(_products(rng)), countries=tuple(_countries(rng)))


def _products(rng: random.Random) -> list[Product]:
    out: list[Product] = []
    for category, (noun, lo, hi) in CATEGORIES.items():
        adjectives = rng.sample(ADJECTIVES, PER_CATEGORY)
        brands = BRANDS * (PER_CATEGORY // len(BRANDS))
        rng.shuffle(brands)
        # Distinct prices and ratings within a category, so "cheapest" and "best rated" are unique.
        prices = rng.sample(range(lo, hi), PER_CATEGORY)
        ratings = rng.sample(range(25, 50), PER_CATEGORY)
        for adj, brand, price, rating in zip(adjectives, brands, prices, ratings):
            out.append(
                Product(
                    sku=f"sku-{len(out) + 1}",
                    name=f"{brand} {adj} {noun}",
                    brand=brand,
                    category=category,
                    price=price + 0.99,
                    rating=rating / 10,
                    reviews=rng.randint(3, 900),
                )
            )
    return out


def _names(rng: random.Random, ends: list[str], n: int, taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        stem = "".join(rng.sample(_SYLLABLES, rng.choice([1, 2])))
        name = (stem + rng.choice(ends)).strip().title()
        # No name may contain another: search and the oracle's partial match would be ambiguous.
        if len(name) > 4 and not any(name in t or t in name for t in taken):
            taken.add(name)
            names.append(name)
    return names


def _countries(rng: random.Random) -> list[Country]:
    taken: set[str] = set()
    names = _names(rng, _COUNTRY_ENDS, N_ARTICLES, taken)
    capitals = _names(rng, _CITY_ENDS, N_ARTICLES, taken)
    populations = rng.sample(range(150, 95_000), N_ARTICLES)
    founded = rng.sample(range(820, 1960), N_ARTICLES)
    neighbours = _border_graph(rng, N_ARTICLES)
    return [
        Country(
            slug=slugify(name),
            name=name,
            capital=capitals[i],
            population=populations[i] * 1000 + 500,
            founded=founded[i],
            language=rng.choice(LANGUAGES),
            currency=rng.choice(CURRENCIES),
            region=rng.choice(REGIONS),
            borders=tuple(names[j] for j in neighbours[i]),
        )
        for i, name in enumerate(names)
    ]


def _border_graph(rng: random.Random, n: int) -> list[list[int]]:
    """A ring (so every article links onward) plus random chords; symmetric; 2-4 neighbours each."""
    adj: list[set[int]] = [{(i - 1) % n, (i + 1) % n} for i in range(n)]
    for _ in range(n // 2):
        a, b = rng.sample(range(n), 2)
        if b not in adj[a] and len(adj[a]) < 4 and len(adj[b]) < 4:
            adj[a].add(b)
            adj[b].add(a)
    out = []
    for s in adj:
        order = sorted(s)
        rng.shuffle(order)
        out.append(order)
    return out
