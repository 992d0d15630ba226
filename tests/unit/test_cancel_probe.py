"""The Triton glue's cancellation probe asks the server at most once per interval, never forgets, and its
interval grows with the live requests so that all their round trips together stay under a fixed rate."""

from engine.triton.cancel_probe import CallStops, CancelProbe, ProbeRate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_asks_at_most_once_per_interval_and_latches():
    clock, asked, state = Clock(), [], {"cancelled": False}

    def check() -> bool:
        asked.append(clock.now)
        return state["cancelled"]

    probe = CancelProbe(check, ProbeRate(lambda: 1, rate_per_s=50, min_interval_s=0.1), clock=clock)
    assert [probe() for _ in range(10)] == [False] * 10
    assert len(asked) == 1  # ten scheduler steps within one interval: one round trip
    state["cancelled"] = True
    assert probe() is False  # not asked again yet
    clock.now += 0.1
    assert probe() is True and len(asked) == 2
    state["cancelled"] = False
    clock.now += 1.0
    assert probe() is True and len(asked) == 2  # cancelled stays cancelled, without asking again


def test_the_round_trips_of_all_live_requests_stay_under_the_rate():
    """16 live requests asked at every 60 ms step for 10 s: 20 round trips a second in all at most (the fixed
    50 ms interval this replaces made 320), and every request is still asked, each about every 0.8 s."""
    clock, live = Clock(), 16
    asked = [0] * live
    rate = ProbeRate(lambda: live, rate_per_s=20, min_interval_s=0.1)

    def check_of(i: int):
        def check() -> bool:
            asked[i] += 1
            return False
        return check

    probes = [CancelProbe(check_of(i), rate, clock=clock) for i in range(live)]
    steps = int(10 / 0.06)
    for _ in range(steps):
        for probe in probes:
            probe()
        clock.now += 0.06
    assert sum(asked) <= 20 * 10 + live
    assert min(asked) >= 10 / 0.84  # each asked about every 0.8 s (a multiple of the 60 ms step: 0.84)
    assert max(asked) - min(asked) <= 1  # fair: the scheduler's fixed order favours no one


def test_a_lone_request_is_asked_every_tenth_of_a_second():
    assert ProbeRate(lambda: 1).interval() == 0.1
    assert ProbeRate(lambda: 0).interval() == 0.1
    assert ProbeRate(lambda: 64).interval() == 64 / 20


def test_a_stop_request_cancels_the_named_call_at_once_and_no_other():
    """The gateway's stop request (contract/stop_call.py) needs no round trip and reaches only the call it names."""
    clock, asked = Clock(), []
    rate = ProbeRate(lambda: 2, rate_per_s=1, min_interval_s=10)

    def check() -> bool:
        asked.append(clock.now)
        return False

    stops, mine, other = CallStops(), CancelProbe(check, rate, clock=clock), CancelProbe(check, rate, clock=clock)
    stops.add("call-a", mine)
    stops.add("call-b", other)
    assert mine() is False and other() is False and len(asked) == 2  # each asked once; the next ask is 10 s away
    assert stops.stop("call-a") is True
    assert mine() is True and other() is False and len(asked) == 2  # at once, with no round trip
    stops.discard("call-a")  # its final response went out
    assert stops.stop("call-a") is False and stops.stop("never-seen") is False and len(stops) == 1
    stops.discard(None)  # a request that carried no call id
    assert len(stops) == 1
