"""The Triton glue's cancellation probe asks the server at most once per interval, and never forgets."""

from engine.triton.cancel_probe import CancelProbe


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

    probe = CancelProbe(check, interval_s=0.05, clock=clock)
    assert [probe() for _ in range(10)] == [False] * 10
    assert len(asked) == 1  # ten scheduler steps within one interval: one round trip
    state["cancelled"] = True
    assert probe() is False  # not asked again yet
    clock.now += 0.05
    assert probe() is True and len(asked) == 2
    state["cancelled"] = False
    clock.now += 1.0
    assert probe() is True and len(asked) == 2  # cancelled stays cancelled, without asking again
