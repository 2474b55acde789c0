"""Where jitk finds nvcc: $JITK_NVCC, $CUDA_HOME, PATH, the nvidia-cuda-* wheels, in that
order (fake toolkits in tmp_path; nothing is compiled)."""

import sys

import pytest

import jitk
from jitk.build import toolchain


def fake_toolkit(root):
    """A folder laid out as a toolkit root: bin/nvcc and include/cuda_runtime.h."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho fake\n")
    nvcc.chmod(0o755)
    return root


@pytest.fixture
def no_toolkit_visible(monkeypatch, tmp_path):
    """No CUDA_HOME, no nvcc on PATH, no /usr/local/cuda, a site folder for fake wheels."""
    for var in (*toolchain.ROOT_ENVS, toolchain.NVCC_ENV):
        monkeypatch.delenv(var, raising=False)
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setattr(toolchain, "DEFAULT_ROOT", tmp_path / "no-usr-local-cuda")
    # Looked up afresh, not the root this process already found.
    monkeypatch.setattr(toolchain, "cuda_home", toolchain.cuda_home.__wrapped__)
    site = tmp_path / "site-packages"
    site.mkdir()
    # Only the fake site: a toolkit that the cuda extra installed into the real one would be
    # found first.
    monkeypatch.setattr(sys, "path", [str(site)])
    return site


def test_nothing_found_says_what_to_install(no_toolkit_visible):
    with pytest.raises(jitk.ToolchainError, match=r"pip install 'jitk\[cuda\]'"):
        toolchain.find_nvcc()
    assert toolchain.wheel_root() is None


def test_the_wheels_toolkit_is_found_last(no_toolkit_visible, tmp_path, monkeypatch):
    wheels = fake_toolkit(no_toolkit_visible / "nvidia" / "cu13")
    assert toolchain.find_nvcc() == (wheels / "bin" / "nvcc", "the nvidia-cuda-nvcc wheel")
    assert toolchain.cuda_home() == wheels

    on_path = fake_toolkit(tmp_path / "path-cuda")
    monkeypatch.setenv("PATH", str(on_path / "bin"))
    assert toolchain.find_nvcc() == (on_path / "bin" / "nvcc", "PATH")
    assert toolchain.cuda_home() == on_path

    home = fake_toolkit(tmp_path / "home-cuda")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert toolchain.find_nvcc() == (home / "bin" / "nvcc", "CUDA_HOME")
    assert toolchain.cuda_home() == home

    explicit = fake_toolkit(tmp_path / "explicit-cuda")
    monkeypatch.setenv("JITK_NVCC", str(explicit / "bin" / "nvcc"))
    assert toolchain.find_nvcc() == (explicit / "bin" / "nvcc", "JITK_NVCC")
    assert toolchain.cuda_home() == explicit


def test_bad_jitk_nvcc_is_named(no_toolkit_visible, tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_NVCC", str(tmp_path / "nvcc"))
    with pytest.raises(jitk.ToolchainError, match="JITK_NVCC=.* is not an executable file"):
        toolchain.find_nvcc()
    lone = tmp_path / "lone" / "nvcc"
    lone.parent.mkdir()
    lone.write_text("#!/bin/sh\n")
    lone.chmod(0o755)
    monkeypatch.setenv("JITK_NVCC", str(lone))
    with pytest.raises(jitk.ToolchainError, match="belongs to no CUDA toolkit root"):
        toolchain.cuda_home()


def test_wheels_libcudart_is_named_to_the_linker(no_toolkit_visible, monkeypatch):
    wheels = fake_toolkit(no_toolkit_visible / "nvidia" / "cu13")
    monkeypatch.setattr(toolchain, "cuda_home", lambda: wheels)
    (wheels / "lib").mkdir()
    for name in ("libcudart.so.13.0.88", "libcudart.so.13"):
        (wheels / "lib" / name).write_bytes(b"")
    assert toolchain.cudart_link_flags() == [f"-L{wheels / 'lib'}", "-l:libcudart.so.13"]
    (wheels / "lib64").mkdir()  # an installed toolkit's lib64 has the linker's name
    (wheels / "lib64" / "libcudart.so").write_bytes(b"")
    assert toolchain.cudart_link_flags() == [f"-L{wheels / 'lib64'}", "-lcudart"]
