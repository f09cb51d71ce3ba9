"""Does a job fit a cluster, with each role on its node kind? Read offline from the files, before `ray up`.

    python -m deploy.tools.cluster_check              # every configs/cluster_*.yaml x every shipped cluster file
    python -m deploy.tools.cluster_check configs/my_job.yaml --cluster deploy/ray-cluster.yaml --set rollout.num_actors=32

What it reads and checks: docs/deploy.md. Exit status 0: every check passed.
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from common.processes.placement import format_need, job_needs  # noqa: E402

GPU_ROLES = ("learner process", "inference actor")      # on GPU node types only
CPU_ROLES = ("rollout actor",)                           # on node types without GPUs only


@dataclass
class NodeType:
    name: str
    resources: dict            # what one node of the type offers Ray: {"CPU": 48, "GPU": 8, "gpu_node": 100}
    max_nodes: int             # the most nodes of the type the cluster may have (the head: 1)
    head: bool = False

    @property
    def has_gpus(self) -> bool:
        return self.resources.get("GPU", 0) > 0

    def offers(self, need: dict) -> bool:
        return all(self.resources.get(k, 0.0) >= v for k, v in need.items())


@dataclass
class Cluster:
    label: str                 # "deploy/ray-cluster.yaml" or "deploy/kuberay/raycluster.yaml: RayCluster gigpo"
    types: list[NodeType]
    problems: list[str]        # what is wrong with the cluster file itself


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def launcher_cluster(config: dict, label: str) -> Cluster:
    """The node types of a Ray cluster launcher config."""
    types, problems = [], []
    head_name = config.get("head_node_type")
    global_max = int(config.get("max_workers", 2))
    for name, spec in config.get("available_node_types", {}).items():
        resources = {k: float(v) for k, v in (spec.get("resources") or {}).items()}
        head = name == head_name
        if "CPU" not in resources:
            problems.append(f"node type {name} declares no CPU: the launcher (AWS) fills in the instance's "
                            f"vCPUs, which override `ray start --num-cpus`; state it in its resources"
                            + (" (CPU: 0 keeps actors off the head)" if head else ""))
        max_nodes = 1 if head else min(int(spec.get("max_workers", global_max)), global_max)
        types.append(NodeType(name, resources, max_nodes, head))
    return Cluster(label, types, problems)


def kuberay_cluster(ray_cluster_spec: dict, name: str, label: str) -> Cluster:
    """The node types of a KubeRay RayCluster spec, as Ray's autoscaler reads them."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
    cr = {"metadata": {"name": name, "namespace": "default"}, "spec": copy.deepcopy(ray_cluster_spec)}
    try:
        derived = _derive_autoscaling_config_from_ray_cr(cr)
    except Exception as exc:            # a rayStartParams.resources Ray cannot read, a bad quantity, ...
        return Cluster(label, [], [f"Ray's autoscaler cannot read the cluster's groups: {exc!r}"])
    types = []
    for type_name, spec in derived["available_node_types"].items():
        head = type_name == derived["head_node_type"]
        resources = {k: float(v) for k, v in spec["resources"].items()}
        types.append(NodeType(type_name, resources, 1 if head else int(spec["max_workers"]), head))
    return Cluster(label, types, [])


def read_clusters(path: Path) -> list[Cluster]:
    """Every cluster a file defines (none for a file that defines none)."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if isinstance(d, dict)]
    clusters = []
    for doc in docs:
        if "available_node_types" in doc:
            clusters.append(launcher_cluster(doc, _rel(path)))
        elif doc.get("apiVersion", "").startswith("ray.io/"):
            spec = doc.get("spec") or {}
            if doc.get("kind") == "RayJob":
                spec = spec.get("rayClusterSpec")
            if spec and "headGroupSpec" in spec:
                name = doc.get("metadata", {}).get("name", "?")
                clusters.append(kuberay_cluster(spec, name, f"{_rel(path)}: {doc['kind']} {name}"))
    return clusters


def shipped_cluster_files() -> list[Path]:
    """The cluster files under deploy/: launcher configs and Kubernetes files that define a Ray cluster."""
    candidates = sorted((ROOT / "deploy").glob("*.yaml")) + sorted((ROOT / "deploy" / "kuberay").glob("*.yaml"))
    return [p for p in candidates if read_clusters(p)]


def cluster_configs() -> list[Path]:
    """The shipped configs meant for a cluster: configs/cluster_*.yaml."""
    return sorted((ROOT / "configs").glob("cluster_*.yaml"))


def _pack(cluster: Cluster, needs: dict[str, tuple[dict, int]]) -> tuple[dict[str, int], int]:
    """First-fit of the job's actors onto the cluster at its largest: ({role: placed}, more rollout actors that fit)."""
    nodes = [(t, dict(t.resources)) for t in cluster.types for _ in range(t.max_nodes)]

    def place(need: dict) -> bool:
        for node_type, free in nodes:
            if node_type.offers(need) and all(free.get(k, 0.0) >= v - 1e-9 for k, v in need.items()):
                for k, v in need.items():
                    free[k] -= v
                return True
        return False

    placed = {role: sum(place(need) for _ in range(count)) for role, (need, count) in needs.items()}
    room = 0
    rollout_need = needs["rollout actor"][0]
    if rollout_need:                     # an actor that needs nothing would fit without end
        while room < 100_000 and place(rollout_need):
            room += 1
    return placed, room


def check(needs: dict[str, tuple[dict, int]], cluster: Cluster) -> tuple[list[str], list[str]]:
    """(problems, report lines) of one job's needs (common.processes.placement.job_needs) on one cluster."""
    problems = list(cluster.problems)
    lines = []
    if not cluster.types:
        return problems or ["the cluster declares no node types"], lines
    declared = "; ".join(f"{t.name}: {format_need(t.resources)}" for t in cluster.types)
    for role, (need, count) in needs.items():
        if count == 0:
            continue
        fits = [t for t in cluster.types if t.offers(need)]
        names = ", ".join(t.name for t in fits) or "NO node type"
        lines.append(f"  {role} x{count}: needs {format_need(need)}; fits {names}")
        if not fits:
            problems.append(f"a {role} needs {format_need(need)} on one node: no node type offers it ({declared})")
        for t in fits:
            if t.head:
                problems.append(f"a {role} ({format_need(need)}) fits the head node type {t.name}: the head "
                                f"runs the driver, GCS and Redis; give it CPU 0 and no custom resource")
            elif role in GPU_ROLES and not t.has_gpus:
                problems.append(f"a {role} ({format_need(need)}) may land on {t.name}, a node type without GPUs: "
                                f"pin it to the GPU node kind with its config's resources field")
            elif role in CPU_ROLES and t.has_gpus:
                problems.append(f"a {role} ({format_need(need)}) may land on {t.name}, a GPU node type: pin it "
                                f"to the CPU rollout node kind with rollout.resources")
    placed, room = _pack(cluster, needs)
    largest = ", ".join(f"{t.name} x{t.max_nodes}" for t in cluster.types)
    for role, (need, count) in needs.items():
        if placed[role] < count:
            problems.append(f"only {placed[role]} of the {count} {role}s fit on the cluster at its largest "
                            f"({largest})")
    if needs["rollout actor"][0]:
        lines.append(f"  at its largest ({largest}): room for {room} more rollout actors "
                     f"({needs['rollout actor'][1] + room} in all)")
    return problems, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", help="job config(s); default: configs/cluster_*.yaml")
    parser.add_argument("--cluster", action="append", default=[],
                        help="cluster file (repeatable); default: every shipped one under deploy/")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every config (repeatable), e.g. rollout.num_actors=16")
    args = parser.parse_args(argv)
    from common.config import load_config

    configs = [Path(c) for c in args.configs] or cluster_configs()
    files = [Path(f) for f in args.cluster] or shipped_cluster_files()
    failed = 0
    for path in files:
        clusters = read_clusters(path)
        if not clusters:
            print(f"{path}: defines no Ray cluster")
            failed += 1
        for cluster in clusters:
            for config in configs:
                problems, lines = check(job_needs(load_config(config, args.set)), cluster)
                print(f"{_rel(config)} on {cluster.label}: {'FAILS' if problems else 'fits'}")
                for line in lines:
                    print(line)
                for problem in problems:
                    print(f"  problem: {problem}")
                failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
