"""The tokenizer the project trains itself (no hub downloads are possible): a byte-level BPE with
Qwen2's pre-tokenizer regex and Qwen's special tokens, trained in about a second on a corpus this
module generates (rendered prompts of synthetic pages, JSON actions, web words); deterministic and
cached by corpus hash. A real Qwen3-VL checkpoint brings its own tokenizer instead (`model.hf_io`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from pathlib import Path

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from model.prompt import CHAT_TEMPLATE, render_prompt
from pipeline.files import write_atomic
from schemas.observation import Mark, Observation, PastStep

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
"""The only special tokens a response may contain (as its last token); all others are suppressed."""
# Qwen2's pre-tokenizer: digits split one by one, which keeps coordinates learnable with a small vocabulary.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
VOCAB_SIZE = 4096
MAX_LENGTH = 8192
"""Longest sequence (tokens) the tokenizer declares; the tiny model's context."""

HOME = Path(os.environ.get("AWRL_HOME", Path(__file__).resolve().parents[1] / ".awrl"))
"""Where the project keeps its models and caches (`.awrl` in the checkout)."""

WORDS = """
home search results cart checkout login logout sign in up account profile settings help about contact
price total quantity add remove update save cancel submit next previous back page menu filter sort by
name email password address city country phone date time order orders item items product products
laptop phone shoes shirt book books camera headphones keyboard mouse monitor table chair lamp coffee
red blue green black white small medium large new used sale free shipping delivery returns review
reviews rating stars category categories brand color size in stock out of stock buy now wishlist
article wiki history science city population capital river mountain country language year born
died president founded located known famous first last title author published edition chapter
form field required optional select option checkbox radio button link input text area upload file
enter the value of a for to on with and or not is are was were this that which what who where when
how many much find show list open close click type press scroll go answer stop done task step
user username message inbox compose send reply forward delete archive folder label subject body
flight hotel booking from depart return passengers room guests check map route distance weather
""".split()
ROLES = ["button", "link", "input", "select", "checkbox", "textbox", "option", "tab"]
KEYS = ["Enter", "Tab", "Escape", "Backspace", "ArrowDown", "ArrowUp", "PageDown"]


def train_tokenizer(vocab_size: int = VOCAB_SIZE, cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """Train (or load from cache) the byte-level BPE tokenizer; same corpus -> same vocabulary."""
    corpus = build_corpus()
    key = hashlib.sha256("\n".join([tokenizers.__version__, str(vocab_size), *corpus]).encode()).hexdigest()
    cache = (cache_dir or HOME / "cache") / f"tokenizer-{key[:16]}.json"
    if cache.exists():
        tok = Tokenizer.from_file(str(cache))
    else:
        tok = _train_bpe(corpus, vocab_size)
        write_atomic(cache, tok.to_str())
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        model_max_length=MAX_LENGTH,
    )  # fmt: skip
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _train_bpe(corpus: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    return tok


def build_corpus(n_prompts: int = 300, seed: int = 0) -> list[str]:
    """Rendered prompts of synthetic observations plus JSON responses: the text the model will see."""
    rng = random.Random(seed)
    broad = WORDS + _broad_words()
    texts = [_page_text(rng, broad) for _ in range(n_prompts * 4)]
    for i in range(n_prompts):
        text, _ = render_prompt(_synthetic_observation(rng, som=i % 2 == 0))
        texts.append(text)
        texts.extend(_synthetic_response(rng) for _ in range(4))
    # Special tokens are never split by the trained tokenizer; left in, they would waste merges.
    return [re.sub(r"<\|[a-z_]+\|>", "\n", t) for t in texts]


def _phrase(rng: random.Random, lo: int = 2, hi: int = 8, words: list[str] = WORDS) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))


def _page_text(rng: random.Random, words: list[str]) -> str:
    """Web-page-like lines: title-cased labels, sentences, prices and dates."""
    lines = [_phrase(rng, 1, 3, words).title() for _ in range(4)]
    lines += [_phrase(rng, 6, 16, words).capitalize() + "." for _ in range(3)]
    price = f"${rng.randint(1, 999)}.{rng.randint(0, 99):02d}"
    lines.append(f"{price} - {rng.randint(1, 28)}/{rng.randint(1, 12)}/20{rng.randint(10, 29)}")
    return "\n".join(lines)


def _broad_words() -> list[str]:
    """English words from the quoted strings of MiniWoB++'s task pages (a pinned dependency, so the
    list, hence the tokenizer, is reproducible): names, cities, e-mail and form text."""
    try:
        import miniwob  # here: only building the tokenizer reads it, and a model-only install may lack it
    except ImportError:
        return []
    counts: dict[str, int] = {}
    for path in sorted((Path(miniwob.__file__).parent / "html").rglob("*")):
        if path.suffix not in (".html", ".js") or ".min." in path.name or "jquery" in str(path):
            continue
        for literal in re.findall(r'"([^"\n]{1,200})"|\'([^\'\n]{1,200})\'', path.read_text(errors="ignore")):
            text = literal[0] or literal[1]
            # Prose, or one capitalised word (names, cities, months); not code, markup or identifiers.
            if re.search(r"[{}();=<>]", text) or (" " not in text and not re.fullmatch(r"[A-Z][a-z]{2,14}", text)):
                continue
            for word in re.findall(r"\b[A-Za-z][a-z]{2,14}\b", text):
                counts[word.lower()] = counts.get(word.lower(), 0) + 1
    return sorted(w for w, n in counts.items() if n >= 2)


def _synthetic_observation(rng: random.Random, som: bool) -> Observation:
    marks = [
        Mark(i, rng.choice(ROLES), _phrase(rng, 1, 3).title(), rng.randrange(1280), rng.randrange(720), 80, 24)
        for i in range(1, rng.randint(3, 25))
    ]
    history = [
        PastStep(_phrase(rng), {"note": _phrase(rng, 1, 3)}, _synthetic_action(rng), _phrase(rng, 0, 6))
        for _ in range(rng.randint(0, 5))
    ]
    path = "/".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    return Observation(
        instruction=_phrase(rng, 5, 14).capitalize() + ".", screenshots=[b""], screenshot_sha256=[""],
        url=f"http://127.0.0.1:{rng.randint(8000, 9999)}/{path}?q={rng.choice(WORDS)}", feedback=_phrase(rng, 0, 8),
        history=history, memory={rng.choice(WORDS): _phrase(rng, 1, 4)}, marks=marks, som=som,
        step=len(history), horizon=rng.choice([10, 20, 30]),
    )  # fmt: skip


def _synthetic_action(rng: random.Random) -> str:
    kind = rng.choice(["click", "click_mark", "type", "press", "scroll", "goto", "answer", "stop"])
    action: dict = {
        "click": lambda: {"kind": "click", "x": rng.randrange(1280), "y": rng.randrange(720)},
        "click_mark": lambda: {"kind": "click", "mark": rng.randint(1, 40)},
        "type": lambda: {"kind": "type", "text": _phrase(rng, 1, 3), "mark": rng.randint(1, 40)},
        "press": lambda: {"kind": "press", "key": rng.choice(KEYS)},
        "scroll": lambda: {"kind": "scroll", "dx": 0, "dy": rng.choice([-400, -300, 300, 400])},
        "goto": lambda: {"kind": "goto", "url": f"http://127.0.0.1:8000/{rng.choice(WORDS)}"},
        "answer": lambda: {"kind": "answer", "text": _phrase(rng, 1, 4)},
        "stop": lambda: {"kind": "stop"},
    }[kind]()
    return json.dumps(action)


def _synthetic_response(rng: random.Random) -> str:
    memory = {rng.choice(WORDS): _phrase(rng, 1, 4)}
    action = json.loads(_synthetic_action(rng))
    return json.dumps({"thought": _phrase(rng, 3, 12), "memory": memory, "action": action})
