"""The arithmetic of `make bench-peer` (bench/peer.py), apart from any server: the run order, the medians, the
ratios and the `noisy` verdict.

A run's figures are a flat dict: tok_s_c1/c8/c16, ttft_p50_c1/c8/c16 and the history turn's cold_ttft and
cached_ttft (seconds), as bench/peer_workload.py measures them.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

SIDES = ("ours", "vllm")
# the figures the verdict watches: the ones the peer table and its ratios are made of
HEADLINE = ("tok_s_c1", "tok_s_c8", "tok_s_c16", "ttft_p50_c8", "cold_ttft", "cached_ttft")
NOISE_LIMIT = 0.10  # 10 %: above it two readings of the same thing disagree more than a quiet box allows
RATIOS = ("peer_ratio_c1", "peer_ratio_c8", "peer_ratio_c16", "peer_ttft_ratio_c8", "prefix_ttft_ratio",
          "peer_prefix_ttft_ratio", "peer_cold_ttft_ratio")


def alternation(runs_each: int, sides: Sequence[str] = SIDES) -> list[str]:
    """ours, vllm, ours, vllm, ...: each side `runs_each` times, interleaved, so that a load that comes and goes
    falls on both sides rather than on one half of the bench."""
    if runs_each < 1:
        raise ValueError("runs_each must be at least 1")
    return [side for _ in range(runs_each) for side in sides]


def spread(values: Sequence[float]) -> float:
    """(largest - smallest) / smallest: how far apart readings of one figure are (0 for a single reading)."""
    if not values:
        raise ValueError("no values")
    low = min(values)
    if low <= 0:
        raise ValueError(f"readings must be positive, got {low}")
    return (max(values) - low) / low


def median_figures(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the runs of one side."""
    if not runs:
        raise ValueError("no runs")
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def ratios(ours: dict[str, float], vllm: dict[str, float]) -> dict[str, float]:
    """Ours over vLLM's: tok/s ratios above 1 and TTFT ratios below 1 mean we are ahead. prefix_ttft_ratio is
    ours alone (cached turn over cold turn)."""
    return {
        "peer_ratio_c1": ours["tok_s_c1"] / vllm["tok_s_c1"],
        "peer_ratio_c8": ours["tok_s_c8"] / vllm["tok_s_c8"],
        "peer_ratio_c16": ours["tok_s_c16"] / vllm["tok_s_c16"],
        "peer_ttft_ratio_c8": ours["ttft_p50_c8"] / vllm["ttft_p50_c8"],
        "prefix_ttft_ratio": ours["cached_ttft"] / ours["cold_ttft"],
        "peer_prefix_ttft_ratio": ours["cached_ttft"] / vllm["cached_ttft"],
        "peer_cold_ttft_ratio": ours["cold_ttft"] / vllm["cold_ttft"],
    }


def noise_reasons(probes: Sequence[float], runs: Mapping[str, Sequence[dict[str, float]]],
                  limit: float = NOISE_LIMIT, headline: Sequence[str] = HEADLINE) -> list[str]:
    """Why a set of alternated runs (one dtype) is not to be believed; empty when it is.

    - `probes`: every CPU probe reading (GFLOP/s) taken before and after each server run of the set. They are
      compared all together, not only before against after one run: a load that covers one whole run reads as
      steady across that run but slower than the probes around the other side's runs.
    - `runs`: each side's run figures; a side's runs must agree on every `headline` figure, and a side needs at
      least two runs to show that they do.
    """
    reasons = []
    if probes and spread(probes) > limit:
        reasons.append(f"cpu probe spread {spread(probes):.0%} (GFLOP/s {min(probes):.1f} to {max(probes):.1f})")
    for side, side_runs in runs.items():
        if len(side_runs) < 2:
            reasons.append(f"{side}: {len(side_runs)} run, nothing to compare it with")
            continue
        for key in headline:
            values = [run[key] for run in side_runs]
            if spread(values) > limit:
                reasons.append(f"{side} {key} spread {spread(values):.0%} "
                               f"({', '.join(f'{v:.3g}' for v in values)})")
    return reasons
