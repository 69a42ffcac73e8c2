"""The rollout pool's open-episode journal (`rollout.episode_journal`): written ahead of each send, so
a process killed between its journal and its send leaves nothing the reaper does not know of.

Here the journal alone, read back as a reaper reads it; `tests/test_faults.py` sends a dead process's
journal through the real broker into the ledger, and kills a real pool process mid-episode.
"""

from __future__ import annotations

import os

from rollout.episode_journal import EpisodeJournal, orphans, reap
from schemas import EpisodeFinished, EpisodeStarted, StepRecorded

from samples import sample_episode

RUN = "journal-test"


def _episodes(n: int = 3, steps: int = 3) -> list[list]:
    """`n` episodes' events, in the order a pool sends them: started, `steps` steps, finished."""
    return [sample_episode(RUN, "g", f"t{i}", steps, "0" * 64) for i in range(n)]


def _dead(journal: EpisodeJournal) -> os.PathLike:
    """The journal as a reaper finds it once its process is gone: closed, its owner not running."""
    journal._file.close()
    dead = journal.path.with_name("1-0.00.jsonl")  # pid 1 never started at time 0: not alive
    journal.path.rename(dead)
    return dead


def test_a_step_journaled_and_not_sent_is_sent_by_the_reaper_and_counted_in_the_ending(tmp_path):
    journal = EpisodeJournal(tmp_path)
    started, first, second = _episodes(1)[0][:3]
    for e in (started, first):
        journal.record(e), journal.sent(e)
    journal.record(second)  # killed here: journaled, not sent
    again = orphans(_dead(journal))
    assert [e.event_id for e in again[:3]] == [started.event_id, first.event_id, second.event_id]
    ending = again[3]
    assert isinstance(ending, EpisodeFinished) and ending.outcome == "env_error" and ending.num_steps == 2
    assert "rollout process 1 died mid-episode" in ending.reason and len(again) == 4


def test_an_ending_journaled_is_sent_as_it_was_and_one_sent_closes_its_episode(tmp_path):
    journal = EpisodeJournal(tmp_path)
    closed, unsent = _episodes(2)
    for e in closed:
        journal.record(e), journal.sent(e)
    for e in unsent:
        journal.record(e)
    journal.sent(unsent[-2])  # a step's send closes nothing; the ending's send never happened
    again = orphans(_dead(journal))
    # the episode whose ending was sent is not sent again; the other is, with its own ending (same id),
    # not an env_error one: two endings of one trajectory would be two different event ids
    assert [e.event_id for e in again] == [e.event_id for e in unsent]
    assert isinstance(again[-1], EpisodeFinished) and again[-1].outcome != "env_error"


def test_a_line_cut_short_by_the_kill_is_an_event_never_sent(tmp_path):
    journal = EpisodeJournal(tmp_path)
    started, first = _episodes(1)[0][:2]
    journal.record(started)
    journal._file.write("E " + first.model_dump_json()[:50])  # the process died mid-write
    again = orphans(_dead(journal))
    assert [type(e) for e in again] == [EpisodeStarted, EpisodeFinished] and again[-1].num_steps == 0


def test_the_journal_is_rewritten_to_its_open_episodes_and_reads_the_same(tmp_path):
    journal = EpisodeJournal(tmp_path, compact_bytes=20_000)
    episodes = _episodes(6)
    for e in [e for ep in episodes[:5] for e in ep]:  # five episodes sent whole
        journal.record(e), journal.sent(e)
    for e in episodes[5][:3]:  # the sixth open: started, two steps
        journal.record(e)
    sent_bytes = sum(len(e.model_dump_json()) for ep in episodes[:5] for e in ep)
    assert sent_bytes > 3 * 20_000, "the test must write enough to rewrite the journal"
    assert journal.path.stat().st_size < 20_000 + sent_bytes // 5  # rewritten, not grown
    again = orphans(_dead(journal))
    assert [e.event_id for e in again[:3]] == [e.event_id for e in episodes[5][:3]]
    assert again[-1].num_steps == 2 and len(again) == 4
    assert sum(isinstance(e, StepRecorded) for e in again) == 2


def test_reap_sends_each_dead_journal_once_and_leaves_the_living(tmp_path):
    mine = EpisodeJournal(tmp_path)  # this process: alive, never claimed
    mine.record(_episodes(1)[0][0])
    dead = EpisodeJournal(tmp_path / "x")
    for e in _episodes(2)[1][:2]:
        dead.record(e)
    _dead(dead).rename(tmp_path / "1-0.00.jsonl")
    (tmp_path / "1-0.00.jsonl.part").write_text("a rewrite its process never finished")
    sent: list = []
    assert reap(tmp_path, sent.extend) == 1 and len(sent) == 3
    assert reap(tmp_path, sent.extend) == 0 and len(sent) == 3
    assert mine.path.exists() and not list(tmp_path.glob("1-*"))
