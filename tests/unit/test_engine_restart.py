"""The engine loop stops and starts again (bench.engine stops it while an HF baseline runs alone)."""

from __future__ import annotations

from engine.sampling_params import SamplingParams


def test_a_stopped_engine_serves_again_after_start(real_engine):
    prompt = real_engine.encode_prompt(messages=[{"role": "user", "content": "Say hi."}])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    real_engine.stop()
    assert not real_engine._thread.is_alive()
    real_engine.start()
    outputs = real_engine.generate("restart-1", prompt, params, stream=False)
    while not (out := outputs.get(timeout=60)).final:
        pass
    assert out.error is None
    assert out.completion_tokens == 4
