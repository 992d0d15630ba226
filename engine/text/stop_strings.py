"""Stop-string matching whose cost per character does not grow with the number of stop strings.

Why: scanning every stop string for every token of every candidate let one request with many stops stall the engine
thread for everyone (a request may send 32 stop strings of 256 characters). An Aho-Corasick automaton (built once per
distinct stop list) is fed each new character once: a match is found at the earliest position it ends, and the
automaton's state depth is exactly how much trailing text could still begin a stop string, so it is also the hold-back.
pyahocorasick matches whole strings only; it has no resumable state or depth for a text that arrives in pieces.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopAutomaton:
    """The trie of the stop strings with failure links (immutable; shared by every candidate of a request)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.match: list[str | None] = [None]  # the longest stop string ending at this state
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.match.append(None)
                state = nxt
            self.match[state] = stop
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())  # depth 1: failure goes to the root
        while queue:  # breadth first: a state's failure target (shallower) is always done before it
            state = queue.popleft()
            for ch, nxt in self.goto[state].items():
                back = self.fail[state]
                while back and ch not in self.goto[back]:
                    back = self.fail[back]
                self.fail[nxt] = self.goto[back].get(ch, 0)
                if self.match[nxt] is None:
                    self.match[nxt] = self.match[self.fail[nxt]]
                queue.append(nxt)

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


@lru_cache(maxsize=64)
def automaton_for(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


class StopMatcher:
    """One candidate's position in the automaton, fed text as it is released."""

    def __init__(self, stops: list[str]) -> None:
        self.automaton = automaton_for(tuple(stops))
        self.state = 0

    def feed(self, text: str, check: bool = True) -> tuple[int, str] | None:
        """Advance over `text`; with `check`, the first stop string ending in it: (its end in `text`, the stop).
        Matches ending while `check` is off are passed over (min_tokens), never reported later."""
        automaton = self.automaton
        for index, ch in enumerate(text):
            self.state = automaton.step(self.state, ch)
            stop = automaton.match[self.state]
            if check and stop is not None:
                return index + 1, stop
        return None

    @property
    def held(self) -> int:
        """How many trailing characters fed so far could still be the start of a stop string."""
        return self.automaton.depth[self.state]
