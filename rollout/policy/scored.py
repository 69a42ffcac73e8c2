"""`ScoredPolicy`: a scripted policy's actions, as the token ids a model would emit, with that model's
log-probs. Its steps are ordinary `StepRecorded` events with prompt ids, response ids and log-probs,
so they are demonstrations the SFT warm start can clone, and (with a noisy script, where rewards
within a group differ) data the trainer can consume end to end.

The log-probs are the model's own probabilities of the scripted response (teacher forced through
`LocalPolicy.teacher_forced_logprobs`, the function the trainer scores with), so pi_prox / pi_behave
is exactly 1 while the weights have not moved. They are not the distribution the tokens were drawn
from: for RL proper, use the `local` or `vllm` backends.
"""

from __future__ import annotations

import asyncio
import random

from model.inputs import build_inputs, stop_token_ids
from model.prompt import render_prompt
from rollout.policy.local import LocalPolicy
from rollout.types import Policy
from schemas.observation import Observation, PolicyOutput


class ScoredPolicy:
    name = "scored"

    def __init__(self, script: Policy, model: LocalPolicy):
        self.script, self.model = script, model
        self._stop = min(stop_token_ids(model.tokenizer))

    @property
    def version(self) -> int:
        return self.model.version

    async def act(self, obs: Observation) -> PolicyOutput:
        scripted = await self.script.act(obs)
        text, images = render_prompt(obs, self.model.prompt_config)
        return await asyncio.to_thread(self.score, text, images, scripted.response_text)

    def score(self, text: str, images: list[bytes], response_text: str) -> PolicyOutput:
        tok = self.model.tokenizer
        prompt_ids = build_inputs(tok, text, images, self.model.image_processor)["input_ids"][0].tolist()
        response_ids = tok(response_text, add_special_tokens=False)["input_ids"] + [self._stop]
        version = self.model.version
        logprobs = self.model.teacher_forced_logprobs(prompt_ids, images, response_ids)
        return PolicyOutput(
            response_text=response_text,
            prompt_token_ids=prompt_ids,
            response_token_ids=response_ids,
            logprobs=logprobs,
            token_policy_versions=[version] * len(response_ids),
        )

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        await self.model.refresh(version, checkpoint_uri, checkpoint_sha256)

    @property
    def delivered(self) -> dict[int, str]:
        return self.model.delivered

    def close(self) -> None:
        self.model.close()


class NoisyPolicy:
    """Each step, the `expert`'s action with probability 1 - noise, else the `explorer`'s."""

    name = "noisy"

    def __init__(self, expert: Policy, explorer: Policy, noise: float, seed: int = 0):
        self.expert, self.explorer, self.noise = expert, explorer, noise
        self.rng = random.Random(seed)
        self.version = 0

    async def act(self, obs: Observation) -> PolicyOutput:
        return await (self.explorer if self.rng.random() < self.noise else self.expert).act(obs)

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        self.version = version
