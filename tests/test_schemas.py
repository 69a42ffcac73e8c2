import pyarrow as pa
import pytest
from pydantic import ValidationError

from schemas import (
    EVENT_TYPES,
    Action,
    EpisodeStarted,
    EvaluationCompleted,
    GroupDropped,
    PolicyVersionLoaded,
    PolicyVersionPublished,
    RankMemory,
    RunStarted,
    TaskGroupDispatched,
    TrajectoryJudged,
    UpdateApplied,
    arrow_schema,
    decode_event,
    encode_event,
    events_to_table,
    table_to_events,
)
from schemas.columnar import columnar_table, decode_columnar, packed_fields

from samples import sample_group, sample_step

SHA = "ab" * 32


def one_of_each():
    events = list(sample_group("run", "g0", [SHA], group_size=2, steps=3, seed=1))
    events += [
        TaskGroupDispatched(
            run_id="run",
            group_id="g0",
            task_id="t",
            suite="shop",
            seed=3,
            group_size=2,
            horizon=10,
            dispatched_at_version=0,
        ),
        UpdateApplied(
            run_id="run",
            update_step=0,
            version_before=0,
            version_after=1,
            group_ids=["g0"],
            trajectory_ids=["g0-t0"],
            loss=0.5,
            grad_norm=1.25,
            stats={"clip_frac": 0.1},
            config_json="{}",
            weights_sha256=SHA,
            duration_s=2.0,
            world_size=2,
            memory=[
                RankMemory(rank=r, params_bytes=4, grads_bytes=4, optimizer_bytes=8, peak_bytes=100, device="cpu")
                for r in range(2)
            ],
        ),
        PolicyVersionPublished(
            run_id="run",
            version=1,
            checkpoint_uri="s3://awrl/ckpt/1",
            checkpoint_sha256=SHA,
            update_step=0,
            parent_version=0,
            update_ids=["u0"],
            push_s=0.02,
        ),
        PolicyVersionLoaded(
            run_id="run", version=1, checkpoint_sha256=SHA, delivery="push", load_s=0.05, since_published_s=0.3
        ),
        GroupDropped(run_id="run", group_id="g1", task_id="t", reason="stale", trainer_version=3, min_policy_version=0),
        TrajectoryJudged(
            run_id="run",
            trajectory_id="g0-t0",
            group_id="g0",
            task_id="t",
            judge="model",
            judge_version="1",
            gives_reward=True,
            success=True,
            reason="the red box was clicked",
            model="judge-7b",
            prompt_sha256=SHA,
            response_text='{"success": true, "reason": "the red box was clicked"}',
            latency_s=0.4,
            prompt_tokens=812,
            completion_tokens=19,
        ),
        EvaluationCompleted(
            run_id="run",
            stage="sft",
            eval_run_id="eval-1",
            policy_version=0,
            suite="sites",
            split="heldout",
            difficulty="easy",
            episodes=100,
            successes=37,
            ci95_low=0.28,
            ci95_high=0.47,
            train_s=120.0,
        ),
        RunStarted(
            run_id="run",
            command="run",
            config_json='{"mode": "async"}',
            argv=["awrl", "run"],
            package_version="0.1.0",
            host="h",
        ),
    ]
    return events


def test_every_event_type_is_covered():
    assert {type(e) for e in one_of_each()} == set(EVENT_TYPES)


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
def test_event_arrow_event_round_trip(cls, tmp_path):
    import pyarrow.parquet as pq

    events = [e for e in one_of_each() if type(e) is cls]
    table = events_to_table(events)
    assert table.schema == arrow_schema(cls)
    pq.write_table(table, tmp_path / "t.parquet")
    assert table_to_events(pq.read_table(tmp_path / "t.parquet"), cls) == events


def test_an_update_written_before_per_rank_memory_reads_back_with_none(tmp_path):
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    (update,) = [e for e in one_of_each() if isinstance(e, UpdateApplied)]
    pq.write_table(events_to_table([update]).drop_columns(["memory"]), tmp_path / "v3.parquet")  # a schema-3 file
    table = ds.dataset([str(tmp_path / "v3.parquet")], schema=arrow_schema(UpdateApplied)).to_table()
    assert table_to_events(table, UpdateApplied) == [update.model_copy(update={"memory": None})]


def test_arrow_schema_is_derived_from_the_model():
    schema = arrow_schema(type(sample_step("r", "g", "t", 0, SHA)))
    assert schema.field("memory").type == pa.map_(pa.string(), pa.string())
    assert schema.field("behave_logprobs").type == pa.list_(pa.float64())
    assert schema.field("action").type.get_field_index("mark") >= 0
    assert schema.field("error_class").nullable and not schema.field("step").nullable


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
def test_columnar_decoding_makes_the_same_table(cls):
    """The ledger's path (`decode_columnar`, packed arrays kept as bytes, then `columnar_table`) makes
    exactly the table of decoded events; packed fields sent as plain lists, and events built in Python,
    too."""
    events = [e for e in one_of_each() if type(e) is cls]
    expected = events_to_table(events)
    columnar = [decode_columnar(encode_event(e)) for e in events]
    assert columnar_table(columnar, cls).equals(expected, check_metadata=True)
    assert columnar_table(events, cls).equals(expected, check_metadata=True)
    if packed_fields(cls):
        as_lists = [
            decode_columnar(
                e.model_dump_json(exclude=set(packed_fields(cls))).replace(
                    "{", "{" + ",".join(f'"{f}":{getattr(e, f)}' for f in packed_fields(cls)) + ",", 1
                )
            )
            for e in events
        ]
        assert [len(e.response_token_ids) for e in as_lists] == [len(e.response_token_ids) for e in events]
        mixed = [as_lists[0], *columnar[1:-1], events[-1]]
        assert columnar_table(mixed, cls).equals(expected, check_metadata=True)
        assert columnar_table([], cls).equals(events_to_table([], cls), check_metadata=True)
        with pytest.raises(TypeError, match="other than"):
            columnar_table(
                [
                    EpisodeStarted(
                        run_id="r",
                        trajectory_id="t",
                        group_id="g",
                        task_id="t",
                        worker_id="w",
                        instruction="i",
                        horizon=1,
                        policy_version=0,
                    )
                ],
                cls,
            )


def test_json_round_trip_picks_the_class():
    for e in one_of_each():
        assert decode_event(encode_event(e)) == e


def test_events_are_frozen_and_strict():
    e = sample_step("r", "g", "t", 0, SHA)
    with pytest.raises(ValidationError):
        e.step = 3
    with pytest.raises(ValidationError, match="extra"):
        type(e).model_validate({**e.model_dump(), "pixels": "..."})


def test_token_fields_must_align():
    e = sample_step("r", "g", "t", 0, SHA, response_tokens=4)
    with pytest.raises(ValidationError, match="must have equal length"):
        type(e).model_validate({**e.model_dump(), "behave_logprobs": [0.0]})


def test_screenshot_hash_is_checked():
    e = sample_step("r", "g", "t", 0, SHA)
    with pytest.raises(ValidationError, match="screenshot_sha256"):
        type(e).model_validate({**e.model_dump(), "screenshot_sha256": "not-a-hash"})


@pytest.mark.parametrize(
    "args, missing",
    [
        ({"kind": "click", "x": 3}, "x and y, or mark"),
        ({"kind": "type"}, "text"),
        ({"kind": "goto"}, "url"),
        ({"kind": "scroll", "dx": 0}, "dy"),
    ],
)
def test_action_arguments_checked(args, missing):
    with pytest.raises(ValidationError, match=missing):
        Action(**args)


def test_click_by_mark_or_coordinates():
    assert Action(kind="click", mark=7).mark == 7
    assert Action(kind="click", x=1, y=2).x == 1


@pytest.mark.parametrize("run_id", ["../../escaped", "a/b", "", "run=1", ".hidden", "x" * 201])
def test_run_ids_that_would_escape_or_break_the_ledger_layout_are_invalid(run_id):
    """A run id becomes a ledger directory and a store prefix: path tricks must not validate."""
    with pytest.raises(ValidationError, match="run_id"):
        EpisodeStarted(
            run_id=run_id,
            trajectory_id="t",
            group_id="g",
            task_id="k",
            worker_id="w",
            instruction="i",
            horizon=1,
            policy_version=0,
        )


def test_an_int_beyond_int64_makes_an_invalid_event_not_a_row_the_ledger_cannot_write():
    e = TaskGroupDispatched(
        run_id="r",
        group_id="g",
        task_id="t",
        suite="s",
        seed=2**63 - 1,
        group_size=1,
        horizon=1,
        dispatched_at_version=0,
    )
    assert events_to_table([e]).column("seed").to_pylist() == [2**63 - 1]
    with pytest.raises(ValidationError, match="less than or equal to 9223372036854775807"):
        decode_event(encode_event(e).replace(b'"seed":9223372036854775807', b'"seed":9223372036854775808'))
    step = sample_step("r", "g", "t", 0, SHA, response_tokens=2).model_dump()
    with pytest.raises(ValidationError, match="response_token_ids.0"):  # the plain-list form of a packed field
        type(sample_step("r", "g", "t", 0, SHA)).model_validate({**step, "response_token_ids": [2**64, 1]})


def test_a_plain_int_field_has_no_arrow_mapping():
    from pydantic import BaseModel

    class Loose(BaseModel):
        n: int

    with pytest.raises(TypeError, match="Int64"):
        arrow_schema(Loose)
