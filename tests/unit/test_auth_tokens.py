"""The key table: tenants from keys (a keyed hash, never the key) or from operator names; the keys file re-read when
it changes or on SIGHUP; a broken file keeps the last good keys."""

from __future__ import annotations

import os
import stat

import pytest

from gateway.auth_tokens import KeysFileError, TokenTable, load_secret, parse_keys_file

SECRET = b"s" * 32
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-fedcba9876543210"


def _write(path, text: str) -> None:
    """Replace the file the way operators and Kubernetes do: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_parse_keys_file_reads_keys_tenants_and_comments():
    text = f"# keys\n\n{KEY_A}\nteam-b {KEY_B}   # the build bots\n  # indented comment\n"
    assert [(e.key, e.tenant) for e in parse_keys_file(text)] == [(KEY_A, None), (KEY_B, "team-b")]


@pytest.mark.parametrize("line", ["team a key", "team/a key", "-team key", "a" * 65 + " key"])
def test_a_malformed_line_is_named_by_number_not_content(line):
    with pytest.raises(KeysFileError) as raised:
        parse_keys_file(f"{KEY_A}\n{line}\n")
    assert "line 2" in str(raised.value)
    assert line not in str(raised.value)


def test_tenants_are_keyed_hashes_or_names_and_never_the_key():
    table = TokenTable((KEY_A,), None, SECRET, salted=True)
    tenant = table.tenant_for(KEY_A)
    assert tenant is not None and tenant.owner.startswith("key:") and KEY_A not in tenant.owner
    assert tenant.cache_salt and KEY_A not in tenant.cache_salt and tenant.cache_salt != tenant.owner
    assert KEY_A not in repr(tenant)
    # the same key under the same secret is the same tenant (another worker, a restart); another secret is not
    assert TokenTable((KEY_A,), None, SECRET, salted=True).tenant_for(KEY_A) == tenant
    assert TokenTable((KEY_A,), None, b"t" * 32, salted=True).tenant_for(KEY_A) != tenant
    assert table.tenant_for(KEY_B) is None and table.tenant_for(KEY_A[:-1]) is None


def test_keys_of_one_named_tenant_share_it(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"team-a {KEY_A}\nteam-a {KEY_B}\n")
    table = TokenTable((), str(keys), SECRET, salted=True)
    a, b = table.tenant_for(KEY_A), table.tenant_for(KEY_B)
    assert a is not None and a == b and a.owner == "tenant:team-a"


def test_global_scope_sends_no_salt():
    tenant = TokenTable((KEY_A,), None, SECRET, salted=False).tenant_for(KEY_A)
    assert tenant is not None and tenant.cache_salt is None


def test_a_changed_file_is_read_before_the_next_check(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n")
    table = TokenTable(("env-key",), str(keys), SECRET, salted=True)
    assert table.tenant_for(KEY_A) is not None and table.tenant_for(KEY_B) is None
    _write(keys, f"{KEY_B}\n")
    assert table.tenant_for(KEY_A) is None  # removed: refused from the next check on
    assert table.tenant_for(KEY_B) is not None
    assert table.tenant_for("env-key") is not None  # SIE_AUTH_TOKENS keys stay


def test_sighup_reads_a_rewrite_that_kept_size_and_mtime(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n")
    table = TokenTable((), str(keys), SECRET, salted=True)
    assert table.tenant_for(KEY_A) is not None
    before = os.stat(keys)
    with open(keys, "r+") as same_file:  # same inode, same size, the old mtime put back
        same_file.write(f"{KEY_B}\n")
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert table.tenant_for(KEY_A) is not None  # nothing the stat can see
    table.reload_soon()
    assert table.tenant_for(KEY_A) is None and table.tenant_for(KEY_B) is not None


def test_a_broken_file_keeps_the_last_good_keys_and_is_a_startup_error(tmp_path, caplog):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n")
    table = TokenTable((), str(keys), SECRET, salted=True)
    _write(keys, f"{KEY_B} and more fields\n")
    assert table.tenant_for(KEY_A) is not None and table.tenant_for(KEY_B) is None
    assert "could not be used" in caplog.text and KEY_B not in caplog.text
    keys.unlink()
    assert table.tenant_for(KEY_A) is not None
    with pytest.raises(KeysFileError):
        TokenTable((), str(keys), SECRET, salted=True)


def test_the_secret_is_made_once_private_and_shared(tmp_path):
    path = tmp_path / "state" / "tenant.secret"
    first = load_secret(str(path))
    assert load_secret(str(path)) == first and len(first) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
