"""The peer bench's own logic, without servers (bench/peer_stats.py, bench/peer_runs.py's profile override):
the alternated run order, the ratios over medians, the `noisy` verdict (so a figure from a loaded box says so),
and the dtype set on a copy of the model profile, never on the checked-in one."""

from __future__ import annotations

import re

import pytest

from bench.peer_runs import MODEL_NAME, repository_in_dtype, with_parameter
from bench.peer_stats import HEADLINE, alternation, median_figures, noise_reasons, ratios, spread
from devstack.triton import REPO_ROOT


def figures(scale: float = 1.0, **override: float) -> dict[str, float]:
    base = {"tok_s_c1": 40.0, "tok_s_c8": 250.0, "tok_s_c16": 400.0, "ttft_p50_c1": 0.05, "ttft_p50_c8": 0.2,
            "ttft_p50_c16": 0.3, "cold_ttft": 1.0, "cached_ttft": 0.12}
    return {**{k: v * scale for k, v in base.items()}, **override}


def test_alternation_interleaves_the_sides_never_one_side_twice_in_a_row():
    assert alternation(2) == ["ours", "vllm", "ours", "vllm"]
    order = alternation(3)
    assert order.count("ours") == order.count("vllm") == 3
    assert all(a != b for a, b in zip(order, order[1:], strict=False))
    assert alternation(2, ("ours",)) == ["ours", "ours"]
    with pytest.raises(ValueError):
        alternation(0)


def test_spread_is_the_gap_over_the_smaller_reading():
    assert spread([100.0]) == 0
    assert spread([100.0, 110.0]) == pytest.approx(0.10)
    assert spread([120.0, 100.0, 105.0]) == pytest.approx(0.20)
    with pytest.raises(ValueError):
        spread([])


def test_ratios_are_ours_over_vllms_from_the_medians_of_the_alternated_runs():
    ours = median_figures([figures(tok_s_c1=30.0, cold_ttft=2.0), figures(tok_s_c1=34.0, cold_ttft=2.2),
                           figures(tok_s_c1=50.0, cold_ttft=1.8)])
    vllm = median_figures([figures(tok_s_c1=44.0, cold_ttft=1.0), figures(tok_s_c1=46.0, cold_ttft=1.1)])
    assert ours["tok_s_c1"] == 34.0 and vllm["tok_s_c1"] == 45.0
    r = ratios(ours, vllm)
    assert r["peer_ratio_c1"] == pytest.approx(34.0 / 45.0)
    assert r["peer_ratio_c8"] == pytest.approx(1.0)
    assert r["peer_cold_ttft_ratio"] == pytest.approx(2.0 / 1.05)  # ours cold over vLLM's cold
    assert r["prefix_ttft_ratio"] == pytest.approx(0.12 / 2.0)  # ours alone: cached over cold
    assert r["peer_prefix_ttft_ratio"] == pytest.approx(1.0)
    assert r["peer_ttft_ratio_c8"] == pytest.approx(1.0)


def test_steady_probes_and_runs_within_10_percent_are_not_noisy():
    runs = {"ours": [figures(), figures(1.05)], "vllm": [figures(), figures(0.95)]}
    assert noise_reasons([140.0, 141.0, 135.0, 139.0], runs) == []


def test_a_probe_slower_by_more_than_10_percent_anywhere_in_the_set_flags_it():
    runs = {"ours": [figures(), figures()], "vllm": [figures(), figures()]}
    # the load covers one whole vLLM run: steady across that run, yet slower than the probes around ours
    reasons = noise_reasons([140.0, 141.0, 120.0, 121.0, 140.0, 139.0], runs)
    assert len(reasons) == 1 and "cpu probe" in reasons[0]


@pytest.mark.parametrize("key", HEADLINE)
def test_two_runs_of_one_side_more_than_10_percent_apart_on_any_headline_figure_flag_it(key):
    runs = {"ours": [figures(), figures()], "vllm": [figures(), figures(**{key: figures()[key] * 1.15})]}
    reasons = noise_reasons([140.0, 140.0], runs)
    assert reasons == [reasons[0]] and reasons[0].startswith(f"vllm {key} ")


def test_a_figure_outside_the_headline_does_not_flag_it():
    runs = {"ours": [figures(), figures(ttft_p50_c16=0.9)], "vllm": [figures(), figures()]}
    assert noise_reasons([140.0, 140.0], runs) == []


def test_one_run_a_side_cannot_show_it_is_steady():
    reasons = noise_reasons([140.0, 140.0], {"ours": [figures()]})
    assert reasons and reasons[0].startswith("ours: 1 run")


CONFIG = REPO_ROOT / "model_repository" / MODEL_NAME / "config.pbtxt"


def profile_parameters(text: str) -> dict[str, str]:
    return dict(re.findall(r'^parameters:\s*\{\s*key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"(.*)"\s*\}\s*\}',
                           text, re.M))


def test_with_parameter_appends_a_missing_key_and_replaces_a_present_one_only():
    text = CONFIG.read_text()
    once = with_parameter(text, "dtype", "bfloat16")
    assert profile_parameters(once) == {**profile_parameters(text), "dtype": "bfloat16"}
    twice = with_parameter(once, "dtype", "float32")
    assert profile_parameters(twice)["dtype"] == "float32"
    assert twice.count('key: "dtype"') == 1
    assert with_parameter(twice, "dtype", "float32") == twice


def test_repository_in_dtype_copies_the_model_folder_and_leaves_the_checked_in_profile_alone(tmp_path):
    before = CONFIG.read_text()
    repo = repository_in_dtype(tmp_path, "bfloat16")
    assert [p.name for p in repo.iterdir()] == [MODEL_NAME]  # SmolLM2 alone, as vLLM serves one model
    copy = repo / MODEL_NAME
    assert (copy / "1" / "model.py").read_text() == (CONFIG.parent / "1" / "model.py").read_text()
    assert profile_parameters((copy / "config.pbtxt").read_text())["dtype"] == "bfloat16"
    assert CONFIG.read_text() == before
    assert profile_parameters(repository_in_dtype(tmp_path, "float32").joinpath(
        MODEL_NAME, "config.pbtxt").read_text())["dtype"] == "float32"


def test_the_bench_alternates_one_server_at_a_time_in_each_dtype_and_writes_every_ratio(
        monkeypatch, tmp_path, capsys):
    import json

    import bench.peer as peer

    events: list[str] = []
    up: list[str] = []

    def fake_run(side):
        def run(dtype, log_dir, workload, **kwargs):
            assert not up, f"{side} started while {up} was up"
            up.append(side)
            events.append(f"{side}-{dtype}")
            slower = 0.6 if side == "ours" else 1.0
            result = figures(slower, cold_ttft=1.0 / slower)
            up.remove(side)
            return (result, True) if side == "ours" else result
        return run

    probes = iter([140.0] * 14 + [100.0])  # before bf16's last vLLM run (8 probes a dtype): 29 % slower
    monkeypatch.setattr(peer, "run_ours", fake_run("ours"))
    monkeypatch.setattr(peer, "run_vllm", fake_run("vllm"))
    monkeypatch.setattr(peer, "probe_gflops", lambda: next(probes, 140.0))
    monkeypatch.setattr(peer, "RESULTS", tmp_path / "peer.json")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    monkeypatch.setattr(peer, "VLLM_VENV", tmp_path / "venv")
    monkeypatch.setattr(peer.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "logs"))
    (tmp_path / "logs").mkdir()
    monkeypatch.setattr("sys.argv", ["bench.peer"])
    peer.main()
    assert events == ["ours-float32", "vllm-float32", "ours-float32", "vllm-float32",
                      "ours-bfloat16", "vllm-bfloat16", "ours-bfloat16", "vllm-bfloat16"]
    out = capsys.readouterr().out
    assert "peer_ratio_c1_fp32: 0.600\n" in out and "peer_cold_ttft_ratio_fp32: 1.667\n" in out
    assert "peer_noisy_fp32: 0" in out and "peer_noisy_bf16: 1" in out
    assert "peer_ratio_c1_bf16: 0.600  noisy" in out
    assert "vllm_bench_serve_ok: 1" in out
    saved = json.loads((tmp_path / "peer.json").read_text())
    assert saved["order"] == ["ours", "vllm", "ours", "vllm"]
    assert set(saved["dtypes"]["fp32"]["ratios"]) == {
        "peer_ratio_c1", "peer_ratio_c8", "peer_ratio_c16", "peer_ttft_ratio_c8", "prefix_ttft_ratio",
        "peer_prefix_ttft_ratio", "peer_cold_ttft_ratio"}
    assert saved["dtypes"]["bf16"]["noisy"] and not saved["dtypes"]["fp32"]["noisy"]


def test_stopping_vllm_waits_for_every_process_of_its_group_not_only_the_leader():
    """vLLM's api server forks an engine core; a core still alive (here: one that ignores SIGTERM) would share
    the CPU with the next server and with the probe after the run."""
    import os
    import subprocess
    import sys

    from bench.peer_runs import _group_alive, _stop_group

    script = ("import os, signal, sys, time\n"
              "if os.fork() == 0:\n"
              "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "    time.sleep(60)\n"
              "    os._exit(0)\n"
              "print('forked', flush=True)\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"forked\n"
    try:
        _stop_group(proc, timeout=1.0)
        assert not _group_alive(proc.pid)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, 9)


def test_the_engine_bench_alternates_one_engine_process_at_a_time_and_flags_its_own_figures(
        monkeypatch, tmp_path, capsys):
    """bench/peer_engines.py: ours, vLLM, ours, vLLM; ratios over the medians; `noisy` read on the b1/b8/b16
    figures (a spread in a served figure's name would mean nothing here)."""
    import bench.peer_engines as engines

    order: list[str] = []

    def fake_side(side, dtype, log):
        order.append(side)
        if side == "vllm":
            return {"tok_s_b1": 20.0, "tok_s_b8": 150.0, "tok_s_b16": 200.0}
        b8 = 120.0 if order.count("ours") == 1 else 150.0  # ours' two runs 25 % apart at B=8
        return {"tok_s_b1": 30.0, "tok_s_b8": b8, "tok_s_b16": 220.0}

    monkeypatch.setattr(engines, "_run_side", fake_side)
    monkeypatch.setattr(engines, "probe_gflops", lambda: 140.0)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    monkeypatch.setattr(engines, "VLLM_VENV", tmp_path / "venv")
    monkeypatch.setattr(engines, "REPO_ROOT", tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    monkeypatch.setattr("sys.argv", ["bench.peer_engines"])
    engines.main()
    assert order == ["ours", "vllm", "ours", "vllm"]
    out = capsys.readouterr().out
    assert "peer_engine_ratio_b1_fp32: 1.500  noisy\n" in out
    assert "peer_engine_ratio_b8_fp32: 0.900  noisy\n" in out  # median of 120 and 150 over 150
    assert "noisy: ours tok_s_b8 spread 25%" in out


def test_our_engine_side_counts_exactly_the_tokens_it_asked_for(real_engine):
    from bench.peer_engines import measure_engine

    figures = measure_engine(real_engine, batches=(1, 2), new_tokens=3, reps=1)
    assert set(figures) == {"tok_s_b1", "tok_s_b2"} and all(v > 0 for v in figures.values())
