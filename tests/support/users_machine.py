"""A user's machine on this one: commands that see only what a fresh laptop's pip sees.

This machine's pip is kinder than a user's: its configuration files add a directory of local wheels
(find-links), local indexes and a constraints file, and PIP_* variables add more. `as_a_user(command)` wraps a
command so that it runs in a mount namespace of its own where every such source is hidden (each config file
`pip config debug` names and each local directory a source points to is covered by an empty one), with no
PIP_* variables but the CA bundle's (KEPT): pip knows PyPI alone, and whatever else the command reaches (an
index it is given) it reaches over the network like any user's pip. The Python headers can be hidden too
(`hide_python_headers`: `make install` must then refuse in one line, since torch.compile builds vLLM's CPU
kernels against them). Root only; `unavailable()` says why not, for a skip.

    done = subprocess.run(as_a_user(["make", "install"], python=sys.executable), cwd=clone, ...)
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path
from urllib.parse import urlparse

PIP_SOURCES = ("find-links", "index-url", "extra-index-url", "constraint", "requirement")
# Kept: the CA bundle pip checks servers against. It names no package source; this machine reaches PyPI
# through a proxy whose certificate only the system bundle holds, as some companies' networks do.
KEPT = ("PIP_CERT",)


def unavailable() -> str:
    """Why a user's machine cannot be made here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (a mount namespace that hides this machine's pip configuration)"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount on PATH (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a mount namespace here (`unshare --mount` failed: {probe.stderr.strip()})"
    return ""


def pip_config(python: str) -> tuple[list[Path], list[Path]]:
    """This machine's pip configuration as `python -m pip` reads it: the config files that exist, and the
    local directories its sources (find-links, local indexes, constraints) point to."""
    debug = subprocess.run([python, "-m", "pip", "config", "debug"], capture_output=True, text=True,
                           check=True).stdout
    files = [Path(line.strip().split(",")[0]) for line in debug.splitlines()
             if line.strip().endswith("exists: True")]
    listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    values = [line.split("=", 1)[1].strip().strip("'") for line in listing.splitlines()
              if "=" in line and line.split("=", 1)[0].rsplit(".", 1)[-1] in PIP_SOURCES]
    values += [value for name, value in os.environ.items()
               if name.startswith("PIP_") and name[4:].lower().replace("_", "-") in PIP_SOURCES]
    dirs = []
    for value in values:
        for source in value.split():
            path = Path(urlparse(source).path) if source.startswith("file:") else Path(source)
            if not path.is_absolute() or not path.exists():
                continue                    # a URL: what a user's pip would reach too
            dirs.append(path if path.is_dir() else path.parent)
    return files, sorted(set(dirs))


def as_a_user(command: list[str], python: str, hide_python_headers: bool = False) -> list[str]:
    """`command` run where pip sees no source of this machine's (see the module's doc)."""
    files, dirs = pip_config(python)
    if hide_python_headers:
        dirs.append(Path(sysconfig.get_paths()["include"]))
    mounts = [f"mount --bind /dev/null {shlex.quote(str(f))}" for f in files]
    mounts += [f"mount -t tmpfs -o size=1m,mode=755 hidden {shlex.quote(str(d))}" for d in dirs]
    unset = [f"-u {name}" for name in os.environ if name.startswith("PIP_") and name not in KEPT]
    script = " && ".join([*mounts, f"exec env {' '.join(unset)} {shlex.join(command)}"])
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", script]


def stand_in_nvidia_smi(bin_dir: Path, listing: str, rc: int) -> Path:
    """A directory with an `nvidia-smi` that stands in for the driver's tool: what it prints for `-L`."""
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "nvidia-smi"
    stub.write_text(f"#!/bin/sh\nprintf '%s' '{listing}'\nexit {rc}\n")
    stub.chmod(0o755)
    return bin_dir


# What a one-GPU machine's nvidia-smi -L prints.
A_GPU = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\n"
