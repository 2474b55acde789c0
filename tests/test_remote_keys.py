"""The remote cache's keys without a registry: what a puller reads and what it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from child_env import PYTHON_PATH

pytest.importorskip("cryptography", reason="the remote cache needs `cryptography` (jitk[remote])")
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: E402

from jitk.build import signing  # noqa: E402

READ_TRUSTED = """
import json, sys
from jitk.build import signing
keys = signing.trusted_keys()
print(json.dumps({"fingerprints": sorted(keys),
                  "modules": sorted(m for m in sys.modules if m.startswith("cryptography"))}))
"""


def test_a_puller_imports_only_the_ed25519_part_of_cryptography(tmp_path):
    _, public, fingerprint = signing.keygen(tmp_path)
    env = {**os.environ, "PYTHONPATH": PYTHON_PATH, "JITK_REMOTE_CACHE_TRUST": str(public)}
    read = subprocess.run([sys.executable, "-c", READ_TRUSTED], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert read.returncode == 0, read.stderr
    found = json.loads(read.stdout)
    assert found["fingerprints"] == [fingerprint]
    assert "cryptography.hazmat.primitives.asymmetric.ed25519" in found["modules"]
    assert "cryptography.hazmat.primitives.serialization" not in found["modules"]


def test_the_fingerprint_is_that_of_the_key_cryptography_reads(tmp_path, monkeypatch):
    _, public, fingerprint = signing.keygen(tmp_path)
    monkeypatch.setenv(signing.TRUST_ENV, str(public))
    assert list(signing.trusted_keys()) == [fingerprint]
    assert signing.fingerprint(serialization.load_pem_public_key(public.read_bytes())) == \
        fingerprint


def _rsa_public() -> bytes:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.mark.parametrize("content,reason", [
    (b"not a key\n", "holds no ed25519 public key"),
    (b"-----BEGIN PUBLIC KEY-----\n!!!!\n-----END PUBLIC KEY-----\n", "holds no ed25519"),
    (b"-----BEGIN PUBLIC KEY-----\nMCowBQ=x=\n-----END PUBLIC KEY-----\n", "not a readable"),
    (None, "holds no ed25519 public key"),  # an RSA key
    ("private", "holds no ed25519 public key"),  # the private key of a pair
])
def test_a_trusted_key_file_that_is_no_ed25519_public_key_is_refused(tmp_path, monkeypatch,
                                                                     content, reason):
    path = tmp_path / "trusted.pub"
    if content == "private":
        path, _, _ = signing.keygen(tmp_path / "pair")
    else:
        path.write_bytes(_rsa_public() if content is None else content)
    monkeypatch.setenv(signing.TRUST_ENV, str(path))
    with pytest.raises(signing.RemoteCacheError) as refused:
        signing.trusted_keys()
    assert signing.TRUST_ENV in str(refused.value) and str(path) in str(refused.value)
    assert reason in str(refused.value)


def test_a_missing_trusted_key_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(signing.TRUST_ENV, str(tmp_path / "absent.pub"))
    with pytest.raises(signing.RemoteCacheError, match="not a readable PEM public key"):
        signing.trusted_keys()
