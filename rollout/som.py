"""Set-of-Mark grounding: number the visible interactive elements, draw the numbers, list them.

As in WebVoyager / BrowserGym: tiny models cannot yet read fine pixel detail, so in SoM mode the
screenshot carries numbered boxes and the prompt lists `[7] button "Add to cart"`; actions may name a
mark instead of coordinates. The marks are computed in every mode (the oracle and the environment
feedback use them); only SoM mode shows them to the model.
"""

from __future__ import annotations

import io

from PIL import Image, ImageDraw

from schemas.observation import Mark

MARK_ATTR = "data-awrl-mark"

_COLLECT_JS = """
(attr) => {
  const sel = 'a[href], button, input:not([type=hidden]), select, textarea, [role=button], [role=link],'
            + ' [role=tab], [role=checkbox], [role=option], [role=menuitem], [onclick], [contenteditable=true]';
  document.querySelectorAll('[' + attr + ']').forEach(e => e.removeAttribute(attr));
  const roleOf = (el) => {
    const r = el.getAttribute('role'); if (r) return r;
    const t = el.tagName.toLowerCase();
    if (t === 'a') return 'link';
    if (t === 'input') { const ty = (el.type || 'text').toLowerCase();
      return ['checkbox', 'radio', 'submit', 'button'].includes(ty) ? (ty === 'submit' ? 'button' : ty) : 'input'; }
    if (t === 'textarea') return 'input';
    return t;
  };
  const nameOf = (el) => {
    const label = el.labels && el.labels.length ? el.labels[0].innerText : '';
    const txt = el.getAttribute('aria-label') || label || el.getAttribute('placeholder')
      || el.innerText || el.value || el.getAttribute('title') || el.getAttribute('name') || el.id || '';
    return txt.replace(/\\s+/g, ' ').trim().slice(0, 60);
  };
  const out = [];
  for (const el of document.querySelectorAll(sel)) {
    const r = el.getBoundingClientRect();
    if (r.width < 2 || r.height < 2 || r.bottom < 0 || r.right < 0
        || r.top > innerHeight || r.left > innerWidth) continue;
    const st = getComputedStyle(el);
    if (st.visibility === 'hidden' || st.display === 'none' || st.opacity === '0') continue;
    const top = document.elementFromPoint(Math.min(r.left + r.width / 2, innerWidth - 1),
                                          Math.min(r.top + r.height / 2, innerHeight - 1));
    if (top && !(el === top || el.contains(top) || top.contains(el)
                 || (el.labels && [...el.labels].includes(top)))) continue;
    const id = out.length;
    el.setAttribute(attr, String(id));
    out.push({id, role: roleOf(el), name: nameOf(el), x: Math.round(r.left), y: Math.round(r.top),
              width: Math.round(r.width), height: Math.round(r.height)});
  }
  return out;
}
"""


async def collect_marks(page) -> list[Mark]:
    raw = await page.evaluate(_COLLECT_JS, MARK_ATTR)
    return [Mark(**m, selector=f'[{MARK_ATTR}="{m["id"]}"]') for m in raw]


def draw_marks(png: bytes, marks: list[Mark], scale: float = 1.0) -> bytes:
    """The screenshot with a box and the mark id on each element."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    d = ImageDraw.Draw(img)
    for m in marks:
        x, y, w, h = (int(v * scale) for v in (m.x, m.y, m.width, m.height))
        d.rectangle([x, y, x + w, y + h], outline=(230, 20, 20), width=2)
        label = str(m.id)
        d.rectangle([x, y, x + 7 * len(label) + 4, y + 12], fill=(230, 20, 20))
        d.text((x + 2, y), label, fill="white")
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def mark_list(marks: list[Mark]) -> str:
    return "\n".join(m.describe() for m in marks)
