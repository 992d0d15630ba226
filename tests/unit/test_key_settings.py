"""Per-key settings in the keys file: read after the key, checked when the file is read (a bad one names its line and
setting, never the key), and carried to the key's tenant; lines without settings read as before."""

from __future__ import annotations

import pytest

from gateway.auth_tokens import KeysFileError, TokenTable, parse_keys_file
from gateway.key_settings import DEFAULT_POLICY, KeyPolicy

SECRET = b"s" * 32
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-fedcba9876543210"


def test_settings_follow_the_key_on_named_and_key_only_lines():
    text = (f"team-a {KEY_A} priority=-5..5 weight=2 max_concurrent=8 tpm=20000  # team a\n"
            f"{KEY_B} priority=3 weight=0.5\n")
    named, alone = parse_keys_file(text)
    assert (named.key, named.tenant) == (KEY_A, "team-a")
    assert named.policy == KeyPolicy(priority_min=-5, priority_max=5, weight=2.0, max_concurrent=8, tpm=20000)
    assert (alone.key, alone.tenant) == (KEY_B, None)  # a setting second is not a tenant name
    assert alone.policy == KeyPolicy(priority_min=3, priority_max=3, weight=0.5)


def test_no_settings_is_the_default_policy_no_limit_and_no_queue_jumping():
    (entry,) = parse_keys_file(f"team-a {KEY_A}\n")
    assert entry.policy == DEFAULT_POLICY
    assert (DEFAULT_POLICY.priority_min, DEFAULT_POLICY.priority_max) == (0, 1000)
    assert DEFAULT_POLICY.weight == 1.0 and DEFAULT_POLICY.max_concurrent is None and DEFAULT_POLICY.tpm is None
    assert not DEFAULT_POLICY.limited


@pytest.mark.parametrize(("setting", "named"), [
    ("priority=5..-5", "priority"), ("priority=-1001..0", "priority"), ("priority=low", "priority"),
    ("priority=1.5", "priority"), ("weight=0", "weight"), ("weight=-1", "weight"), ("weight=nan", "weight"),
    ("weight=1001", "weight"), ("max_concurrent=0", "max_concurrent"), ("max_concurrent=two", "max_concurrent"),
    ("tpm=0", "tpm"), ("tpm=-5", "tpm"), ("tpm=1e5", "tpm"),
])
def test_a_bad_value_names_the_line_and_setting_never_the_key(setting, named):
    with pytest.raises(KeysFileError) as raised:
        parse_keys_file(f"{KEY_B}\nteam-a {KEY_A} {setting}\n")
    assert "line 2" in str(raised.value) and f"'{named}'" in str(raised.value)
    assert KEY_A not in str(raised.value)


@pytest.mark.parametrize("line", [f"team-a {KEY_A} rpm=5", f"team-a {KEY_A} tpm=5 tpm=6", f"team-a {KEY_A} extra",
                                  f"team/a {KEY_A} tpm=5"])
def test_an_unknown_repeated_or_stray_field_fails_the_line(line):
    with pytest.raises(KeysFileError) as raised:
        parse_keys_file(line + "\n")
    assert "line 1" in str(raised.value) and KEY_A not in str(raised.value)


def test_the_tenant_carries_the_policy_and_a_fair_share_id_in_either_cache_scope(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"team-a {KEY_A} weight=3 tpm=100\nteam-a {KEY_B}\n")
    for salted in (True, False):
        table = TokenTable((), str(keys), SECRET, salted=salted)
        a, b = table.tenant_for(KEY_A), table.tenant_for(KEY_B)
        assert a is not None and b is not None
        assert a.policy.weight == 3 and a.policy.tpm == 100 and b.policy == DEFAULT_POLICY
        # one tenant for fair sharing, whatever the cache scope; each key its own limits
        assert a.fair_share and a.fair_share == b.fair_share and a.key_id != b.key_id
        assert a.fair_share != a.cache_salt and "team-a" not in a.fair_share
        assert KEY_A not in a.key_id and KEY_A not in repr(a)
