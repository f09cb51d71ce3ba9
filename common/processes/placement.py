"""Where actors run: what they need from a node, whether any node of the cluster has it, and which node
each actor landed on.

    need = actor_need(num_cpus=1, resources={"rollout_node": 1})
    wait_placeable({"rollout": need}, timeout_s=600)     # PlacementError when no node ever offers it
    node = this_node()           # inside an actor: {"ip": ..., "node_id": ..., "hostname": ...}

Ray keeps an actor whose need (`.options(num_cpus=..., num_gpus=..., resources=...)`) no node has pending
forever, without a word: checking the nodes turns that into one line naming the role, its need and what the
nodes offer. (Ray is imported where it is used: the CLI names PlacementError without starting Ray.)
"""
from __future__ import annotations

import socket
import sys
import time

PLACEMENT_TIMEOUT_S = 600.0    # how long a role may wait for a node that offers its need (an autoscaler's start)
POLL_S = 1.0


class PlacementError(RuntimeError):
    """An actor cannot be placed on any node of the cluster (or did not start there in time)."""


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `address` just now (bound, then released: callers that race for it
    retry or fail clearly)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def this_node() -> dict:
    """The node this process runs on, as `ray status` and `gigpo status` name it."""
    import ray
    return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname()}


def node_for_messages() -> str:
    """'<Ray node IP> (<hostname>)' of this process, or the hostname outside Ray."""
    host = socket.gethostname()
    ray = sys.modules.get("ray")      # never import Ray just to name the node
    try:
        if ray is not None and ray.is_initialized():
            return f"{ray.util.get_node_ip_address()} ({host})"
    except Exception:  # noqa: BLE001 - a name for a message: the hostname will do
        pass
    return host


def node_label(node: dict | None) -> str:
    """"10.0.0.2 (host)" for a node dict; "not started" for None (not placed yet, or still starting)."""
    if not node:
        return "not started"
    return f"{node.get('ip', '?')} ({node.get('hostname', '?')})"


def actor_need(num_cpus: float = 0.0, num_gpus: float = 0.0, resources: dict | None = None) -> dict:
    """What one actor asks of a node, in Ray's resource names."""
    need = {"CPU": float(num_cpus), "GPU": float(num_gpus)}
    need.update({str(k): float(v) for k, v in (resources or {}).items()})
    return {k: v for k, v in need.items() if v > 0}


# What each learner process reserves next to its GPUs (what Ray schedules by; its torch threads follow the
# CPUs it may use: common.processes.cpu_placement.compute_threads).
LEARNER_CPUS_PER_PROCESS = 1.0


def job_needs(cfg) -> dict[str, tuple[dict, int]]:
    """{role: (what one of its actors asks of a node, how many it starts)} for an ExperimentConfig: the
    learner processes, the inference actors and the rollout actors (at start; `gigpo scale` changes their
    number). The evaluation actor reserves nothing (it rides on a rollout actor's node)."""
    ro, inf, ln = cfg.rollout, cfg.inference, cfg.learner
    return {
        "learner process": (actor_need(LEARNER_CPUS_PER_PROCESS, ln.gpus_per_process, ln.resources),
                            ln.num_processes),
        "inference actor": (actor_need(inf.cpus_per_actor, inf.gpus_per_actor, inf.resources), inf.num_actors),
        "rollout actor": (actor_need(ro.cpus_per_actor, 0, ro.resources), ro.num_actors),
    }


def format_need(need: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(need.items())) or "nothing"


def alive_nodes() -> list[dict]:
    """The cluster's alive nodes: {"node_id", "ip", "resources": totals}, sorted by IP address."""
    import ray
    nodes = [{"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress", "?"), "resources": n.get("Resources", {})}
             for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (n["ip"], n["node_id"]))


def nodes_offering(need: dict, nodes: list[dict] | None = None) -> list[dict]:
    """The alive nodes whose total resources cover `need` (busy or not)."""
    nodes = alive_nodes() if nodes is None else nodes
    return [n for n in nodes if all(n["resources"].get(k, 0.0) >= v for k, v in need.items())]


def describe_nodes(nodes: list[dict]) -> str:
    """Every node with what it offers, for error messages: "10.0.0.2: CPU 4, GPU 1; 10.0.0.3: CPU 2"."""
    def offer(resources: dict) -> str:
        # Ray's own bookkeeping resources (memory, node:<ip>, accelerator types) are not what a user sets.
        shown = {k: v for k, v in resources.items()
                 if not k.startswith(("node:", "accelerator_type:")) and k not in ("memory", "object_store_memory")}
        return format_need(shown)
    return "; ".join(f"{n['ip']}: {offer(n['resources'])}" for n in nodes) or "no alive node"


def wait_placeable(needs: dict[str, dict], timeout_s: float = PLACEMENT_TIMEOUT_S, log=None) -> None:
    """Return once, for every role in `needs` ({role: need}), some alive node offers the need; raise
    PlacementError naming the roles, their needs and the nodes after `timeout_s`. A role no node offers now
    is logged at once (log: a logging.Logger), since waiting only helps where nodes are still joining."""
    deadline = time.monotonic() + timeout_s
    warned: set[str] = set()
    while True:
        nodes = alive_nodes()
        missing = {role: need for role, need in needs.items() if not nodes_offering(need, nodes)}
        if not missing:
            return
        what = "; ".join(f"{role} needs {format_need(need)} on one node" for role, need in missing.items())
        if time.monotonic() >= deadline:
            raise PlacementError(
                f"no node of the Ray cluster can take it: {what} (nodes: {describe_nodes(nodes)}); start a node "
                f"that has it (`ray start --resources='{{\"name\": 1}}'` for custom resources) or change the "
                f"role's *.resources / cpus / gpus settings")
        if log is not None and set(missing) - warned:
            log.warning("no node offers it yet: %s (nodes: %s); waiting up to %.0f s for one to join",
                        what, describe_nodes(nodes), deadline - time.monotonic())
            warned |= set(missing)
        time.sleep(POLL_S)


def pinned_node(need: dict) -> str:
    """A node for an actor that must land on the same node from run to run: the driver's own node when it
    offers `need`, else the first (by IP address) that does. Raises PlacementError when none does."""
    nodes = nodes_offering(need)
    if not nodes:
        raise PlacementError(f"no node of the Ray cluster offers {format_need(need)} "
                             f"(nodes: {describe_nodes(alive_nodes())})")
    import ray
    here = ray.get_runtime_context().get_node_id()
    return next((n["node_id"] for n in nodes if n["node_id"] == here), nodes[0]["node_id"])
