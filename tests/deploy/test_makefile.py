"""Which build the Makefile installs (`EXTRA`), read from `make -n` (a dry run: nothing is installed).

A venv keeps the build it was installed with: `make data` on a GPU-less pod of the CUDA image (KubeRay's head,
deploy/Dockerfile's `make install EXTRA=cuda`) must not reinstall the cpu build there. Only a fresh venv is
decided by nvidia-smi; `EXTRA=` on the command line forces one. Each case uses a venv directory of its own
(VENV=<tmp>/venv, holding only stamp files) and a PATH without nvidia-smi.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")

pytestmark = pytest.mark.skipif(MAKE is None, reason="no make")


def dry_run(venv: Path, *args: str, path_first: Path | None = None) -> list[str]:
    """The commands `make -n <args> VENV=venv` would run, as a user types it (not as a sub-make of
    `make test`), on a machine without nvidia-smi (path_first: a directory put first on PATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "EXTRA")}
    env["PATH"] = os.pathsep.join([*([str(path_first)] if path_first else []),
                                   *(d for d in env.get("PATH", "").split(os.pathsep)
                                     if d and not os.path.exists(os.path.join(d, "nvidia-smi")))])
    done = subprocess.run([MAKE, "--no-print-directory", "-n", *args, f"VENV={venv}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def pip_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line]


def test_a_venv_with_the_cuda_build_keeps_it_without_nvidia_smi(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cuda").touch()      # newer than the Makefile, setup.cfg and the lock files
    lines = dry_run(venv, "data")
    assert pip_installs(lines) == [], lines
    assert lines == [f"{venv}/bin/python -m env_servers.data prepare"], lines
    assert dry_run(venv, "data", "ONLY=alfworld") == [f"{venv}/bin/python -m env_servers.data prepare --only alfworld"]
    assert pip_installs(dry_run(venv, "install")) == []         # nothing to do: the cuda build is there
    # EXTRA given forces a build: here the cpu one, into the same venv.
    forced = dry_run(venv, "install", "EXTRA=cpu")
    assert any('".[cpu,redis,test]"' in line and "lock-cpu.txt" in line for line in pip_installs(forced)), forced
    assert forced[-1] == f"touch {venv}/.installed-cpu"


def test_a_fresh_venv_without_nvidia_smi_gets_the_cpu_build(tmp_path):
    venv = tmp_path / "venv"                 # does not exist: a fresh install
    lines = dry_run(venv, "data")
    installs = pip_installs(lines)
    assert any('".[cpu,redis,test]"' in line and "lock-cpu.txt" in line for line in installs), lines
    assert not any("cuda" in line for line in installs), lines
    assert f"touch {venv}/.installed-cpu" in lines
    assert lines[-1] == f"{venv}/bin/python -m env_servers.data prepare"
    # The same with EXTRA=cuda given: the cuda build, whatever the machine.
    forced = dry_run(venv, "install", "EXTRA=cuda")
    assert any('".[cuda,redis,test]"' in line and "lock-cuda.txt" in line for line in pip_installs(forced)), forced


@pytest.mark.parametrize("listing, rc, build", [
    ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\n", 0, "cuda"),
    # A GPU image booted on a CPU instance: the driver's nvidia-smi is there, but finds no GPU.
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", 9, "cpu"),
], ids=["lists-a-gpu", "driver-without-gpu"])
def test_a_fresh_venv_gets_cuda_only_where_nvidia_smi_lists_a_gpu(tmp_path, listing, rc, build):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "nvidia-smi"           # stands in for the driver's tool: what it prints for `-L`
    stub.write_text(f"#!/bin/sh\nprintf '%s' '{listing}'\nexit {rc}\n")
    stub.chmod(0o755)
    installs = pip_installs(dry_run(tmp_path / "venv", "install", path_first=bin_dir))
    assert any(f'".[{build},redis,test]"' in line and f"lock-{build}.txt" in line for line in installs), installs
