"""kafka-python's IO loop, with `pipeline.kafka_waits` installed: a lost wake-up costs a second, not a
hang, and a request the loop never finishes ends in `KafkaTimeoutError` instead of blocking forever."""

import threading

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.future import Future
from kafka.net.selector import NetworkSelector

import pipeline.bus  # noqa: F401 - installs the bounded wait, as every client here gets it
from pipeline import kafka_waits


@pytest.fixture
def loop():
    net = NetworkSelector(client_id="test-waits")
    net.start()
    yield net
    net.__dict__.pop("wakeup", None)  # a test's lossy wake-up would keep close() from stopping the loop
    net.close()


def _in_thread(fn, within_s: float):
    out = {}
    t = threading.Thread(target=lambda: out.update(value=fn()), daemon=True)
    t.start()
    t.join(within_s)
    return out


def test_a_lost_wake_up_is_sent_again(loop):
    calls = []
    library_wakeup = loop.wakeup
    loop.wakeup = lambda: calls.append(1) if not calls else library_wakeup()  # drop the first
    out = _in_thread(lambda: loop.run(lambda: calls.append(0) or 42), within_s=10)
    assert out == {"value": 42} and calls[:2] == [1, 0]  # the request ran after the lost wake-up


def test_without_it_a_lost_wake_up_blocks_the_caller(loop):
    """The negative control: the library's own wait, with the same lost wake-up, does not return."""
    loop.wakeup = lambda: None
    out = _in_thread(lambda: kafka_waits._library_run(loop, lambda: 42), within_s=3)
    assert out == {}


def test_a_request_that_never_finishes_times_out(loop, monkeypatch):
    monkeypatch.setattr(kafka_waits, "BOUND_S", 2.0)
    out = _in_thread(lambda: pytest.raises(KafkaTimeoutError, loop.run, lambda: Future()), within_s=10)
    assert "value" in out and not loop._pending_waiters
