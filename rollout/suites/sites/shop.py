"""`ShopMart` (`/shop/...`): search, category pages with filters, product pages, a cart and checkout.

Every page shows the cart count in the header, and every cart change leaves a visible message, so a
screenshot alone tells the agent what it has done. Orders are recorded in the session for the judge.
"""

from __future__ import annotations

from rollout.suites.sites.web import Request, Response, esc, link, not_found, page, redirect, search_box, url
from rollout.suites.sites.world import BRANDS, CATEGORIES, Product, world

HOME = "/shop/"
BRAND = "ShopMart"
SORTS = {"price": "Price: low to high", "price-desc": "Price: high to low", "rating": "Rating: high to low"}


def handle(req: Request) -> Response:
    parts = [p for p in req.path.split("/") if p][1:]
    if req.method == "POST":
        if parts == ["cart", "add"]:
            return _add(req)
        if parts == ["cart", "update"]:
            return _update(req)
        if parts == ["checkout"]:
            return _checkout(req)
    elif not parts:
        return _home(req)
    elif parts == ["search"]:
        return _results(req)
    elif parts == ["cart"]:
        return _cart(req)
    elif len(parts) == 2 and parts[0] == "product" and parts[1] in world().by_sku:
        return _product(req, world().by_sku[parts[1]])
    elif len(parts) == 2 and parts[0] == "order":
        return _order(req, parts[1])
    return not_found(req, "shop", BRAND, HOME)


def _page(req: Request, title: str, body: str, status: int = 200) -> Response:
    n = sum(req.session.cart.values())
    extra = f'{link("/shop/cart", "Cart")}<span class="badge">{n} item{"" if n == 1 else "s"}</span>'
    nav = '<nav class="cats">' + "".join(link(url("/shop/search", category=c), c) for c in CATEGORIES) + "</nav>"
    return page(
        req,
        site="shop",
        brand=BRAND,
        home=HOME,
        title=title,
        body=body,
        search=search_box("/shop/search"),
        extra=extra,
        nav=nav,
        status=status,
    )


def _table(products: list[Product]) -> str:
    rows = "".join(
        f"<tr><td>{link(f'/shop/product/{p.sku}', p.name)}</td><td>{esc(p.brand)}</td>"
        f"<td>{p.price_text}</td><td>{p.rating:.1f} / 5</td></tr>"
        for p in products
    )
    return f"<table><tr><th>Product</th><th>Brand</th><th>Price</th><th>Rating</th></tr>{rows}</table>"


def _home(req: Request) -> Response:
    featured = [world().in_category(c)[0] for c in CATEGORIES]
    body = (
        "<h1>Welcome to ShopMart</h1><p>Search for a product above, or pick a category.</p>"
        f"<h2>Featured products</h2>{_table(featured)}"
    )
    return _page(req, "Home", body)


def _matches(p: Product, q: str) -> bool:
    hay = f"{p.name} {p.brand} {p.category}".lower()
    return all(tok in hay for tok in q.lower().split())


def _filtered(req: Request) -> list[Product]:
    q, category, brand = req.arg("q"), req.arg("category"), req.arg("brand")
    found = [
        p
        for p in world().products
        if _matches(p, q) and (not category or p.category == category) and (not brand or p.brand == brand)
    ]
    try:
        limit = float(req.arg("max_price").lstrip("$").replace(",", "")) if req.arg("max_price") else None
    except ValueError:
        limit = None
    if limit is not None:
        found = [p for p in found if p.price <= limit]
    sort = req.arg("sort") or "price"
    key = {"price": lambda p: p.price, "price-desc": lambda p: -p.price, "rating": lambda p: -p.rating}
    return sorted(found, key=key.get(sort, key["price"]))


def _filters(req: Request) -> str:
    def options(values: dict[str, str], current: str) -> str:
        return "".join(
            f'<option value="{esc(v)}"{" selected" if v == current else ""}>{esc(t)}</option>'
            for v, t in values.items()
        )

    brands = {"": "All brands", **{b: b for b in BRANDS}}
    hidden = "".join(
        f'<input type="hidden" name="{k}" value="{esc(req.arg(k))}">' for k in ("q", "category") if req.arg(k)
    )
    return (
        f'<form class="filters" action="/shop/search" method="get">{hidden}'
        f'<div><label for="max_price">Max price</label><input id="max_price" name="max_price" '
        f'aria-label="Max price" placeholder="e.g. 100" value="{esc(req.arg("max_price"))}"></div>'
        f'<div><label for="brand">Brand</label><select id="brand" name="brand" aria-label="Brand">'
        f"{options(brands, req.arg('brand'))}</select></div>"
        f'<div><label for="sort">Sort by</label><select id="sort" name="sort" aria-label="Sort by">'
        f"{options(SORTS, req.arg('sort') or 'price')}</select></div>"
        '<button type="submit">Apply filters</button></form>'
    )


def _results(req: Request) -> Response:
    found = _filtered(req)
    q, category = req.arg("q"), req.arg("category")
    title = f"Results for \u201c{q}\u201d" if q else (category or "All products")
    count = f'<p class="muted">{len(found)} product{"" if len(found) == 1 else "s"} found</p>'
    listing = _table(found) if found else "<p><b>No products match.</b> Try other words or fewer filters.</p>"
    return _page(req, title, f"<h1>{esc(title)}</h1>{_filters(req)}{count}{listing}")


def _product(req: Request, p: Product) -> Response:
    have = req.session.cart.get(p.sku, 0)
    in_cart = f"<p><b>In your cart: {have}</b></p>" if have else ""
    body = (
        f"<h1>{esc(p.name)}</h1><p>Brand: <b>{esc(p.brand)}</b> &middot; Category: "
        f"{link(url('/shop/search', category=p.category), 'All ' + p.category)}</p>"
        f'<p class="price">{p.price_text}</p><p>Rating: {p.rating:.1f} out of 5 ({p.reviews} reviews)</p>'
        f"<p>The {esc(p.name)} is a dependable pick from {esc(p.brand)}.</p>{in_cart}"
        f'<form method="post" action="/shop/cart/add"><input type="hidden" name="sku" value="{p.sku}">'
        '<button type="submit">Add to cart</button></form>'
    )
    return _page(req, p.name, body)


def _add(req: Request) -> Response:
    p = world().by_sku.get(req.arg("sku"))
    if p is None:
        return redirect(HOME)
    cart = req.session.cart
    cart[p.sku] = cart.get(p.sku, 0) + 1
    req.session.say(f"Added {p.name} to your cart (now {cart[p.sku]} in cart).")
    return redirect(f"/shop/product/{p.sku}")


def _update(req: Request) -> Response:
    p, op, cart = world().by_sku.get(req.arg("sku")), req.arg("op"), req.session.cart
    if p is not None and p.sku in cart:
        cart[p.sku] += {"inc": 1, "dec": -1}.get(op, -cart[p.sku])
        if cart[p.sku] <= 0:
            del cart[p.sku]
        req.session.say(f"Updated {p.name}: {cart.get(p.sku, 0)} in cart.")
    return redirect("/shop/cart")


def _cart_row(p: Product, qty: int) -> str:
    def button(op: str, text: str, label: str) -> str:
        return (
            f'<form method="post" action="/shop/cart/update" style="display:inline">'
            f'<input type="hidden" name="sku" value="{p.sku}"><input type="hidden" name="op" value="{op}">'
            f'<button type="submit" class="secondary" aria-label="{esc(label)}">{text}</button></form> '
        )

    actions = (
        button("dec", "&minus;", f"Decrease {p.name}")
        + button("inc", "+", f"Increase {p.name}")
        + button("remove", "Remove", f"Remove {p.name}")
    )
    return (
        f"<tr><td>{link(f'/shop/product/{p.sku}', p.name)}</td><td>{p.price_text}</td>"
        f"<td>{qty}</td><td>${p.price * qty:,.2f}</td><td>{actions}</td></tr>"
    )


def _cart(req: Request) -> Response:
    cart = req.session.cart
    if not cart:
        body = f"<h1>Your cart</h1><p>Your cart is empty.</p><p>{link(HOME, 'Continue shopping')}</p>"
        return _page(req, "Cart", body)
    items = [(world().by_sku[s], q) for s, q in cart.items()]
    total = sum(p.price * q for p, q in items)
    rows = "".join(_cart_row(p, q) for p, q in items)
    body = (
        "<h1>Your cart</h1><table><tr><th>Product</th><th>Price</th><th>Quantity</th><th>Subtotal</th>"
        f"<th></th></tr>{rows}<tr><th colspan=3>Total</th><th>${total:,.2f}</th><th></th></tr></table>"
        '<form method="post" action="/shop/checkout" class="actions"><button type="submit">Checkout</button>'
        "</form>"
    )
    return _page(req, "Cart", body)


def _checkout(req: Request) -> Response:
    s = req.session
    if not s.cart:
        s.say("Your cart is empty: add something before checking out.", "error")
        return redirect("/shop/cart")
    order_id = str(1001 + len(s.orders))
    total = round(sum(world().by_sku[k].price * q for k, q in s.cart.items()), 2)
    s.orders.append({"order_id": order_id, "items": dict(s.cart), "total": total})
    s.cart.clear()
    s.say(f"Order #{order_id} has been placed. Thank you!")
    return redirect(f"/shop/order/{order_id}")


def _order(req: Request, order_id: str) -> Response:
    order = next((o for o in req.session.orders if o["order_id"] == order_id), None)
    if order is None:
        return not_found(req, "shop", BRAND, HOME)
    lines = "".join(f"<li>{q} &times; {esc(world().by_sku[s].name)}</li>" for s, q in order["items"].items())
    body = (
        f"<h1>Order #{order_id} confirmed</h1><p>Your order has been placed.</p><ul>{lines}</ul>"
        f"<p>Total paid: <b>${order['total']:,.2f}</b></p><p>{link(HOME, 'Continue shopping')}</p>"
    )
    return _page(req, f"Order {order_id}", body)
