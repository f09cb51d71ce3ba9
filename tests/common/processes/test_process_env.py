"""The project sets its own environment (common.processes.process_env): the variables and their node-dependent values,
a user's value winning, the driver's runtime env (never the project's own values, never a key the job's
runtime env sets), that every actor constructor sets them first, and, with a real Ray in a process started
with a clean environment (no make, no env.sh), an actor that gets the variables from its own constructor and
a driver under a `ray job submit`-style runtime env that starts without a conflict."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray.runtime_env.runtime_env import _merge_runtime_env

from common.processes.process_env import (GIB, RAY_JOB_CONFIG_VAR, apply_project_env, cpu_kv_cache_gib,
                                          driver_runtime_env, project_env)

REPO = Path(__file__).resolve().parents[3]
CPU_ONLY = {"VLLM_ALLOW_INSECURE_SERIALIZATION", "TOKENIZERS_PARALLELISM", "RAY_USAGE_STATS_ENABLED",
            "DS_ACCELERATOR", "VLLM_CPU_KVCACHE_SPACE"}


def test_the_variables_on_cpu_and_gpu_nodes():
    cpu = project_env(gpu_node=False, memory_bytes=24 * GIB)
    assert set(cpu) == CPU_ONLY
    assert cpu["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and cpu["DS_ACCELERATOR"] == "cpu"
    assert cpu["VLLM_CPU_KVCACHE_SPACE"] == "1" and cpu["TOKENIZERS_PARALLELISM"] == "false"
    gpu = project_env(gpu_node=True)
    # vLLM's CUDA build sizes its cache from gpu_memory_utilization; DeepSpeed finds CUDA itself.
    assert set(gpu) == CPU_ONLY - {"DS_ACCELERATOR", "VLLM_CPU_KVCACHE_SPACE"}


@pytest.mark.parametrize("memory_gib, want", [(2, 1), (24, 1), (32, 2), (64, 4), (256, 16), (2048, 16)])
def test_cpu_kv_cache_is_a_sixteenth_of_the_memory_between_1_and_16_gib(memory_gib, want):
    assert cpu_kv_cache_gib(memory_gib * GIB) == want


def test_a_users_value_wins():
    environ = {"VLLM_CPU_KVCACHE_SPACE": "7", "TOKENIZERS_PARALLELISM": "true"}
    added = apply_project_env(environ)
    assert environ["VLLM_CPU_KVCACHE_SPACE"] == "7" and environ["TOKENIZERS_PARALLELISM"] == "true"
    assert "VLLM_CPU_KVCACHE_SPACE" not in added and added["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert apply_project_env(environ) == {}       # idempotent


def test_driver_runtime_env_forwards_only_the_users_settings():
    environ = {"HF_HOME": "/models", "VLLM_CPU_KVCACHE_SPACE": "1", "DS_ACCELERATOR": "cpu", "HOME": "/root",
               "GIGPO_REDIS_PASSWORD": "secret", "OMP_NUM_THREADS": "4"}
    # What the project set is computed on each node (a GPU learner must not get a CPU head's
    # DS_ACCELERATOR); what is not a library setting (HOME, the Redis password) stays here.
    env = driver_runtime_env(environ, project_set={"VLLM_CPU_KVCACHE_SPACE": "1", "DS_ACCELERATOR": "cpu"})
    assert env == {"env_vars": {"HF_HOME": "/models", "OMP_NUM_THREADS": "4"}}
    assert driver_runtime_env({"HOME": "/root"}, project_set={}) is None


def test_driver_runtime_env_merges_with_a_jobs_runtime_env():
    """Under `ray job submit --runtime-env-json '{"env_vars": {...}}'` the driver's environment holds the job's
    variables too: naming them again made Ray refuse to start ("Failed to merge the Job's runtime env")."""
    job = {"runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HOME": "/job-models"},
                           "working_dir": "/app"}}
    environ = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HOME": "/job-models", "HF_TOKEN_PATH": "/t",
               RAY_JOB_CONFIG_VAR: json.dumps(job)}
    env = driver_runtime_env(environ, project_set={})
    assert env == {"env_vars": {"HF_TOKEN_PATH": "/t"}}
    merged = _merge_runtime_env(job["runtime_env"], env)      # Ray's own merge (None: a conflict)
    assert merged["env_vars"] == {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HOME": "/job-models", "HF_TOKEN_PATH": "/t"}


# Every class the project runs as a Ray actor, by file: its constructor sets the environment first (below,
# a real actor whose constructor does the same is run; these start vLLM, DeepSpeed or env workers, far too
# heavy for this check).
ACTOR_CLASSES = {"actors/inference.py": "InferenceEngine", "actors/rollout.py": "Rollout",
                 "learner/actor.py": "LearnerWorker"}


@pytest.mark.parametrize("path, name", sorted(ACTOR_CLASSES.items()))
def test_every_actor_constructor_sets_the_environment_first(path, name):
    import ast
    tree = ast.parse((REPO / path).read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    init = next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    body = [stmt for stmt in init.body
            if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))]     # (the docstring)
    first = body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) and \
        getattr(first.value.func, "id", "") == "apply_project_env", f"{path}: {name}.__init__ starts otherwise"


# The script a clean process runs (no make, no env.sh: only PATH and HOME). Phase 1: a Ray started directly,
# so its processes inherit none of the project's variables, and a real actor (reporting its environment)
# sets them in its constructor as the project's actors do. Phase 2: deploy.run_lifecycle.start_ray under a
# simulated `ray job submit` (the supervisor's RAY_JOB_CONFIG_JSON_ENV_VAR, and the job's variable in the
# environment).
CLEAN_PROCESS = r"""
import json, os, sys
import ray
keys = json.loads(sys.argv[1])
out = {"driver_before": {k: os.environ.get(k) for k in keys}}

ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024**2)
from common.config import ExperimentConfig
from common.processes.process_env import apply_project_env

class ActorShowingItsEnvironment:
    def __init__(self):
        apply_project_env()      # the first line of every actor constructor (the test above checks them)

    def environment(self):
        return {k: os.environ.get(k) for k in keys}

@ray.remote
def plain_task():
    return {k: os.environ.get(k) for k in keys}

actor = ray.remote(ActorShowingItsEnvironment).remote()
out["actor"] = ray.get(actor.environment.remote(), timeout=120)
out["plain_task"] = ray.get(plain_task.remote(), timeout=120)
ray.kill(actor)
ray.shutdown()

job_vars = {"VLLM_CPU_KVCACHE_SPACE": "3"}
os.environ.update(job_vars)
os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"env_vars": job_vars}})
from deploy.run_lifecycle import start_ray
start_ray(ExperimentConfig())
out["job_task"] = ray.get(plain_task.remote(), timeout=120)
ray.shutdown()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_in_a_clean_environment_actors_and_a_job_driver_get_the_variables(tmp_path):
    keys = sorted(CPU_ONLY)
    clean = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path))}     # as `env -i PATH=...`
    proc = subprocess.run([sys.executable, "-c", CLEAN_PROCESS, json.dumps(keys)], cwd=REPO, env=clean,
                          capture_output=True, text=True, timeout=280)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert set(out["driver_before"].values()) == {None}         # really clean
    # The Ray's own processes have none of the library variables (Ray sets its usage-stats one in its workers).
    assert {k: v for k, v in out["plain_task"].items() if k != "RAY_USAGE_STATS_ENABLED"} == dict.fromkeys(
        CPU_ONLY - {"RAY_USAGE_STATS_ENABLED"})
    want = project_env()          # this machine's values (the same node)
    assert out["actor"] == want, out["actor"]
    # The driver under a job: no conflict, the job's value wins, the project's fill in the rest.
    assert out["job_task"] == {**want, "VLLM_CPU_KVCACHE_SPACE": "3"}, out["job_task"]
