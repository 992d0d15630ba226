"""devstack.add_model: a Triton model folder whose profile comes from the Hugging Face folder's own files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from devstack.add_model import REFERENCE_MODEL, add_model, main, triton_name
from devstack.serve import model_repository

from .test_model_repository import tensors

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 4096, "vocab_size": 100}
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
THINKING = CHATML + "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
ADDED = [{"id": 0, "content": "<|endoftext|>"}, {"id": 1, "content": "<|im_start|>"},
         {"id": 2, "content": "<|im_end|>"}]


def folder(tmp_path: Path, name: str = "my-model", config: dict | None = None, template: str | None = CHATML,
           generation: dict | None = None) -> Path:
    """A model folder with only the files the profile reads (no weights needed to write a profile)."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config or LLAMA_CONFIG))
    (path / "tokenizer.json").write_text(json.dumps({"added_tokens": ADDED}))
    tokenizer_config = {"eos_token": "<|endoftext|>"} | ({"chat_template": template} if template else {})
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (path / "generation_config.json").write_text(json.dumps(generation or {"eos_token_id": [0]}))
    return path


def parameters(target: Path) -> dict[str, str]:
    text = (target / "config.pbtxt").read_text()
    return {k: json.loads(v) for k, v in re.findall(r'key: "(\w+)", value: \{ string_value: ("(?:[^"\\]|\\.)*")',
                                                     text)}


def test_the_folder_speaks_the_reference_models_contract_and_runs_its_model_py(tmp_path):
    target = add_model(folder(tmp_path), tmp_path / "repo", name="acme/My-Model-1.5B")
    assert target.name == "acme_my_model_1_5b" == triton_name("acme/My-Model-1.5B")
    assert tensors(target / "config.pbtxt") == tensors(REFERENCE_MODEL / "config.pbtxt")
    assert (target / "1" / "model.py").read_text() == (REFERENCE_MODEL / "1" / "model.py").read_text()
    assert f'name: "{target.name}"' in (target / "config.pbtxt").read_text()
    assert "kind: KIND_CPU" in (target / "config.pbtxt").read_text()
    p = parameters(target)
    assert p["served_name"] == "acme/My-Model-1.5B" and p["model_impl"] == "auto"
    assert p["hf_model"] == str((tmp_path / "my-model").resolve())


def test_limits_come_from_the_config_and_the_kv_memory(tmp_path):
    path = folder(tmp_path)
    roomy = parameters(add_model(path, tmp_path / "a", kv_memory_bytes=1 << 30))
    assert roomy["context_length"] == roomy["max_output_tokens"] == "4096"  # max_position_embeddings
    # 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 B a token: 1 MiB holds 2048 positions
    tight = parameters(add_model(path, tmp_path / "b", kv_memory_bytes=1 << 20))
    assert tight["context_length"] == "2048" and int(tight["kv_budget_tokens"]) == 2048
    assert int(tight["max_slots"]) >= 4 and int(tight["prefix_cache_tokens"]) <= 2048 // 4
    gpu = add_model(path, tmp_path / "c", kind="gpu", kv_memory_bytes=1 << 20)
    assert "kind: KIND_GPU" in (gpu / "config.pbtxt").read_text()
    assert int(parameters(gpu)["kv_budget_tokens"]) == 4096  # bf16: half the bytes a token
    assert "kv_cache_dtype" not in parameters(gpu)  # auto: the activations' dtype


def test_a_narrower_kv_cache_holds_more_tokens_on_the_cpu(tmp_path):
    path = folder(tmp_path)
    fp32 = parameters(add_model(path, tmp_path / "a", kv_memory_bytes=1 << 20))
    bf16 = parameters(add_model(path, tmp_path / "b", kv_memory_bytes=1 << 20, kv_cache_dtype="bfloat16"))
    assert bf16["kv_cache_dtype"] == "bfloat16" and "kv_cache_dtype" not in fp32
    assert int(bf16["kv_budget_tokens"]) == 2 * int(fp32["kv_budget_tokens"]) == 4096
    # int8: 2 layers x 2 KV heads x K and V x (16 values + a 4-byte scale) = 160 B a token
    int8 = parameters(add_model(path, tmp_path / "c", kv_memory_bytes=1 << 20, kv_cache_dtype="int8"))
    assert int8["kv_cache_dtype"] == "int8" and int(int8["kv_budget_tokens"]) == (1 << 20) // 160 // 16 * 16
    assert main([str(path), "--repository", str(tmp_path / "cli"), "--name", "x/y", "--kv-cache-dtype",
                 "bfloat16"]) == 0
    assert parameters(tmp_path / "cli" / "x_y")["kv_cache_dtype"] == "bfloat16"


def test_int8_weights_are_written_to_the_profile_only_when_asked(tmp_path):
    path = folder(tmp_path)
    assert "quantization" not in parameters(add_model(path, tmp_path / "a"))
    assert main([str(path), "--repository", str(tmp_path / "cli"), "--name", "q", "--quantization", "int8"]) == 0
    assert parameters(tmp_path / "cli" / "q")["quantization"] == "int8"


def test_turn_end_stop_tokens_from_generation_config_and_the_templates_marker(tmp_path):
    p = parameters(add_model(folder(tmp_path), tmp_path / "repo"))
    assert p["stop_tokens"].split(",") == ["<|endoftext|>", "<|im_end|>"]


def test_no_chat_template_is_said_in_the_file_and_nothing_is_invented(tmp_path):
    target = add_model(folder(tmp_path, template=None), tmp_path / "repo")
    assert "chat template: none (chat answers 400 naming `messages`" in (target / "config.pbtxt").read_text()
    assert "chat_template" not in parameters(target) and parameters(target)["stop_tokens"] == "<|endoftext|>"


def test_a_thinking_template_turns_reasoning_on_and_names_its_switch(tmp_path):
    target = add_model(folder(tmp_path, template=THINKING), tmp_path / "repo")
    assert parameters(target)["reasoning"] == "true"
    assert "enable_thinking" in (target / "config.pbtxt").read_text()
    assert parameters(add_model(folder(tmp_path, "plain"), tmp_path / "repo"))["reasoning"] == "false"


def test_a_vision_model_takes_images(tmp_path):
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "vision_config": {"hidden_size": 32}, "text_config": dict(LLAMA_CONFIG, max_position_embeddings=512)}
    p = parameters(add_model(folder(tmp_path, config=config), tmp_path / "repo"))
    assert p["image_input"] == "true" and p["context_length"] == "512" and p["grammar_kinds"] == ""


def test_the_model_cards_sampling_becomes_the_default(tmp_path):
    generation = {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    p = parameters(add_model(folder(tmp_path, generation=generation), tmp_path / "repo"))
    assert json.loads(p["default_sampling"]) == {"temperature": 0.6, "top_p": 0.95}


@pytest.mark.parametrize("recorded, expected", [("Qwen/Qwen2-0.5B", "Qwen/Qwen2-0.5B"), ("/home/me/ckpt", "my-model"),
                                                (None, "my-model")])
def test_served_name_from_the_config_else_the_folder(tmp_path, recorded, expected):
    config = dict(LLAMA_CONFIG, **({"_name_or_path": recorded} if recorded else {}))
    assert parameters(add_model(folder(tmp_path, config=config), tmp_path / "repo"))["served_name"] == expected


def test_the_command_line_writes_the_folder_and_refuses_a_non_model(tmp_path, capsys):
    assert main([str(folder(tmp_path)), "--repository", str(tmp_path / "repo"), "--name", "x/y",
                 "--model-path", "/models/my-model"]) == 0
    assert parameters(tmp_path / "repo" / "x_y")["hf_model"] == "/models/my-model"
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--repository", str(tmp_path / "repo")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_make_serve_picks_model_then_model_repository_then_the_default(tmp_path):
    path = folder(tmp_path)
    repo = model_repository({"MODEL": str(path), "SERVED_NAME": "me/mine", "KV_CACHE_DTYPE": "bfloat16"},
                            build_dir=tmp_path / "build")
    (only,) = [p for p in repo.iterdir() if p.is_dir()]
    assert parameters(only)["served_name"] == "me/mine" and parameters(only)["kv_cache_dtype"] == "bfloat16"
    assert model_repository({"MODEL_REPOSITORY": str(tmp_path)}) == tmp_path.resolve()
    assert model_repository({}).name == "model_repository"
