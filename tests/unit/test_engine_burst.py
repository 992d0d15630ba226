"""An idle engine gathers a burst of requests into its first step (engine.core.inbox): requests that arrive a few
milliseconds apart are prefilled together instead of the first alone and the rest one step later."""

from __future__ import annotations

import threading
import time

import pytest

from engine.core.inbox import Inbox
from engine.errors import QueueFull
from engine.sampling_params import SamplingParams
from tests.unit.conftest import MODEL_DIR, _require_model


def _arrive_every(inbox: Inbox, gap_s: float, count: int, stop: threading.Event | None = None) -> threading.Thread:
    def run() -> None:
        for i in range(count):
            if stop is not None and stop.wait(gap_s):
                return
            if stop is None:
                time.sleep(gap_s)
            inbox.put(f"r{i}", room=count + 1)  # the inbox only moves requests; it never looks inside them

    thread = threading.Thread(target=run)
    thread.start()
    return thread


# These time real waits, so each bound is set against the scripted length of the wrong behaviour, with room for
# a stalled 2-core box: a lower bound where the wait must happen, an upper bound at a fraction of the wait that
# a broken inbox would make.


def test_a_lone_request_waits_only_the_quiet_time_not_the_window():
    inbox = Inbox(window_s=60.0, quiet_s=0.05)
    inbox.put("alone", room=1)
    t0 = time.monotonic()
    inbox.gather_burst()
    assert time.monotonic() - t0 < 30.0  # quiet after 0.05 s; waiting out the 60 s window would fail this
    assert list(inbox.take()) == ["alone"]


def test_a_burst_is_gathered_until_it_goes_quiet():
    inbox = Inbox(window_s=60.0, quiet_s=1.0)
    inbox.put("first", room=6)
    arrivals = _arrive_every(inbox, 0.02, 5)  # far inside the quiet time of each other
    inbox.gather_burst()
    arrivals.join()
    assert list(inbox.take()) == ["first", "r0", "r1", "r2", "r3", "r4"]


def test_a_steady_trickle_is_cut_off_by_the_window():
    # never quiet for 30 s: without the window the wait would last until the trickle ended, 3 s plus 30 s
    inbox = Inbox(window_s=0.3, quiet_s=30.0)
    stop = threading.Event()
    arrivals = _arrive_every(inbox, 0.05, 60, stop)
    t0 = time.monotonic()
    inbox.gather_burst()
    waited = time.monotonic() - t0
    stop.set()
    arrivals.join()
    assert 0.25 < waited < 15.0
    taken = list(inbox.take())
    assert 0 < len(taken) < 60  # the step starts with what came, not with the whole trickle


def test_no_window_means_no_wait():
    inbox = Inbox()  # nothing ever arrives: an inbox that waited for a burst would never return
    done = threading.Thread(target=inbox.gather_burst, daemon=True)
    done.start()
    done.join(timeout=30)
    assert not done.is_alive()


def test_a_full_inbox_refuses_at_once():
    inbox = Inbox()
    inbox.put("a", room=2)
    inbox.put("b", room=2)
    with pytest.raises(QueueFull):
        inbox.put("c", room=2)
    assert inbox.pending == 2
    assert list(inbox.take()) == ["a", "b"] and inbox.pending == 0


def test_the_first_step_after_idling_takes_the_whole_burst():
    """The second request comes 30 ms after the first, long after the loop woke for the first. Before the
    inbox gathered bursts, the first step prefilled the first request alone. The quiet time (2 s) is far longer
    than that gap, so a box that stalls the test thread for a second still delivers both to the first step."""
    _require_model()
    from engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=4, max_len=64, threads=2,
                                    burst_window_ms=20_000, burst_quiet_ms=2_000))
    first_step_saw: list[int] = []
    step = engine.core.step

    def counting_step() -> None:
        if not first_step_saw:
            first_step_saw.append(len(engine.core.scheduler.waiting))
        step()

    engine.core.step = counting_step
    engine.start()
    try:
        ids = engine.encode_prompt(prompt="Hello")
        outs = [engine.generate("a", ids, SamplingParams(max_tokens=2))]
        time.sleep(0.03)
        outs.append(engine.generate("b", ids, SamplingParams(max_tokens=2)))
        for out in outs:
            while not out.get(timeout=30).final:
                pass
        assert first_step_saw == [2]
    finally:
        engine.stop()
