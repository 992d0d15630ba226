"""One request never depends on another: batch composition, first-token finishes, failing neighbours.

Each test compares a request's tokens in a batch with the same request run alone (the reference), on
the real SmolLM2 model through a synchronous EngineCore.
"""

from __future__ import annotations

import pytest
import torch

from engine.errors import EngineError
from engine.sampling_params import SamplingParams

from .engine_run import PROMPTS, RaisingGrammar, Run, greedy

MORE_PROMPTS = [*PROMPTS, "The three largest planets of the solar system are", "List two fruits."]


@pytest.fixture(scope="module")
def prompts(real_engine) -> list[list[int]]:
    return [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in MORE_PROMPTS]


def alone(make_scheduler, prompt: list[int], params: SamplingParams, **kw) -> tuple[list[int], str]:
    run = Run(make_scheduler())
    run.add("a", prompt, params, **kw)
    run.until_done()
    return run.ids("a"), run.text("a")


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=12, ignore_eos=True)


# -- defect 1: a first-token finish in a batched prefill ---------------------------------------------


@pytest.mark.parametrize("finisher", ["max_tokens_1", "first_token_eos"])
def test_first_token_finish_in_batched_prefill_leaves_neighbours_alone(make_scheduler, prompts, finisher):
    others = {
        "greedy": (prompts[4], greedy(12, ignore_eos=True)),
        "seeded": (prompts[1], sampled(7)),
        "n2": (prompts[2], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True)),
    }
    refs = {}
    for rid, (prompt, params) in others.items():
        run = Run(make_scheduler())
        run.add(rid, prompt, params)
        run.until_done()
        refs[rid] = [run.ids(rid, i) for i in range(params.n)]

    run = Run(make_scheduler())
    # the finishers come first, so their retirement would compact rows of the requests placed after them
    eos = min(run.sched.sampler.stop_token_set)
    first = greedy(1) if finisher == "max_tokens_1" else greedy(20, logit_bias={eos: 100.0})
    run.add("f1", prompts[0], first)
    run.add("f2", prompts[3], first)
    for rid, (prompt, params) in others.items():
        run.add(rid, prompt, params)
    run.step()  # one batched prefill of all five
    running = {id(s.group): s.group for s in run.sched.scheduler.running}.values()
    assert {g.request.request_id for g in running} <= set(others)
    run.until_done()
    assert run.final("f1").completion_tokens == 1
    assert run.final("f1").finish_reason == ("length" if finisher == "max_tokens_1" else "stop")
    for rid, (_, params) in others.items():
        assert [run.ids(rid, i) for i in range(params.n)] == refs[rid], rid


def test_rows_always_sit_at_their_own_slot(make_scheduler, prompts):
    run = Run(make_scheduler(slots=8))
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p, greedy(1 + 3 * i, ignore_eos=True))
    sched = run.sched.scheduler
    plan_step, plans = sched.schedule, []

    def checked():
        plan = plan_step()
        plans.append(plan)
        rows = [seq.slot for seq in plan.decode] + [span.slot for span in plan.spans]
        assert rows == list(range(len(rows)))  # decode rows 0..B-1, then the spans
        return plan

    sched.schedule = checked
    run.until_done()
    assert len(plans) > 10


# -- defect 3: a grammar that can only end, with min_tokens / ignore_eos ------------------------------


@pytest.mark.parametrize("extra", [{"min_tokens": 8}, {"ignore_eos": True}])
def test_finished_grammar_ends_the_candidate_despite_eos_bans(real_engine, make_scheduler, prompts, extra):
    from engine.sampling_params import GrammarRequest

    params = SamplingParams(temperature=0.0, max_tokens=20, **extra)
    params.grammar = GrammarRequest(kind="regex", value="(yes|no)")
    run = Run(make_scheduler())
    run.add("g", prompts[0], params, grammar=real_engine.grammar_factory(params))
    run.until_done()
    final = run.final("g")
    assert final.error is None
    assert run.text("g") in ("yes", "no")
    assert final.finish_reason == "stop"
    assert len(run.ids("g")) <= 3  # the answer, then EOS: nothing appended after the grammar ended


# -- defect 4: failures kept to one request -----------------------------------------------------------


class SingleRowFailingDelta:
    """A LoRA delta that works on a whole prompt but fails on one row (this adapter's decode steps)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            raise RuntimeError("adapter kernel failed")
        return x.new_zeros(())


def _run_with_failing_neighbour(make_scheduler, prompts, add_failing) -> Run:
    run = Run(make_scheduler())
    run.add("a", prompts[1], greedy(10, ignore_eos=True))
    add_failing(run)
    run.add("b", prompts[2], sampled(5))
    run.until_done()
    return run


def _assert_neighbours_unharmed(make_scheduler, prompts, run: Run) -> None:
    final = run.final("bad")
    assert final.error is not None and final.error.code == "inference_error"
    assert final.finish_reason == "error"
    assert run.ids("a") == alone(make_scheduler, prompts[1], greedy(10, ignore_eos=True))[0]
    assert run.ids("b") == alone(make_scheduler, prompts[2], sampled(5))[0]


def test_a_failing_grammar_fails_only_its_request(make_scheduler, prompts):
    run = _run_with_failing_neighbour(
        make_scheduler, prompts,
        lambda r: r.add("bad", prompts[3], greedy(10), grammar=lambda: RaisingGrammar(fail_at=3)))
    _assert_neighbours_unharmed(make_scheduler, prompts, run)
    # its error output says what it had used: the prompt and the two tokens made before the third mask failed
    assert (run.final("bad").prompt_tokens, run.final("bad").completion_tokens) == (len(prompts[3]), 2)


def test_a_failing_output_step_fails_only_its_request(make_scheduler, prompts):
    sched = make_scheduler()
    run = Run(sched)
    capture = sched.outputs.postprocess

    def failing_postprocess(seq):
        if seq.group.request.request_id == "bad":
            raise ValueError("tool parser crashed")
        return capture(seq)

    sched.outputs.postprocess = failing_postprocess
    run.add("a", prompts[1], greedy(10, ignore_eos=True))
    run.add("bad", prompts[3], greedy(4, ignore_eos=True))
    run.add("b", prompts[2], sampled(5))
    run.until_done()
    _assert_neighbours_unharmed(make_scheduler, prompts, run)


def test_a_failing_adapter_in_decode_fails_only_its_request(make_scheduler, real_engine, prompts):
    layers = len(real_engine.runner.decoder.layers)
    sched = make_scheduler(adapters={"flaky": [{"o_proj": [(0, SingleRowFailingDelta())]} for _ in range(layers)]})
    run = Run(sched)
    run.add("a", prompts[1], greedy(10, ignore_eos=True))
    run.add("bad", prompts[3], greedy(10, lora_adapter="flaky"))
    run.add("b", prompts[2], sampled(5))
    run.until_done()
    _assert_neighbours_unharmed(make_scheduler, prompts, run)
    assert not run.sched.scheduler.running and run.sched.scheduler.kv.pool.used == 0


# -- defect 6: an explicit cap beyond the context -----------------------------------------------------


def test_explicit_cap_past_the_context_is_context_exceeded(make_scheduler, prompts):
    from engine.request import EngineRequest

    sched = make_scheduler(max_len=64)
    explicit = SamplingParams.from_dict({"max_tokens": 40, "max_tokens_param": "max_new_tokens"})
    with pytest.raises(EngineError) as info:
        sched.scheduler.add(EngineRequest("x", prompts[0], explicit, lambda out: None))
    assert (info.value.code, info.value.param) == ("context_exceeded", "max_new_tokens")
    defaulted = SamplingParams.from_dict({})  # no cap sent: the default is clamped to what is left
    sched.scheduler.add(EngineRequest("y", prompts[0], defaulted, lambda out: None))
    assert defaulted.max_tokens == 64 - len(prompts[0])


def test_kv_budget_error_names_the_clients_field(make_scheduler, prompts):
    from engine.core.engine_core import EngineCore
    from engine.request import EngineRequest

    base = make_scheduler()
    sched = EngineCore(base.runner, base.sampler, base.scheduler.tokenizer, kv_budget_tokens=60)
    params = SamplingParams.from_dict({"max_tokens": 100, "max_tokens_param": "max_completion_tokens"})
    with pytest.raises(EngineError) as info:
        sched.scheduler.add(EngineRequest("x", prompts[0], params, lambda out: None))
    assert info.value.param == "max_completion_tokens"


# -- defect 8: stop token ids -------------------------------------------------------------------------


def test_stop_token_ids_end_the_candidate_like_eos(make_scheduler, tokenizer, prompts):
    ref_ids, _ = alone(make_scheduler, prompts[4], greedy(12, ignore_eos=True))
    stop_id = ref_ids[3]
    first = ref_ids.index(stop_id)
    run = Run(make_scheduler())
    run.add("s", prompts[4], greedy(12, ignore_eos=True, stop_token_ids=[stop_id]))
    run.until_done()
    final = run.final("s")
    assert (final.finish_reason, final.stop_reason) == ("stop", stop_id)
    assert run.ids("s") == ref_ids[: first + 1]
    assert run.text("s") == tokenizer.decode(ref_ids[:first], skip_special_tokens=True)  # nothing for the stop id


def test_min_tokens_holds_back_stop_token_ids(make_scheduler, prompts):
    ref_ids, _ = alone(make_scheduler, prompts[4], greedy(12, ignore_eos=True))
    stop_id = ref_ids[0]
    run = Run(make_scheduler())
    run.add("s", prompts[4], greedy(12, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=2))
    run.until_done()
    assert run.ids("s")[0] != stop_id
    assert len(run.ids("s")) >= 2


# -- defect 9: a forced tool choice that names no declared function -----------------------------------


def test_forced_tool_choice_for_an_undeclared_function_is_invalid(real_engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    params = SamplingParams(tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(EngineError) as info:
        real_engine.grammar_factory(params)
    assert (info.value.code, info.value.param) == ("invalid_request", "tool_choice")
