"""contract/profile.py: one schema for config.pbtxt `parameters`, read by the engine and the gateway alike.

Every shipped profile and every profile devstack.add_model writes validates; an unknown key or a bad value is an
error naming the key (the engine refuses to load the model, the gateway does not serve it); the docs' parameter
table is the schema's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from contract.profile import PARAMETERS, ProfileError, doc_table, field_names, parse_profile
from devstack.add_model import add_model
from engine.triton.profile_config import engine_config, engine_profile
from gateway.profile import ModelProfile

from .test_add_model import LLAMA_CONFIG, THINKING, folder, parameters

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "model_repository").glob("*/config.pbtxt"))
STUBS = sorted((REPO / "tests" / "stub_repository").glob("*/config.pbtxt"))


def test_the_profile_has_one_field_per_declared_parameter():
    assert field_names() == [p.name for p in PARAMETERS]


def test_the_docs_parameter_table_is_the_schemas():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc_table() in doc, "regenerate the table in docs/configuration.md: python -m contract.profile"
    rows = re.findall(r"^\| `(\w+)` \|", doc.split("## Model profile", 1)[1].split("\n## ", 1)[0], re.M)
    assert rows == [p.name for p in PARAMETERS]


def test_the_triton_contracts_profile_paragraph_names_every_key():
    doc = (REPO / "docs" / "triton-contract.md").read_text()
    section = doc.split("## Profile (`config.pbtxt` `parameters`)", 1)[1].split("\n## ", 1)[0]
    assert [p.name for p in PARAMETERS if f"`{p.name}`" not in section] == []


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.parent.name)
def test_every_shipped_profile_validates(config):
    profile = parse_profile(parameters(config.parent))
    assert profile.hf_model and profile.served_name


@pytest.mark.parametrize("config", STUBS, ids=lambda p: p.parent.name)
def test_the_stub_models_profiles_validate_for_the_gateway(config):
    assert parse_profile(parameters(config.parent), reader="gateway").max_output_tokens == 100000


@pytest.mark.parametrize("kind", ["plain", "thinking", "vision"])
def test_every_profile_add_model_writes_validates(tmp_path, kind):
    config = LLAMA_CONFIG | ({"vision_config": {"hidden_size": 8}} if kind == "vision" else {})
    src = folder(tmp_path, config=config, template=THINKING if kind == "thinking" else None)
    for device in ("cpu", "gpu"):
        profile = parse_profile(parameters(add_model(src, tmp_path / device, kind=device)))
        assert profile.reasoning == (kind == "thinking") and profile.image_input == (kind == "vision")


def test_the_shipped_smollm2_profile_is_typed():
    p = parse_profile(parameters(REPO / "model_repository" / "smollm2_135m_instruct"))
    assert (p.context_length, p.max_slots, p.kv_budget_tokens, p.reasoning) == (2048, 128, 81920, False)
    assert p.lora_paths == {"pirate": "smollm2-lora-pirate"} and p.default_sampling == {"temperature": 0.2,
                                                                                           "top_p": 0.9}
    assert p.grammar_kinds == ("json_schema", "regex", "ebnf")
    # not set there: the schema's defaults
    assert (p.max_loras, p.max_lora_rank, p.cuda_graphs, p.threads, p.burst_quiet_ms) == (8, 64, True, None, 3.0)
    assert p.kv_events_endpoint is None and p.kv_events_replay_endpoint is None


def test_an_unknown_key_is_named_with_the_closest_known_one():
    with pytest.raises(ProfileError) as err:
        parse_profile({"hf_model": "m", "max_slot": "4"})
    assert err.value.key == "max_slot" and "`max_slot`" in str(err.value) and "`max_slots`" in str(err.value)
    with pytest.raises(ProfileError, match="`zzzz`: unknown key$"):
        parse_profile({"hf_model": "m", "zzzz": "1"})


@pytest.mark.parametrize(("key", "value", "says"), [
    ("context_length", "2k", "not an integer"),
    ("max_slots", "0", "below the minimum 1"),
    ("burst_window_ms", "-1", "below the minimum 0"),
    ("burst_quiet_ms", "nan", "not a number"),
    ("threads", "1.5", "not an integer"),
    ("reasoning", "yes", "not true or false"),
    ("cuda_graphs", "off", "not true or false"),
    ("dtype", "fp8", "not one of"),
    ("kv_cache_dtype", "float32", "not one of"),
    ("model_impl", "vllm", "not one of"),
    ("grammar_kinds", "json_schema,xml", "'xml' is not one of"),
    ("lora_paths", "{", "not valid JSON"),
    ("lora_paths", '{"a": 1}', "adapter name to a folder"),
    ("default_sampling", "[0.2]", "JSON object"),
    ("quantization", "int2", "one of"),
    ("chat_template_kwargs", '"x"', "JSON object"),
])
def test_a_bad_value_is_named(key, value, says):
    with pytest.raises(ProfileError, match=re.escape(f"`{key}`: ") + ".*" + re.escape(says)) as err:
        parse_profile({"hf_model": "m", key: value})
    assert err.value.key == key


def test_the_python_backends_own_keys_are_not_profile_errors():
    assert parse_profile({"hf_model": "m", "EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env.tar.gz"}).hf_model == "m"


def test_hf_model_is_required_by_the_engine_only():
    with pytest.raises(ProfileError, match="`hf_model`: is required"):
        engine_profile({"served_name": "a/b"})
    assert parse_profile({"served_name": "a/b"}, reader="gateway").hf_model is None


def test_an_empty_value_means_the_default():
    p = parse_profile({"hf_model": "m", "kv_budget_tokens": "", "grammar_kinds": "", "max_loras": " "})
    assert (p.kv_budget_tokens, p.grammar_kinds, p.max_loras) == (None, (), 8)


def test_the_engine_config_comes_from_the_typed_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("SIE_MODEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "turns.jinja").write_text("{{ messages }}")
    profile = engine_profile({
        "hf_model": "m", "served_name": "a/b", "context_length": "512", "cuda_graphs": "false", "threads": "2",
        "burst_quiet_ms": "1.5", "lora_paths": '{"x": "/abs/x", "y": "rel"}', "chat_template": "turns.jinja",
        "stop_tokens": "<end>,<eot>", "max_loras": "3", "kv_events_endpoint": "tcp://*:5557",
        "kv_cache_dtype": "bfloat16"})
    config = engine_config(profile, model_dir=str(tmp_path), triton_name="t", device="cpu", pod="pod-1")
    assert config.model_path == str(tmp_path / "cache" / "m") and config.max_len == 512
    assert (config.cuda_graphs, config.threads, config.burst_quiet_ms, config.max_loras) == (False, 2, 1.5, 3)
    assert config.lora_paths == {"x": "/abs/x", "y": str(tmp_path / "cache" / "rel")}
    assert config.chat_template == "{{ messages }}" and config.stop_tokens == ["<end>", "<eot>"]
    assert config.kv_events_endpoint == "tcp://*:5557" and config.kv_events_topic == "kv@pod-1@a/b"
    assert config.kv_cache_dtype == "bfloat16"
    defaults = engine_config(engine_profile({"hf_model": "/m"}), model_dir=str(tmp_path), triton_name="t",
                             device="cpu", pod="p")
    assert (defaults.max_slots, defaults.kv_budget_tokens, defaults.chat_template, defaults.stop_tokens,
            defaults.kv_events_topic, defaults.kv_cache_dtype) == (64, None, None, None, "kv@p@t", "auto")


def test_the_engine_refuses_a_bad_key_before_building_its_config():
    with pytest.raises(ProfileError, match="`max_num_batched_token`.*`max_num_batched_tokens`"):
        engine_profile({"hf_model": "m", "max_num_batched_token": "512"})


def test_the_gateway_reads_the_same_schema():
    profile = ModelProfile.from_triton_config("t", {"served_name": "a/b", "grammar_kinds": "regex",
                                                    "default_sampling": '{"temperature": 0.5}'})
    assert (profile.name, profile.grammar_kinds, profile.default_temperature, profile.context_length) == (
        "a/b", frozenset({"regex"}), 0.5, None)
    with pytest.raises(ProfileError, match="`image_input`"):
        ModelProfile.from_triton_config("t", {"image_input": "maybe"})
