"""The remote cache's keys: ed25519 pairs written by `python -m jitk cache keygen DIR`, the
pusher's private key ($JITK_REMOTE_CACHE_KEY) and the public keys a puller trusts
($JITK_REMOTE_CACHE_TRUST). A key is named by its fingerprint: the first 16 hex digits of
the SHA-256 of its raw public bytes."""

from __future__ import annotations

import base64
import hashlib
import importlib
import os
import re
from pathlib import Path

from jitk.base import settings
from jitk.base.errors import JitkError

KEY_ENV = "JITK_REMOTE_CACHE_KEY"
TRUST_ENV = "JITK_REMOTE_CACHE_TRUST"


class RemoteCacheError(JitkError, RuntimeError):
    """The remote cache failed or refused an entry: unreachable, too slow, a garbled reply,
    or an artifact that is unsigned, tampered with, signed by an untrusted key or built for
    another key or architecture."""


# A PEM public key of an ed25519 pair is this DER prefix (RFC 8410's SubjectPublicKeyInfo)
# and the 32 raw bytes: read by hand, a puller imports only cryptography's ed25519 part,
# not its serialization package (most of a cold pull's import time).
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PEM_PUBLIC = re.compile(rb"-----BEGIN PUBLIC KEY-----([A-Za-z0-9+/=\s]+)-----END PUBLIC KEY-----")


def _imported(name: str):
    try:
        return importlib.import_module(f"cryptography.hazmat.primitives.{name}")
    except ImportError:
        raise RemoteCacheError("the remote cache signs and verifies with the `cryptography` "
                               "package: pip install 'jitk[remote]'") from None


def _ed25519():
    return _imported("asymmetric.ed25519")


def _serialization():  # keygen and the pusher's private key only
    return _imported("serialization")


def fingerprint(public_key) -> str:
    return "ed25519:" + hashlib.sha256(public_key.public_bytes_raw()).hexdigest()[:16]


def keygen(folder: Path) -> tuple[Path, Path, str]:
    """A new key pair in `folder`: jitk-remote.key (private, 0600) and jitk-remote.pub.
    Existing files are never replaced."""
    serialization, ed25519 = _serialization(), _ed25519()
    private, public = folder / "jitk-remote.key", folder / "jitk-remote.pub"
    for path in (private, public):
        if path.exists():
            raise RemoteCacheError(f"cache keygen: {path} exists; jitk never replaces a key "
                                   "(move it away or give another folder)")
    folder.mkdir(parents=True, exist_ok=True)
    key = ed25519.Ed25519PrivateKey.generate()
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public, fingerprint(key.public_key())


def _read_private_key(path: str):
    serialization, ed25519 = _serialization(), _ed25519()
    try:
        key = serialization.load_pem_private_key(Path(path).expanduser().read_bytes(), None)
    except (OSError, ValueError, TypeError) as error:
        raise RemoteCacheError(f"{KEY_ENV}: {path} is not a readable PEM private key "
                               f"({error})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise RemoteCacheError(f"{KEY_ENV}: {path} holds a {type(key).__name__}, not an "
                               "ed25519 key (python -m jitk cache keygen DIR makes one)")
    return key


def _read_public_key(path: str):
    ed25519 = _ed25519()
    try:
        found = _PEM_PUBLIC.search(Path(path).expanduser().read_bytes())
        der = base64.b64decode(b"".join(found[1].split()), validate=True) if found else b""
    except (OSError, ValueError) as error:
        raise RemoteCacheError(f"{TRUST_ENV}: {path} is not a readable PEM public key "
                               f"({error})") from None
    if len(der) != len(_SPKI_PREFIX) + 32 or not der.startswith(_SPKI_PREFIX):
        raise RemoteCacheError(f"{TRUST_ENV}: {path} holds no ed25519 public key (python -m "
                               "jitk cache keygen DIR makes one)")
    return ed25519.Ed25519PublicKey.from_public_bytes(der[len(_SPKI_PREFIX):])


def signing_key():
    path = settings.get(KEY_ENV)
    return _read_private_key(path) if path else None


def trusted_keys() -> dict[str, object]:
    """Fingerprint -> public key, for every file JITK_REMOTE_CACHE_TRUST names."""
    keys = (_read_public_key(path) for path in settings.get(TRUST_ENV))
    return {fingerprint(key): key for key in keys}
