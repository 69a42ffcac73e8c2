"""`FormCenter` (`/forms/...`): one-page and multi-step forms with validation and a review step.

Forms are data (`FORMS`): steps of labelled fields. A step is validated when posted; errors are
shown next to the field and in a banner, and the typed values are kept. Multi-step forms end in a
review page whose "Submit" records `{"form", "ref", "values"}` in the session for the judge. Values
are keyed by `Field.name` (the label as a snake_case slug), which is also what task judges name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollout.suites.sites.web import Request, Response, esc, link, not_found, page, redirect
from rollout.suites.sites.world import slugify

HOME = "/forms/"
BRAND = "FormCenter"
COUNTRIES = (
    "Australia",
    "Brazil",
    "Canada",
    "Denmark",
    "Egypt",
    "France",
    "Germany",
    "India",
    "Japan",
    "Kenya",
    "Mexico",
    "Norway",
    "Portugal",
    "Spain",
    "Sweden",
    "United States",
)
TOPICS = ("Technology", "Travel", "Cooking", "Sports", "Finance", "Gardening")
REASONS = ("Arrived damaged", "Wrong item", "Too small", "Too large", "Changed my mind")
POSITIONS = ("Software Engineer", "Data Analyst", "Product Designer", "Support Specialist", "Sales Manager")
TICKETS = ("Standard", "Student", "VIP", "Workshop only")
DIETS = ("No preference", "Vegetarian", "Vegan", "Gluten-free", "Halal", "Kosher")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[A-Za-z]{2,}$")


@dataclass(frozen=True)
class Field:
    label: str
    kind: str = "text"
    """`text`, `email`, `tel`, `number`, `textarea`, `select` or `order` (ORD-12345)."""
    options: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return slugify(self.label).replace("-", "_")

    def error(self, value: str) -> str:
        """Why `value` is not acceptable, or ""."""
        if not value:
            return f"{self.label} is required."
        if self.kind == "email" and not _EMAIL.match(value):
            return "Enter a valid email address, like name@example.com."
        if self.kind == "tel" and (len(re.sub(r"\D", "", value)) < 7 or re.search(r"[^\d +()-]", value)):
            return "Enter a phone number with at least 7 digits."
        if self.kind == "number" and not (value.isdigit() and int(value) <= 99):
            return f"{self.label} must be a whole number from 0 to 99."
        if self.kind == "select" and value not in self.options:
            return f"Choose a {self.label.lower()} from the list."
        if self.kind == "order" and not re.fullmatch(r"ORD-\d{5}", value):
            return "Order numbers look like ORD-12345."
        return ""


@dataclass(frozen=True)
class FormDef:
    fid: str
    title: str
    intro: str
    steps: tuple[tuple[str, tuple[Field, ...]], ...]
    submit: str = "Submit"
    review: bool = True
    """Multi-step forms end with a review page; one-page forms submit directly."""

    @property
    def fields(self) -> list[Field]:
        return [f for _, fs in self.steps for f in fs]

    @property
    def n_pages(self) -> int:
        return len(self.steps) + (1 if self.review else 0)


NAME, EMAIL = Field("Full name"), Field("Email", "email")
ADDRESS = ("Address", (Field("Street address"), Field("City"), Field("Country", "select", COUNTRIES)))
FORMS = {
    f.fid: f
    for f in [
        FormDef(
            "contact",
            "Contact us",
            "Send us a message and we will reply by email.",
            (("Your message", (Field("Name"), EMAIL, Field("Message", "textarea"))),),
            "Send message",
            False,
        ),
        FormDef(
            "newsletter",
            "Newsletter sign-up",
            "One email a week about the topic you choose.",
            (("Subscribe", (EMAIL, Field("Topic", "select", TOPICS))),),
            "Subscribe",
            False,
        ),
        FormDef("signup", "Create an account", "Three short steps.", (("Your details", (NAME, EMAIL)), ADDRESS)),
        FormDef(
            "return",
            "Request a return",
            "Returns are free within 30 days.",
            (
                ("Your order", (Field("Order number", "order"), EMAIL)),
                ("Reason", (Field("Reason", "select", REASONS), Field("Comments", "textarea"))),
            ),
        ),
        FormDef(
            "job",
            "Job application",
            "Apply for an open position.",
            (
                ("About you", (NAME, EMAIL, Field("Phone", "tel"))),
                ADDRESS,
                ("The job", (Field("Position", "select", POSITIONS), Field("Years of experience", "number"))),
            ),
        ),
        FormDef(
            "event",
            "Event registration",
            "Register for the annual FormCon meeting.",
            (
                ("Attendee", (NAME, EMAIL)),
                (
                    "Tickets",
                    (
                        Field("Ticket type", "select", TICKETS),
                        Field("Dietary preference", "select", DIETS),
                        Field("Number of guests", "number"),
                    ),
                ),
                ("Billing address", ADDRESS[1]),
            ),
        ),
    ]
}


def handle(req: Request) -> Response:
    parts = [p for p in req.path.split("/") if p][1:]
    if not parts and req.method == "GET":
        return _index(req)
    form = FORMS.get(parts[0]) if parts else None
    if form is None:
        return not_found(req, "forms", BRAND, HOME)
    if parts[1:] == ["submit"] and req.method == "POST":
        return _submit(req, form)
    if parts[1:] == ["done"]:
        return _done(req, form)
    if parts[1:]:
        return not_found(req, "forms", BRAND, HOME)
    step = int(req.query["step"]) if req.query.get("step", "").isdigit() else 1
    step = min(max(step, 1), form.n_pages)
    return _post_step(req, form, step) if req.method == "POST" else _get_step(req, form, step)


def _page(req: Request, title: str, body: str) -> Response:
    return page(req, site="forms", brand=BRAND, home=HOME, title=title, body=body, extra=link(HOME, "All forms"))


def _index(req: Request) -> Response:
    items = "".join(
        f"<li>{link(HOME + f.fid, f.title)} <span class='muted'>{esc(f.intro)}</span></li>" for f in FORMS.values()
    )
    return _page(req, "All forms", f"<h1>Forms</h1><p>Choose a form to fill in.</p><ul>{items}</ul>")


def _draft(req: Request, form: FormDef) -> dict[str, str]:
    return req.session.drafts.setdefault(form.fid, {})


def _first_invalid(form: FormDef, values: dict[str, str]) -> int | None:
    for i, (_, fields) in enumerate(form.steps, 1):
        if any(f.error(values.get(f.name, "")) for f in fields):
            return i
    return None


def _get_step(req: Request, form: FormDef, step: int) -> Response:
    bad = _first_invalid(form, _draft(req, form))
    if bad is not None and bad < step:  # steps cannot be skipped
        return redirect(f"{HOME}{form.fid}?step={bad}")
    return _render(req, form, step, _draft(req, form), {})


def _post_step(req: Request, form: FormDef, step: int) -> Response:
    if step > len(form.steps):
        return redirect(f"{HOME}{form.fid}?step={step}")
    fields = form.steps[step - 1][1]
    values = {
        f.name: " ".join(req.form.get(f.name, "").split()) if f.kind != "textarea" else req.form.get(f.name, "").strip()
        for f in fields
    }
    _draft(req, form).update(values)
    errors = {f.name: e for f in fields if (e := f.error(values[f.name]))}
    if errors:
        return _render(req, form, step, _draft(req, form), errors)
    if step < form.n_pages:
        return redirect(f"{HOME}{form.fid}?step={step + 1}")
    return _submit(req, form)


def _submit(req: Request, form: FormDef) -> Response:
    values = _draft(req, form)
    bad = _first_invalid(form, values)
    if bad is not None:
        req.session.say("Some answers are missing or invalid; please check this step.", "error")
        return redirect(f"{HOME}{form.fid}?step={bad}")
    ref = str(5001 + len(req.session.submissions))
    record = {f.name: values[f.name] for f in form.fields}
    req.session.submissions.append({"form": form.fid, "ref": ref, "values": record})
    req.session.drafts.pop(form.fid, None)
    req.session.say(f"Thank you! Your form was submitted. Reference number {ref}.")
    return redirect(f"{HOME}{form.fid}/done?ref={ref}")


def _done(req: Request, form: FormDef) -> Response:
    sub = next((s for s in req.session.submissions if s["ref"] == req.query.get("ref")), None)
    if sub is None or sub["form"] != form.fid:
        return not_found(req, "forms", BRAND, HOME)
    body = (
        f"<h1>{esc(form.title)}: submitted</h1><p>We received your answers (reference {sub['ref']}).</p>"
        f"{_summary(form, sub['values'])}<p>{link(HOME, 'Back to all forms')}</p>"
    )
    return _page(req, "Submitted", body)


def _summary(form: FormDef, values: dict[str, str]) -> str:
    rows = "".join(f"<tr><th>{esc(f.label)}</th><td>{esc(values.get(f.name, ''))}</td></tr>" for f in form.fields)
    return f"<table>{rows}</table>"


def _widget(f: Field, value: str) -> str:
    attrs = f'id="{f.name}" name="{f.name}"'
    if f.kind == "textarea":
        return f"<textarea {attrs}>{esc(value)}</textarea>"
    if f.kind == "select":
        opts = "".join(f"<option{' selected' if o == value else ''}>{esc(o)}</option>" for o in f.options)
        return f'<select {attrs}><option value="">Choose...</option>{opts}</select>'
    kind = {"email": "email", "tel": "tel"}.get(f.kind, "text")
    return f'<input type="{kind}" {attrs} value="{esc(value)}">'


def _render(req: Request, form: FormDef, step: int, values: dict[str, str], errors: dict[str, str]) -> Response:
    review = step > len(form.steps)
    name = "Review your answers" if review else form.steps[step - 1][0]
    intro = f"<p class='muted'>{esc(form.intro)}</p>" if step == 1 else ""
    head = f"<h1>{esc(form.title)}</h1>{intro}<p><b>Step {step} of {form.n_pages}: {esc(name)}</b></p>"
    if errors:
        head += '<div class="flash error" role="alert">Please fix the errors below.</div>'
    back = link(f"{HOME}{form.fid}?step={step - 1}", "Back") if step > 1 else ""
    if review:
        body = (
            f"<p>Check your answers, then press Submit.</p>{_summary(form, values)}"
            f"<form method='post' action='{HOME}{form.fid}/submit' class='actions'>"
            f"{back}<button type='submit'>Submit</button></form>"
        )
        return _page(req, form.title, head + body)
    fields = "".join(
        f'<div class="field"><label for="{f.name}">{esc(f.label)}</label>{_widget(f, values.get(f.name, ""))}'
        + (f'<div class="error">{esc(errors[f.name])}</div>' if f.name in errors else "")
        + "</div>"
        for f in form.steps[step - 1][1]
    )
    button = "Next" if step < form.n_pages else form.submit
    # novalidate: the server's messages (shown in the screenshot) are the only validation.
    body = (
        f'<form method="post" action="{HOME}{form.fid}?step={step}" novalidate>{fields}'
        f'<div class="actions">{back}<button type="submit">{esc(button)}</button></div></form>'
    )
    return _page(req, form.title, head + body)
