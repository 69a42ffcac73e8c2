"""Task templates: each draws one task (instruction, start page, judge, oracle plan) from an rng.

Two templates per site and difficulty; the second of each pair is held out (never trained on):

| site  | easy                       | medium                                  | hard                                  |
|-------|----------------------------|-----------------------------------------|---------------------------------------|
| shop  | add_item / price_lookup*   | cheapest_brand / priciest_under*        | buy_two / cheapest_plus*              |
| wiki  | capital / founded*         | neighbor_capital / neighbor_language*   | compare_population / founded_gap*     |
| forms | contact / newsletter*      | signup / return_request*                | job_application / event_registration* |

(* = held out.) Oracle plans use the shared step vocabulary (click / type / select / press / goto /
answer / stop), name elements by their visible text or label, and only target elements that are in
the 1280x720 viewport without scrolling.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from rollout.suites.sites import forms
from rollout.suites.sites.world import BRANDS, CATEGORIES, Country, Product, world

Step = dict[str, str]


@dataclass(frozen=True)
class Spec:
    instruction: str
    start_path: str
    judge: dict
    oracle: list[Step]


@dataclass(frozen=True)
class Template:
    site: str
    name: str
    difficulty: str
    split: str
    draw: Callable[[random.Random], Spec]


def click(name: str, role: str | None = None) -> Step:
    return {"op": "click", "name": name, **({"role": role} if role else {})}


def type_(name: str, text: str) -> Step:
    return {"op": "type", "name": name, "text": text}


def select(name: str, text: str) -> Step:
    return {"op": "select", "name": name, "text": text}


def answer(text: str) -> Step:
    return {"op": "answer", "text": text}


STOP: Step = {"op": "stop"}


def search(name: str) -> list[Step]:
    """Search for `name` from the header box and open the result titled exactly `name`."""
    return [type_("Search", name), {"op": "press", "key": "Enter"}, click(name, "link")]


# --- shop -----------------------------------------------------------------------------------------


def _cheapest(brand: str, category: str) -> Product:
    return min((p for p in world().in_category(category) if p.brand == brand), key=lambda p: p.price)


def _buy(p: Product, n: int) -> list[Step]:
    return search(p.name) + [click("Add to cart", "button")] * n


def _checkout() -> list[Step]:
    return [click("Cart", "link"), click("Checkout", "button"), STOP]


def shop_add_item(rng: random.Random) -> Spec:
    p = rng.choice(world().products)
    return Spec(
        f"Add the {p.name} to the cart.", "/shop/", {"kind": "cart", "expect": [f"{p.sku}:1"]}, _buy(p, 1) + [STOP]
    )


def shop_price_lookup(rng: random.Random) -> Spec:
    p = rng.choice(world().products)
    return Spec(
        f"What is the price of the {p.name}? Answer with the price in dollars.",
        "/shop/",
        {"kind": "answer", "expect": f"{p.price:.2f}"},
        search(p.name) + [answer(p.price_text)],
    )


def shop_cheapest_brand(rng: random.Random) -> Spec:
    category, brand = rng.choice(list(CATEGORIES)), rng.choice(BRANDS)
    target = _cheapest(brand, category)
    limit = int(target.price) + rng.randint(5, 80)
    plan = [
        click(category, "link"),
        select("Brand", brand),
        type_("Max price", str(limit)),
        click("Apply filters", "button"),
        click(target.name, "link"),
        click("Add to cart", "button"),
        STOP,
    ]
    text = f"Add the cheapest {brand} item in the {category} category that costs under ${limit} to the cart."
    return Spec(text, "/shop/", {"kind": "cart", "expect": [f"{target.sku}:1"]}, plan)


def shop_priciest_under(rng: random.Random) -> Spec:
    category = rng.choice(list(CATEGORIES))
    ranked = sorted(world().in_category(category), key=lambda p: p.price)
    i = rng.randint(2, len(ranked) - 1)
    limit, target = int(ranked[i].price), ranked[i - 1]  # prices end in .99: ranked[i] is just above
    plan = [
        click(category, "link"),
        type_("Max price", str(limit)),
        select("Sort by", "Price: high to low"),
        click("Apply filters", "button"),
        click(target.name, "link"),
        click("Add to cart", "button"),
        STOP,
    ]
    text = f"Add the most expensive item in the {category} category that costs less than ${limit} to the cart."
    return Spec(text, "/shop/", {"kind": "cart", "expect": [f"{target.sku}:1"]}, plan)


def shop_buy_two(rng: random.Random) -> Spec:
    p, q = rng.sample(world().products, 2)
    return Spec(
        f"Buy 2 of the {p.name} and 1 of the {q.name}, then check out.",
        "/shop/",
        {"kind": "order", "expect": sorted([f"{p.sku}:2", f"{q.sku}:1"])},
        _buy(p, 2) + _buy(q, 1) + _checkout(),
    )


def shop_cheapest_plus(rng: random.Random) -> Spec:
    category, brand = rng.choice(list(CATEGORIES)), rng.choice(BRANDS)
    target = _cheapest(brand, category)
    other = rng.choice([p for p in world().products if p.category != category])
    plan = (
        [
            click(category, "link"),
            select("Brand", brand),
            click("Apply filters", "button"),
            click(target.name, "link"),
            click("Add to cart", "button"),
        ]
        + _buy(other, 2)
        + _checkout()
    )
    text = f"Buy the cheapest {brand} item in the {category} category and 2 of the {other.name}, then check out."
    return Spec(text, "/shop/", {"kind": "order", "expect": sorted([f"{target.sku}:1", f"{other.sku}:2"])}, plan)


# --- wiki -----------------------------------------------------------------------------------------


def _country(name: str) -> Country:
    return world().by_country_name[name]


def _answer_task(text: str, expect: str, reject: list[str], plan: list[Step]) -> Spec:
    reject = sorted({r for r in reject if r != expect})
    return Spec(text, "/wiki/", {"kind": "answer", "expect": expect, "reject": reject}, plan + [answer(expect)])


def wiki_capital(rng: random.Random) -> Spec:
    c = rng.choice(world().countries)
    return _answer_task(
        f"What is the capital of {c.name}? Answer with the name.",
        c.capital,
        [_country(n).capital for n in c.borders],
        search(c.name),
    )


def wiki_founded(rng: random.Random) -> Spec:
    c = rng.choice(world().countries)
    return _answer_task(f"In what year was {c.name} founded? Answer with the year.", str(c.founded), [], search(c.name))


def wiki_neighbor_capital(rng: random.Random) -> Spec:
    c = rng.choice(world().countries)
    n = _country(c.borders[0])
    text = (
        f"Open the article on {c.name}. What is the capital of the first country listed under "
        "its 'Borders' section? Answer with the name."
    )
    reject = [c.capital] + [_country(b).capital for b in c.borders[1:]]
    return _answer_task(text, n.capital, reject, search(c.name) + [click(n.name, "link")])


def wiki_neighbor_language(rng: random.Random) -> Spec:
    c = rng.choice(world().countries)
    n = _country(c.borders[-1])
    text = (
        f"Open the article on {c.name}. Which language is spoken in the last country listed under "
        "its 'Borders' section? Answer with the language."
    )
    reject = [c.language] + [_country(b).language for b in c.borders[:-1]]
    return _answer_task(text, n.language, reject, search(c.name) + [click(n.name, "link")])


def wiki_compare_population(rng: random.Random) -> Spec:
    a, b = rng.sample(world().countries, 2)
    big, small = (a, b) if a.population > b.population else (b, a)
    text = f"Which country has the larger population, {a.name} or {b.name}? Answer with the country's name."
    return _answer_task(text, big.name, [small.name], search(a.name) + search(b.name))


def wiki_founded_gap(rng: random.Random) -> Spec:
    a, b = rng.sample(world().countries, 2)
    text = f"How many years apart were {a.name} and {b.name} founded? Answer with a number."
    return _answer_task(text, str(abs(a.founded - b.founded)), [], search(a.name) + search(b.name))


# --- forms ----------------------------------------------------------------------------------------

FIRST = ["Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luca"]
LAST = ["Lovelace", "Okafor", "Nguyen", "Patel", "Rossi", "Schmidt", "Tanaka", "Usman", "Varga", "Weber"]
STREETS = ["Maple", "Harbor", "Mill", "Station", "Cedar", "Bridge", "Church", "Garden"]
CITIES = ["Lyon", "Porto", "Osaka", "Calgary", "Bergen", "Malmo", "Nairobi", "Cusco", "Leeds", "Aarhus"]
MESSAGES = [
    "My order arrived late",
    "Please update my billing email",
    "Do you ship to Iceland",
    "The product page has a typo",
    "I would like a paper invoice",
    "Thanks for the quick help",
]


def _person(rng: random.Random) -> tuple[str, str]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    return f"{first} {last}", f"{first}.{last}{rng.randint(1, 99)}@example.com".lower()


def _address(rng: random.Random) -> tuple[str, str, str]:
    street = f"{rng.randint(2, 480)} {rng.choice(STREETS)} Street"
    return street, rng.choice(CITIES), rng.choice(forms.COUNTRIES)


def _fill(form_id: str, values: dict[str, str], open_from_index: bool) -> tuple[dict, list[Step]]:
    """Judge and oracle plan for filling `form_id` step by step with `values` (label -> text)."""
    form = forms.FORMS[form_id]
    plan = [click(form.title, "link")] if open_from_index else []
    for i, (_, fields) in enumerate(form.steps, 1):
        for f in fields:
            plan.append((select if f.kind == "select" else type_)(f.label, values[f.label]))
        plan.append(click("Next" if i < form.n_pages else form.submit, "button"))
    if form.review:
        plan.append(click("Submit", "button"))
    judge = {"kind": "form", "form": form_id, "expect": [f"{f.name}={values[f.label]}" for f in form.fields]}
    return judge, plan + [STOP]


def _form_task(form_id: str, text: str, values: dict[str, str], easy: bool) -> Spec:
    judge, plan = _fill(form_id, values, open_from_index=not easy)
    return Spec(text, f"/forms/{form_id}" if easy else "/forms/", judge, plan)


def forms_contact(rng: random.Random) -> Spec:
    (name, email), msg = _person(rng), rng.choice(MESSAGES)
    text = f'Use the contact form to send the message "{msg}" from {name} (email {email}).'
    return _form_task("contact", text, {"Name": name, "Email": email, "Message": msg}, easy=True)


def forms_newsletter(rng: random.Random) -> Spec:
    (_, email), topic = _person(rng), rng.choice(forms.TOPICS)
    text = f"Subscribe {email} to the newsletter about {topic}."
    return _form_task("newsletter", text, {"Email": email, "Topic": topic}, easy=True)


def forms_signup(rng: random.Random) -> Spec:
    (name, email), (street, city, country) = _person(rng), _address(rng)
    text = f"Create an account for {name} (email {email}) who lives at {street}, {city}, {country}."
    values = {"Full name": name, "Email": email, "Street address": street, "City": city, "Country": country}
    return _form_task("signup", text, values, easy=False)


def forms_return_request(rng: random.Random) -> Spec:
    (_, email), order = _person(rng), f"ORD-{rng.randint(10000, 99999)}"
    reason, comment = rng.choice(forms.REASONS), rng.choice(MESSAGES)
    text = f'Request a return of order {order} (email {email}) with the reason "{reason}" and the comment "{comment}".'
    values = {"Order number": order, "Email": email, "Reason": reason, "Comments": comment}
    return _form_task("return", text, values, easy=False)


def forms_job_application(rng: random.Random) -> Spec:
    (name, email), (street, city, country) = _person(rng), _address(rng)
    phone = f"555 {rng.randint(1000, 9999)} {rng.randint(100, 999)}"
    position, years = rng.choice(forms.POSITIONS), str(rng.randint(1, 25))
    text = (
        f"Apply for the {position} job as {name} (email {email}, phone {phone}), living at {street}, "
        f"{city}, {country}, with {years} years of experience."
    )
    values = {
        "Full name": name,
        "Email": email,
        "Phone": phone,
        "Street address": street,
        "City": city,
        "Country": country,
        "Position": position,
        "Years of experience": years,
    }
    return _form_task("job", text, values, easy=False)


def forms_event_registration(rng: random.Random) -> Spec:
    (name, email), (street, city, country) = _person(rng), _address(rng)
    ticket, diet, guests = rng.choice(forms.TICKETS), rng.choice(forms.DIETS), str(rng.randint(0, 3))
    text = (
        f"Register {name} (email {email}) for the event: a {ticket} ticket, dietary preference {diet}, "
        f"{guests} guests, billing address {street}, {city}, {country}."
    )
    values = {
        "Full name": name,
        "Email": email,
        "Ticket type": ticket,
        "Dietary preference": diet,
        "Number of guests": guests,
        "Street address": street,
        "City": city,
        "Country": country,
    }
    return _form_task("event", text, values, easy=False)


TEMPLATES = [
    Template(site, fn.__name__.split("_", 1)[1], difficulty, split, fn)
    for site, difficulty, pair in [
        ("shop", "easy", (shop_add_item, shop_price_lookup)),
        ("shop", "medium", (shop_cheapest_brand, shop_priciest_under)),
        ("shop", "hard", (shop_buy_two, shop_cheapest_plus)),
        ("wiki", "easy", (wiki_capital, wiki_founded)),
        ("wiki", "medium", (wiki_neighbor_capital, wiki_neighbor_language)),
        ("wiki", "hard", (wiki_compare_population, wiki_founded_gap)),
        ("forms", "easy", (forms_contact, forms_newsletter)),
        ("forms", "medium", (forms_signup, forms_return_request)),
        ("forms", "hard", (forms_job_application, forms_event_registration)),
    ]
    for fn, split in zip(pair, ("train", "heldout"))
]
