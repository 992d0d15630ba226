"""The scheduler under random traffic, without a model (hypothesis' stateful testing): random arrivals with shared
prefixes, adapters, n and best_of, prompt and output lengths, priorities and tenants under each scheduling policy;
cancellations at any point; tiny pools and budgets.

After every step the scheduler checks its invariants (every live request's candidates each in exactly one place,
reference counts equal to the references, free + idle + held = the pool) and the harness checks the plan the
runner gets (tests/unit/scheduler_harness.py). At the end every request has ended with one final output and the
pool is whole. A candidate's tokens are a function of how many it had, so a token sampled twice or skipped across
a preemption would show as a wrong sequence.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.errors import EngineError

from .scheduler_harness import add, assert_pool_whole, prompt_of, scheduler, step, token_for, until_idle

PREFIXES = [prompt_of(f"system-{i}", 16 * (i + 1) + 5) for i in range(3)]  # shared system prompts
COVERAGE = {"steps": 0, "requests": 0, "preemptions": 0, "cancelled": 0}


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(slots=st.integers(2, 8), blocks=st.integers(8, 40), extra_budget=st.integers(0, 120),
                prefix_cache=st.booleans(), partial=st.integers(1, 3),
                policy=st.sampled_from(["fcfs", "fcfs", "priority", "fair"]))
    def start(self, slots, blocks, extra_budget, prefix_cache, partial, policy):
        self.sched = scheduler(slots=slots, max_len=256, blocks=blocks, budget=slots + extra_budget,
                               prefix_cache=prefix_cache, partial=partial, policy=policy)
        self.outputs: dict[str, list] = {}
        self.cancelled: set[str] = set()
        self.count = 0

    @rule(prefix=st.integers(-1, 2), suffix=st.integers(1, 60), max_tokens=st.integers(1, 120),
          width=st.sampled_from([(1, None), (1, None), (2, None), (1, 3), (2, 2)]),
          adapter=st.sampled_from([None, None, "a1", "a2"]), priority=st.sampled_from([0, 0, -1, 2]),
          tenant=st.sampled_from([None, "t1", "t2"]))
    def arrive(self, prefix, suffix, max_tokens, width, adapter, priority, tenant):
        name = f"r{self.count}"
        self.count += 1
        tokens = (PREFIXES[prefix] if prefix >= 0 else []) + prompt_of(name, suffix)
        max_tokens = min(max_tokens, 256 - len(tokens))
        try:
            self.outputs[name] = add(self.sched, name, tokens, max_tokens=max_tokens, n=width[0], best_of=width[1],
                                     adapter=adapter, cancelled=lambda name=name: name in self.cancelled,
                                     priority=priority, tenant=tenant)
        except EngineError:
            return  # what could never run on this engine is refused at once (tests/unit/test_engine_admission.py)
        COVERAGE["requests"] += 1

    @precondition(lambda self: self.outputs)
    @rule(data=st.data())
    def cancel(self, data):
        name = data.draw(st.sampled_from(sorted(self.outputs)))
        self.cancelled.add(name)

    @rule(steps=st.integers(1, 12))
    def run_steps(self, steps):
        for _ in range(steps):
            before = self.sched.stats.preemptions
            step(self.sched)
            COVERAGE["steps"] += 1
            COVERAGE["preemptions"] += self.sched.stats.preemptions - before

    @invariant()
    def tokens_follow_their_candidates(self):
        for group in self.sched.requests.values():
            for seq in group.sequences:
                assert len(seq.output_ids) <= seq.params.max_tokens
                assert seq.output_ids == [token_for(seq, i) for i in range(len(seq.output_ids))]

    @invariant()
    def counters_add_up(self):
        stats = self.sched.stats
        assert stats.prefix_hits <= stats.prefix_queries

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        COVERAGE["steps"] += until_idle(self.sched)
        COVERAGE["cancelled"] += self.sched.stats.cancelled
        for name, outputs in self.outputs.items():
            finals = [out for out in outputs if out.final]
            assert len(finals) == 1, f"{name} ended {len(finals)} times"
            assert finals[0].finish_reason in ({"length", "cancelled"} if name in self.cancelled else {"length"})
        assert_pool_whole(self.sched)


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_scheduler_under_random_traffic = SchedulerMachine.TestCase


def test_the_random_traffic_covered_thousands_of_steps():
    """Runs after the machine above (same module, file order): what it covered, so that a change that made it
    trivial (every request refused, nothing preempted) fails here."""
    assert COVERAGE["steps"] >= 2000 and COVERAGE["requests"] >= 500
    assert COVERAGE["preemptions"] >= 20 and COVERAGE["cancelled"] >= 20
