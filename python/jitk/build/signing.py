"""The remote cache's keys: ed25519 pairs written by `python -m jitk cache keygen DIR`, the
pusher's private key ($JITK_REMOTE_CACHE_KEY) and the public keys a puller trusts
($JITK_REMOTE_CACHE_TRUST). A key is named by its fingerprint: the first 16 hex digits of
the SHA-256 of its raw public bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from jitk.base import settings
from jitk.base.errors import JitkError

KEY_ENV = "JITK_REMOTE_CACHE_KEY"
TRUST_ENV = "JITK_REMOTE_CACHE_TRUST"


class RemoteCacheError(JitkError, RuntimeError):
    """The remote cache failed or refused an entry: unreachable, too slow, a garbled reply,
    or an artifact that is unsigned, tampered with, signed by an untrusted key or built for
    another key or architecture."""


def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise RemoteCacheError("the remote cache signs and verifies with the `cryptography` "
                               "package: pip install 'jitk[remote]'") from None
    return serialization, ed25519


def fingerprint(public_key) -> str:
    serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def keygen(folder: Path) -> tuple[Path, Path, str]:
    """A new key pair in `folder`: jitk-remote.key (private, 0600) and jitk-remote.pub.
    Existing files are never replaced."""
    serialization, ed25519 = _crypto()
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


def _read_key(path: str, private: bool, setting: str):
    serialization, ed25519 = _crypto()
    try:
        data = Path(path).expanduser().read_bytes()
        key = (serialization.load_pem_private_key(data, None) if private
               else serialization.load_pem_public_key(data))
    except (OSError, ValueError, TypeError) as error:
        raise RemoteCacheError(f"{setting}: {path} is not a readable PEM "
                               f"{'private' if private else 'public'} key ({error})") from None
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise RemoteCacheError(f"{setting}: {path} holds a {type(key).__name__}, not an "
                               "ed25519 key (python -m jitk cache keygen DIR makes one)")
    return key


def signing_key():
    path = settings.get(KEY_ENV)
    return _read_key(path, True, KEY_ENV) if path else None


def trusted_keys() -> dict[str, object]:
    """Fingerprint -> public key, for every file JITK_REMOTE_CACHE_TRUST names."""
    keys = (_read_key(path, False, TRUST_ENV) for path in settings.get(TRUST_ENV))
    return {fingerprint(key): key for key in keys}
