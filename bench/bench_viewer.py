"""What groups.jsonl (learner/group_record.py, the record `gigpo view` shows) costs the learner per update,
against build_batch on the same groups in the same run: `GroupRecorder.record` (rank 0, after the training
step: the recorded groups' advantages again and the per-row log-prob gap, appended as one line), for
run.record_groups's default and for every group. Batch: 8 groups x 8 trajectories x 10 steps, 600 + 120
tokens a row, ALFWorld-shaped observations (~400 characters, a dozen states per task) or WebShop-shaped pages
(~6,000 characters, cut by the record). Median process CPU time over rounds (wall-clock would count the other
work of a busy machine), the ratio to build_batch, and the size of one line.
"""
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from common.config import ExperimentConfig  # noqa: E402
from common.stream.records import EpisodeGroup, StepRow, Trajectory  # noqa: E402
from learner.batching import build_batch  # noqa: E402
from learner.group_record import GroupRecorder  # noqa: E402

GROUPS, TRAJECTORIES, STEPS = 8, 8, 10
PROMPT_TOKENS, RESPONSE_TOKENS = 600, 120
ROUNDS = int(os.environ.get("BENCH_VIEWER_ROUNDS", "15"))


def observation(env: str, task: int, state: int) -> str:
    if env == "webshop":
        items = " [SEP] ".join(f"B0{task}{state}{i:03d} [SEP] Product {i} of a search for item {task}, size M, "
                               f"color blue, 100% cotton, machine wash [SEP] ${10 + i}.99" for i in range(50))
        return f"Instruction: [SEP] find item {task} [SEP] Back to Search [SEP] Page {state} (50 results) {items}"
    return (f"-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
            f"see a cabinet 1, a countertop 1, a drawer 1, a fridge 1, a microwave 1, a shelf 1, a sinkbasin 1 "
            f"and a stoveburner 1.\n\nYour task is to: put some apple {task} in fridge 1. You arrive at state "
            f"{state}. On it, you see a mug 1, a plate 3 and a knife 2.")


def groups_of(env: str, seed: int = 0) -> list[EpisodeGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(GROUPS):
        played = []
        for k in range(TRAJECTORIES):
            won = bool(rng.random() < 0.4)
            steps = [StepRow(prompt_ids=rng.integers(1, 32_000, PROMPT_TOKENS),
                             response_ids=rng.integers(1, 32_000, RESPONSE_TOKENS),
                             response_logprobs=(-3 * rng.random(RESPONSE_TOKENS)).astype(np.float32),
                             reward=10.0 if won and t == STEPS - 1 else 0.0,
                             anchor=observation(env, g, int(rng.integers(12)) if t else 0),
                             valid=bool(rng.random() < 0.9), step=t, policy_version=seed, action=f"go to shelf {t}")
                     for t in range(STEPS)]
            played.append((Trajectory(traj_id=f"g{g}/{k}", success=won, episode_return=10.0 * won,
                                      task_type="pick_and_place_simple", score=float(won)), steps))
        out.append(EpisodeGroup.pack(f"g{seed}-{g}", f"task{g}", env, played))
    return out


def median_cpu_s(fn) -> float:
    times = []
    for _ in range(ROUNDS):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return float(np.median(times))


def main() -> None:
    print(f"batch: {GROUPS} groups x {TRAJECTORIES} trajectories x {STEPS} steps, {PROMPT_TOKENS}+{RESPONSE_TOKENS} "
          f"tokens a row; median of {ROUNDS} rounds")
    with tempfile.TemporaryDirectory(prefix="bench-viewer-") as out_dir:
        cfg = ExperimentConfig()
        cfg.run.output_dir = out_dir
        default_keep = cfg.run.record_groups
        for env in ("alfworld", "webshop"):
            groups = groups_of(env)
            batch_s = median_cpu_s(lambda: build_batch(groups, cfg.learner,
                                                   invalid_action_penalty=cfg.rollout.invalid_action_penalty))
            batch = build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty)
            for keep in (default_keep, GROUPS):
                cfg.run.record_groups = keep
                recorder = GroupRecorder(cfg, resume=False)
                # With a recompute's log-probs (here the sampler's own: the cost is the same).
                record_s = median_cpu_s(lambda: recorder.record(groups, batch, 1,
                                                                learner_logprobs=batch.old_logprobs))
                size = os.path.getsize(recorder.path) / ROUNDS
                print(f"{env:8s} record of {keep} groups: {1e3 * record_s:6.2f} ms, build_batch "
                      f"{1e3 * batch_s:6.2f} ms, ratio {record_s / batch_s:.3f}; one line {size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
