"""The accepted API keys and the tenant each belongs to; the keys file is re-read when it changes or on SIGHUP.

A key's tenant is what scopes its stored responses and its prefix-cache entries (docs/auth.md). It is the tenant
name the operator gave the key in `SIE_AUTH_TOKENS_FILE`, or else a keyed hash of the key (HMAC-SHA256 under a
secret the gateway keeps in `SIE_TENANT_SECRET_FILE`), so the key itself is never stored, logged or sent on: only
its tenant leaves this module.

The keys file, one entry a line (blank lines and `#` comments ignored):

    3f9c0a...            a key alone: its own tenant
    team-a 91ab02...     a tenant name, then a key: every key of team-a shares its responses and its cache
    team-b 5d0e77... priority=-5..5 weight=2 max_concurrent=8 tpm=20000
                         optional per-key settings after the key (gateway/key_settings.py)

Every authenticated request stats the file (microseconds, a local file): a changed inode, size or mtime reloads it
before the request is checked, so a removed key is refused from its next request on. SIGHUP forces a reload (a
rewrite that kept all three). A file that cannot be read or parsed keeps the last good table (logged, without
its content); at start it is a startup error.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from gateway.key_settings import DEFAULT_POLICY, OPEN_POLICY, KeyPolicy, KeySettingError, is_setting, parse_key_settings

log = logging.getLogger(__name__)

_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ANONYMOUS_OWNER = "anonymous"  # auth off: every client is this one tenant


@dataclass(frozen=True)
class Tenant:
    """Who a request is, as far as scoping goes. `owner` marks its stored responses; `cache_salt` (None: the
    shared cache) keys its prefix-cache blocks in the engine; `fair_share` (None: the one shared tenant) is who the
    engine's fair sharing sees, whatever the cache scope; `policy` is the key's own settings and `key_id` the keyed
    hash its limits are counted under. None of them is, or reveals, the key."""

    owner: str
    cache_salt: str | None = None
    fair_share: str | None = None
    policy: KeyPolicy = field(default=DEFAULT_POLICY, compare=False)
    key_id: str = field(default="", compare=False)  # keys of one named tenant are one tenant, each with its limits

    def __repr__(self) -> str:  # owners are not secret, but they have no business in logs either
        return "Tenant(...)"


# with auth off nobody can be told apart, so nobody is held back: every priority is open, as on vLLM
ANONYMOUS = Tenant(ANONYMOUS_OWNER, policy=OPEN_POLICY)


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the line, never its content."""


class KeyEntry(NamedTuple):
    key: str
    tenant: str | None  # the operator's tenant name; None: the key is its own tenant
    policy: KeyPolicy = DEFAULT_POLICY


def parse_keys_file(text: str) -> list[KeyEntry]:
    """One entry per line that has one: `KEY` or `TENANT KEY`, then optional `name=value` settings."""
    entries: list[KeyEntry] = []
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split()
        comment = next((i for i, f in enumerate(fields) if f.startswith("#")), len(fields))
        fields = fields[:comment]  # a comment runs from a field that starts with '#' (so a key never does)
        if not fields:
            continue
        named = len(fields) > 1 and not is_setting(fields[1])
        if named and not _TENANT_NAME.match(fields[0]):
            raise KeysFileError(f"line {number}: expected 'KEY' or 'TENANT KEY' (TENANT: [A-Za-z0-9._-], "
                                "at most 64 characters), then settings NAME=VALUE")
        key, name, settings = (fields[1], fields[0], fields[2:]) if named else (fields[0], None, fields[1:])
        try:
            policy = parse_key_settings(settings) if settings else DEFAULT_POLICY
        except KeySettingError as exc:
            raise KeysFileError(f"line {number}: {exc}") from None
        entries.append(KeyEntry(key, name, policy))
    return entries


def load_secret(path: str | None) -> bytes:
    """The HMAC secret behind key-derived tenants, created once (random, mode 0600) and shared through the file by
    every worker and replica that points at it, so a tenant's owner is the same everywhere and after a restart.
    None: a secret of this process only (tests; owners then differ between processes)."""
    if path is None:
        return secrets.token_bytes(32)
    target = Path(path)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
        try:
            os.link(temporary, target)  # atomic, and fails if another worker made it first: then theirs is used
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
    secret = target.read_text().strip()
    if len(secret) < 32:
        raise KeysFileError(f"the tenant secret in {path} is shorter than 32 characters")
    return secret.encode()


class TokenTable:
    """Key -> Tenant, for the keys in `SIE_AUTH_TOKENS` (fixed) and in the keys file (live)."""

    def __init__(self, env_tokens: tuple[str, ...], keys_file: str | None, secret: bytes, *,
                 salted: bool) -> None:
        self._secret = secret
        self._salted = salted
        self._fixed: list[KeyEntry] = [KeyEntry(t, None) for t in env_tokens]
        self._file = keys_file
        self._signature: tuple[int, int, int] | None = None
        self._forced = False
        self._entries: list[tuple[bytes, Tenant]] = []
        self._rebuild([])
        if keys_file is not None:
            self._reload_file(strict=True)

    def tenant_for(self, key: str) -> Tenant | None:
        """The tenant of `key`, or None. Every entry is compared in constant time; the first match wins."""
        self._refresh()
        presented = key.encode()
        found: Tenant | None = None
        for known, tenant in self._entries:
            if hmac.compare_digest(presented, known) and found is None:
                found = tenant
        return found

    def __len__(self) -> int:
        self._refresh()
        return len(self._entries)

    def reload_soon(self) -> None:
        """SIGHUP: re-read the keys file before the next request is checked."""
        self._forced = True

    def _refresh(self) -> None:
        if self._file is None:
            return
        signature = _stat_signature(self._file)
        if self._forced or signature != self._signature:
            self._forced = False
            self._reload_file(strict=False)

    def _reload_file(self, *, strict: bool) -> None:
        assert self._file is not None
        signature = _stat_signature(self._file)
        try:
            entries = parse_keys_file(Path(self._file).read_text())
        except (OSError, UnicodeDecodeError, KeysFileError) as exc:
            if strict:
                raise KeysFileError(f"SIE_AUTH_TOKENS_FILE {self._file}: {_reason(exc)}") from None
            log.error("keeping the previous keys: SIE_AUTH_TOKENS_FILE %s could not be used (%s)",
                      self._file, _reason(exc))
            self._signature = signature  # report once per change, not once per request
            return
        self._signature = signature
        self._rebuild(entries)
        log.info("read %d keys from SIE_AUTH_TOKENS_FILE", len(entries))

    def _rebuild(self, file_entries: list[KeyEntry]) -> None:
        self._entries = [(entry.key.encode(), self._tenant(entry)) for entry in [*self._fixed, *file_entries]]

    def _tenant(self, entry: KeyEntry) -> Tenant:
        key_id = keyed_hash(self._secret, "key", entry.key)
        owner = f"tenant:{entry.tenant}" if entry.tenant is not None else "key:" + key_id
        return Tenant(owner, keyed_hash(self._secret, "prefix-cache", owner) if self._salted else None,
                      fair_share=keyed_hash(self._secret, "fair-share", owner), policy=entry.policy, key_id=key_id)


def keyed_hash(secret: bytes, purpose: str, value: str) -> str:
    """HMAC-SHA256 of `value` for one `purpose`, as 32 hex characters: the same value under the same secret is the
    same id in every worker and replica, and one purpose's id says nothing about another's."""
    return hmac.new(secret, f"{purpose}\0{value}".encode(), hashlib.sha256).hexdigest()[:32]


def _stat_signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # follows symlinks: a Kubernetes Secret volume swaps its `..data` link
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeysFileError):
        return str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return type(exc).__name__
