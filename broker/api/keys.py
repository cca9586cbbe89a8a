"""API keys: who may call the broker, as what role, on which topics.

A key is `dq_<id>_<secret>`. The key file holds, per key, its id, a name, the SHA-256 of
its secret (never the secret: a stolen file lets no one in; the secret is 32 random
bytes, so a plain hash is as strong as a slow one) and its grants: roles on topic
globs. Every node reads the file its configuration names and reads it again when it
changes, so `dejaq keys add` and `revoke` take effect on it within a second or two, with
no restart. Nodes on several hosts must read the same file (shared, or copied to each
after every change): a follower lets in what its own file holds, and the leader takes
its forward only for a key its own file holds, with the role the call needs. A node
that cannot read its file again (its mode, or a bad hand edit) holds no keys until it
can: a key revoked in the file it cannot read must not go on working there.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dejaq.conf.settings import ConfigError

ROLES = ("produce", "consume", "operate", "read", "monitor")
PREFIX = "dq"
RELOAD_EVERY_S = 1.0
FORMAT = 1
log = logging.getLogger("dejaq.broker")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-@")


class KeyFileError(ConfigError):
    """The key file is unreadable or malformed, or a key operation is invalid."""


@dataclass(frozen=True)
class Grant:
    role: str
    topics: tuple[str, ...]  # globs: `orders`, `orders.*`, `*`


@dataclass(frozen=True)
class Key:
    id: str
    name: str
    sha256: str
    grants: tuple[Grant, ...]
    created_at: int  # epoch ms

    def allows(self, role: str, topic: str | None) -> bool:
        """Whether a grant gives `role` on `topic` (any topic's grant, for a topic-less
        route such as /metrics)."""
        for grant in self.grants:
            if grant.role != role:
                continue
            if topic is None or any(fnmatch.fnmatchcase(topic, g) for g in grant.topics):
                return True
        return False

    def describe(self) -> dict[str, Any]:
        """What `dejaq keys list` shows: everything but the hash."""
        grants = [{"role": g.role, "topics": list(g.topics)} for g in self.grants]
        return {"name": self.name, "id": self.id, "created_at": self.created_at, "grants": grants}


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_token(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed key, else None."""
    prefix, _, rest = token.partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != PREFIX or not key_id or not secret:
        return None
    return key_id, secret


def read_keys(path: Path) -> dict[str, Key]:
    """The keys in `path` by id; an absent file holds none. Any file that is not of the
    format, however it fails, is a `KeyFileError`: a node then holds no keys."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        raise KeyFileError(f"key file {path}: {e}") from None
    try:
        keys = [_key(k) for k in _field(data, "keys", list)]
    except _Malformed as e:
        raise KeyFileError(f"key file {path}: malformed ({e})") from None
    return {k.id: k for k in keys}


class _Malformed(Exception):
    """A key file's field missing or not of the format's type."""


def _field(data: object, name: str, kind: type) -> Any:
    """`data[name]`, of type `kind` (a bool is no int)."""
    if not isinstance(data, dict):
        raise _Malformed(f"{type(data).__name__} where an object with {name!r} belongs")
    if name not in data:
        raise _Malformed(f"no {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _Malformed(f"{name!r} is {type(value).__name__}, not {kind.__name__}")
    return value


def _strings(data: object, name: str) -> tuple[str, ...]:
    """`data[name]`, a list of strings."""
    values = _field(data, name, list)
    if not all(isinstance(v, str) for v in values):
        raise _Malformed(f"{name!r} holds other than strings")
    return tuple(values)


def _key(data: object) -> Key:
    """One key of the file; its hash 64 hex digits, as the constant-time check needs."""
    sha256 = _field(data, "sha256", str)
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise _Malformed("'sha256' is not 64 hex digits")
    grants = tuple(
        Grant(_field(g, "role", str), _strings(g, "topics")) for g in _field(data, "grants", list)
    )
    return Key(
        id=_field(data, "id", str),
        name=_field(data, "name", str),
        sha256=sha256,
        grants=grants,
        created_at=_field(data, "created_at", int),
    )


def _write(path: Path, keys: dict[str, Key]) -> None:
    """Atomically: a reader sees the old file or the new one. The new file keeps the old
    one's mode, owner and group (the nodes may read it as another user, or through its
    group); a change that could not keep them is refused, the old file left in place.
    A first file is owner-only."""
    body = json.dumps({"format": FORMAT, "keys": [asdict(k) for k in keys.values()]}, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old: os.stat_result | None = path.stat()
    except FileNotFoundError:
        old = None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            if old is not None:
                _keep_owner(f.fileno(), path, old)
            f.write(body + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _keep_owner(fd: int, path: Path, old: os.stat_result) -> None:
    """Give the open new file `fd` the mode, owner and group of the old `path`."""
    os.fchmod(fd, stat.S_IMODE(old.st_mode))
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) == (old.st_uid, old.st_gid):
        return
    try:
        os.fchown(fd, old.st_uid, old.st_gid)
    except PermissionError:
        with contextlib.suppress(PermissionError):
            os.fchown(fd, -1, old.st_gid)
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (old.st_uid, old.st_gid):
        raise KeyFileError(
            f"key file {path} belongs to uid {old.st_uid}, gid {old.st_gid}; a copy written "
            "by this user could not keep them, and nodes reading it as them could not read "
            "it: run this as the file's owner (or root)"
        )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One key-file change at a time (two `dejaq keys add` at once keep both keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def add_key(path: Path, name: str, roles: Sequence[str], topics: Sequence[str]) -> str:
    """A new key named `name` with `roles` on `topics`; returns the key, which is
    stored nowhere and cannot be shown again."""
    if not name or not set(name) <= _NAME_CHARS or len(name) > 100:
        raise KeyFileError(f"key name {name!r}: 1-100 of letters, digits and ._-@")
    unknown = [r for r in roles if r not in ROLES]
    if unknown or not roles:
        raise KeyFileError(f"roles: give one or more of {', '.join(ROLES)} (got {list(roles)})")
    if not topics or any(not t for t in topics):
        raise KeyFileError("topics: give one or more topic names or globs ('*' for every one)")
    with _locked(path):
        keys = read_keys(path)
        if any(k.name == name for k in keys.values()):
            raise KeyFileError(f"a key named {name!r} exists: revoke it first, or pick a name")
        key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
        grants = tuple(Grant(r, tuple(topics)) for r in dict.fromkeys(roles))
        keys[key_id] = Key(key_id, name, digest(secret), grants, time.time_ns() // 1_000_000)
        _write(path, keys)
    return f"{PREFIX}_{key_id}_{secret}"


def revoke_key(path: Path, name: str) -> Key:
    """Remove the key named `name` (or of that id); nodes reading this file refuse it
    within a second or two."""
    with _locked(path):
        keys = read_keys(path)
        found = [k for k in keys.values() if name in (k.name, k.id)]
        if not found:
            raise KeyFileError(f"no key named {name!r} in {path}")
        del keys[found[0].id]
        _write(path, keys)
    return found[0]


class KeyRing:
    """The keys of one file, read again when it changes (looked at once a second)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._keys: dict[str, Key] = {}
        self._seen: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._failed: tuple[tuple[int, int, int] | None, str] | None = None
        self.error: str | None = None  # why the file could not be read again, if so
        self.reload()

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise KeyFileError(f"key file {self.path}: {e}") from None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload(self) -> None:
        """Read the file if it changed; raises `KeyFileError` if it cannot (at start: a
        node does not start on a file it cannot read)."""
        signature = self._signature()
        if signature == self._seen and self._seen is not None:
            return
        keys = read_keys(self.path)
        with self._lock:
            self._keys, self._seen = keys, signature

    def check(self) -> str | None:
        """Read the file again if it changed, at most once a second; why this node holds
        no keys (the file changed and cannot be read), or None. Logged once a change."""
        now = time.monotonic()
        if now - self._checked < RELOAD_EVERY_S:
            return self.error
        self._checked = now
        try:
            self.reload()
        except KeyFileError as e:
            failed = (self._signature_or_none(), str(e))
            with self._lock:
                # Fail closed: the keys held may include one the unreadable file revokes.
                self._keys, self._seen, self.error = {}, None, str(e)
                logged, self._failed = self._failed == failed, failed
            if not logged:
                log.error("%s; every call with a key is refused until it can be read", e)
        else:
            with self._lock:
                recovered, self.error, self._failed = self.error is not None, None, None
            if recovered:
                log.warning("key file %s read again: its keys are in force", self.path)
        return self.error

    def _signature_or_none(self) -> tuple[int, int, int] | None:
        try:
            return self._signature()
        except KeyFileError:
            return None

    def get(self, key_id: str) -> Key | None:
        """The key of id `key_id`, which a node's forward names as the one it let the
        caller in with; None if this file lacks it. The file is looked at again before
        a key is found missing: the forwarding node may have read a newer one."""
        self.check()
        if key_id not in self._keys and self.error is None:
            self._checked = 0.0
            self.check()
        return self._keys.get(key_id)

    def authenticate(self, token: str) -> Key | None:
        """The key `token` is, compared in constant time; None for any other token."""
        self.check()
        parts = split_token(token)
        key = self._keys.get(parts[0]) if parts is not None else None
        expected = key.sha256 if key is not None else "0" * 64
        given = digest(parts[1]) if parts is not None else "1" * 64
        return key if hmac.compare_digest(expected, given) and key is not None else None
