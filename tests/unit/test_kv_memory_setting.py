"""The profile's `kv_memory`: bytes with a unit or a fraction of free memory, refused by name when it is neither,
and turned into the KV pool's positions from the model's K/V bytes a token."""

from __future__ import annotations

import pytest
import torch

from contract.profile import ProfileError, parse_profile
from engine.model.kv_cache import free_memory, kv_tokens_for


@pytest.mark.parametrize(("text", "value"), [("1GiB", 2**30), ("512 MiB", 512 * 2**20), ("2000000000", 2 * 10**9),
                                             ("1.5GB", 1_500_000_000), ("0.9", 0.9), ("1.0", 1.0)])
def test_bytes_or_a_fraction(text, value):
    assert parse_profile({"hf_model": "m", "kv_memory": text}).kv_memory == value


@pytest.mark.parametrize("text", ["lots", "1 GiBs", "0.0", "1.5", "512", "-1GiB", "1e9"])
def test_anything_else_is_refused_by_name(text):
    with pytest.raises(ProfileError) as info:
        parse_profile({"hf_model": "m", "kv_memory": text})
    assert info.value.key == "kv_memory"


def test_unset_leaves_the_positions_to_kv_budget_tokens():
    assert parse_profile({"hf_model": "m"}).kv_memory is None


def test_bytes_become_positions_at_the_models_kv_bytes_a_token():
    # SmolLM2: 30 layers x 3 KV heads x 64 x 2 (K and V) x 4 bytes = 46,080 bytes a token in fp32
    assert kv_tokens_for(2**30, 30, 3, 64, torch.float32, torch.device("cpu")) == 2**30 // 46080
    assert kv_tokens_for(2**30, 30, 3, 64, torch.bfloat16, torch.device("cpu")) == 2**30 // 23040
    with pytest.raises(ValueError, match="too few"):
        kv_tokens_for(2**20, 30, 3, 64, torch.float32, torch.device("cpu"))


def test_a_fraction_is_of_the_memory_free_now():
    free = free_memory(torch.device("cpu"))
    tokens = kv_tokens_for(0.5, 30, 3, 64, torch.float32, torch.device("cpu"))
    assert abs(tokens - free // 2 // 46080) <= free // 20 // 46080  # free memory moves a little meanwhile
