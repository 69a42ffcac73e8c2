"""Observation -> chat prompt, shared by every learned backend (local transformers, vLLM).

`build_messages` gives OpenAI-style chat messages (text and image parts); `render_chat` turns them
into the Qwen chat format, and `CHAT_TEMPLATE` is the same rendering as Jinja, saved with the
tokenizer so that vLLM's chat endpoint builds byte-identical prompts from the same messages. Each
image becomes `<|vision_start|><|image_pad|><|vision_end|>`; the model's input builder expands the
single `<|image_pad|>` into one token per merged vision patch.

The prompt is kept compact for small models with short contexts: the last `history_steps` steps
only, long fields clipped, marks capped; the current memory is always shown in full.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from schemas.observation import Observation, PastStep

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

SYSTEM = (
    "You are a web agent. You see screenshots of a browser and act to complete the task.\n"
    "Reply with one JSON object and nothing else: "
    '{"thought": "...", "memory": {"key": "value"}, "action": {...}}\n'
    "memory: facts to remember for later steps (it is carried forward).\n"
    "action is one of:\n"
)
ACTIONS_PIXEL = '{"kind": "click", "x": 412, "y": 96}\n{"kind": "type", "text": "laptop"}\n'
ACTIONS_SOM = (
    '{"kind": "click", "mark": 7}\n'
    '{"kind": "click", "x": 412, "y": 96}\n'
    '{"kind": "type", "text": "laptop", "mark": 3}\n'
)
ACTIONS_COMMON = (
    '{"kind": "press", "key": "Enter"}\n'
    '{"kind": "scroll", "dx": 0, "dy": 400}\n'
    '{"kind": "goto", "url": "http://..."}\n'
    '{"kind": "answer", "text": "..."}\n'
    '{"kind": "stop"}\n'
)


@dataclass(frozen=True)
class PromptConfig:
    history_steps: int = 4
    """Earlier steps shown (most recent last); older ones are dropped, memory is not."""
    max_field_chars: int = 160
    """Clip for thought / feedback / action text of history steps and the current feedback."""
    max_marks: int = 40
    """Marks listed in Set-of-Mark mode (page order)."""


def render_prompt(obs: Observation, config: PromptConfig = PromptConfig()) -> tuple[str, list[bytes]]:
    """The chat-formatted prompt (ending with the assistant turn opener) and its images in order."""
    return render_chat(build_messages(obs, config)), list(obs.screenshots)


def build_messages(obs: Observation, config: PromptConfig = PromptConfig()) -> list[dict]:
    """System + user messages; image parts carry the PNG bytes under `"image"`."""
    actions = ACTIONS_SOM if obs.som else ACTIONS_PIXEL
    w, h = obs.viewport
    system = SYSTEM + actions + ACTIONS_COMMON + f"Coordinates are CSS pixels of the {w}x{h} viewport."
    parts: list[dict] = [{"type": "text", "text": f"Task: {_clean(obs.instruction)}\nScreenshots:"}]
    for png in obs.screenshots:
        parts.append({"type": "image", "image": png})
    parts.append({"type": "text", "text": "\n" + _user_text(obs, config)})
    return [{"role": "system", "content": system}, {"role": "user", "content": parts}]


def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Python twin of `CHAT_TEMPLATE` (a test checks they agree)."""
    out = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, str):
            body = content
        else:
            body = "".join(IMAGE_PLACEHOLDER if p["type"] in ("image", "image_url") else p["text"] for p in content)
        out.append(f"<|im_start|>{msg['role']}\n{body}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _user_text(obs: Observation, config: PromptConfig) -> str:
    lines = [f"Step {obs.step + 1} of {obs.horizon}. URL: {_clean(obs.url)}"]
    shown = obs.history[-config.history_steps :] if config.history_steps > 0 else []
    if shown:
        first = len(obs.history) - len(shown) + 1
        lines.append("Previous steps:")
        lines += [_past_line(first + i, s, config.max_field_chars) for i, s in enumerate(shown)]
    lines.append(f"Memory: {_json(obs.memory)}")
    if obs.feedback:
        lines.append(f"Feedback: {_clip(obs.feedback, config.max_field_chars)}")
    if obs.som:
        marks = obs.marks[: config.max_marks]
        lines.append("Marks:" if marks else "Marks: none")
        lines += [_clean(m.describe()) for m in marks]
        if len(obs.marks) > len(marks):
            lines.append(f"... {len(obs.marks) - len(marks)} more marks not listed")
    return "\n".join(lines)


def _past_line(index: int, step: PastStep, limit: int) -> str:
    return (
        f"{index}. thought: {_clip(step.thought, limit)} | action: {_clip(step.action, limit)}"
        f" | memory: {_json(step.memory, limit)} | feedback: {_clip(step.feedback, limit)}"
    )


def _json(memory: dict[str, str], limit: int | None = None) -> str:
    text = _clean(json.dumps(memory, ensure_ascii=False))
    return text if limit is None else _clip(text, limit)


def _clip(text: str, limit: int) -> str:
    text = _clean(text).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clean(text: str) -> str:
    # Page text must not smuggle control tokens (an `<|image_pad|>` would desync image features).
    return text.replace("<|", "< |")
