"""SFT warm start from demonstrations in the ledger: the demonstrated responses become more likely."""

from __future__ import annotations

import uuid

from pipeline.ledger import LedgerWriter
from pipeline.store import ScreenshotStore
from rollout.policy.local import LocalPolicy
from trainer.sft import SFTConfig, demonstrations, train_sft

from test_train_resume import publish_groups


def test_sft_clones_successful_demonstrations_from_the_ledger(settings, tmp_path):
    run_id = f"demo-{uuid.uuid4().hex[:6]}"
    publish_groups(settings, run_id, 3)  # 3 successes and 3 failures, one step each
    settings = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(settings).sync(idle_exit_s=2)
    demos = demonstrations(settings, [run_id])
    assert len(demos) == 3 and all(d.success for d in demos)  # failures are not cloned

    result = train_sft(
        settings, SFTConfig(run_ids=[run_id], out_dir=tmp_path / "sft", epochs=15, lr=3e-3, batch_steps=3)
    )
    assert len(result.losses) == 15
    assert result.losses[-1] < 0.5 * result.losses[0]
    # the saved model gives the demonstrated responses a higher likelihood than before
    before, after = LocalPolicy(seed=0), LocalPolicy(result.out_dir, seed=0)
    store_get = ScreenshotStore.from_settings(settings).get
    for d in demos:
        images = [store_get(h) for h in d.screenshot_sha256]
        lp0 = sum(before.teacher_forced_logprobs(d.prompt_token_ids, images, d.response_token_ids))
        lp1 = sum(after.teacher_forced_logprobs(d.prompt_token_ids, images, d.response_token_ids))
        assert lp1 > lp0
