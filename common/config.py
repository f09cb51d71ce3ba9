"""Typed experiment configuration: dataclasses, one YAML file per experiment, dotted command-line overrides.

    cfg = load_config("configs/alfworld_gigpo_1.5b.yaml", ["learner.lr=2e-6", "rollout.group_size=4"])

Every field has a default and a one-line doc (`describe()` prints them all). Unknown keys and values of
the wrong type are errors that name the field, so a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def F(default: Any, doc: str) -> Any:
    """A dataclass field with a default and a doc string (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class ModelConfig:
    path: str = F("tiny", 'Hugging Face hub name or local path of the policy; "tiny" builds the local test '
                          "model (random Qwen2, head_dim 64, BPE trained on env text) under run.output_dir")
    max_prompt_tokens: int = F(2048, "longest prompt; a longer one ends the trajectory as truncated")
    max_response_tokens: int = F(512, "longest response per step")
    dtype: str = F("auto", 'weights dtype: "auto" (bf16 on GPU, fp32 on CPU), "bfloat16", "float32"')
    warm_start_steps: int = F(0, "supervised warm start before RL: optimizer steps of fine-tuning on the "
                                 "solutions (walkthroughs) of training games, replayed through the env with "
                                 "the rollout's prompts; 0 disables. Kept short so RL has room to improve")
    warm_start_games: int = F(16, "training games whose walkthroughs the warm start learns from (the first "
                                  "ones of env.train_split; never eval games)")
    warm_start_lr: float = F(1e-3, "AdamW learning rate of the warm start")
    warm_start_batch: int = F(16, "steps (prompt, response) per warm-start optimizer step")


@dataclass
class EnvConfig:
    name: str = F("alfworld", '"alfworld" or "webshop"')
    source: str = F("generated", 'ALFWorld game source: "generated" (small games built locally) or '
                                 '"data" (the standard game set under $ALFWORLD_DATA)')
    train_split: str = F("train", "split the training tasks come from")
    eval_split: str = F("eval", 'split for evaluation ("valid_unseen" is the paper\'s ALFWorld table)')
    max_steps: int = F(50, "steps per episode before it ends as max_steps (paper: ALFWorld 50, WebShop 15)")
    num_generated_games: int = F(64, "games to generate when source is generated")
    generator: dict = F({}, 'options of the small-game generator: {} is the tiny preset (1 room, 3-5 '
                            'receptacles, 1-3 objects, pick_and_place_simple); {"preset": "default"} all six task '
                            'types, 4-8 receptacles, 2-6 objects; or set rooms, receptacles, objects, task_types, '
                            'openable, seed')
    instances_per_server: int = F(16, "env instances hosted by one env-server actor")
    step_timeout_s: float = F(60.0, "an env call slower than this counts as hung: the instance restarts")
    cpus_per_server: float = F(1.0, "CPUs Ray reserves for one env-server actor")
    instances_per_process: int = F(4, "env instances per worker subprocess of an env server (a crashed or "
                                      "hung worker restarts, and all its instances lose their episode)")
    engine: str = F("fast", 'ALFWorld text engine: "fast" (memoized, byte-identical) or "upstream"')


@dataclass
class RolloutConfig:
    num_actors: int = F(1, "rollout actors at start (scale with `gigpo scale` while running)")
    groups_per_actor: int = F(2, "episode groups each rollout actor runs concurrently")
    group_size: int = F(8, "N: trajectories per episode group, all reset to the same task and seed")
    history_length: int = F(2, "K: past (observation, action) pairs shown in each prompt")
    temperature: float = F(1.0, "sampling temperature for training rollouts")
    eval_temperature: float = F(0.4, "sampling temperature for evaluation")
    constrain_actions: bool = F(False, "constrain the action to the admissible list (vLLM structured "
                                       "outputs), for small models that cannot follow the format yet")
    invalid_action_penalty: float = F(0.1, "penalty for an invalid action, on that row only")
    success_reward: float = F(10.0, "reward on the winning step")
    cpus_per_actor: float = F(0.5, "CPUs Ray reserves for one rollout actor")


@dataclass
class InferenceConfig:
    num_actors: int = F(1, "vLLM inference actors")
    gpus_per_actor: float = F(0.0, "GPUs per inference actor (0 on CPU-only machines)")
    cpus_per_actor: float = F(1.0, "CPUs Ray reserves for one inference actor")
    gpu_memory_utilization: float = F(0.9, "vLLM memory share for weights + KV cache (on CPU: host RAM "
                                           "share for KV cache; keep it small)")
    max_num_seqs: int = F(256, "most sequences vLLM batches at once")
    weight_bucket_mb: int = F(512, "size of the buckets weights travel in on update")
    weights_dir: str = F("", 'shared-memory directory of the weight buckets + manifest (CPU sync path); '
                             '"" picks /dev/shm/gigpo-weights-<run>')


@dataclass
class StreamConfig:
    redis_url: str = F("", 'Redis URL (redis:// or rediss://, with password/ACL user); "" starts an '
                           "embedded redis-server on 127.0.0.1 with a generated password")
    stream: str = F("gigpo:groups", "Redis stream key of the episode groups")
    max_stream_groups: int = F(64, "backpressure: producers wait while the stream holds more groups")
    max_policy_lag: int = F(4, "the learner drops groups generated by weights older than this many versions")
    reclaim_idle_s: float = F(60.0, "pending groups of a consumer idle this long are reclaimed by another "
                                    "(must exceed the longest read-to-ack time of a live learner)")
    publish_timeout_s: float = F(600.0, "a producer blocked by backpressure this long raises TimeoutError")
    embedded_dir: str = F("", 'data dir of the embedded redis-server; "" makes a temporary one')
    embedded_aof: bool = F(True, "embedded redis-server keeps an append-only file (survives a restart)")


@dataclass
class LearnerConfig:
    algorithm: str = F("gigpo", '"gigpo", "grpo" or "rloo"')
    groups_per_batch: int = F(16, "B: episode groups per update (paper: 16 tasks)")
    gamma: float = F(0.95, "discount of step returns (Eq. 5)")
    omega: float = F(1.0, "weight of the step advantage (Eq. 8)")
    normalize_std: bool = F(True, "divide advantages by std + eps (mean_std_norm); False: mean_norm")
    episode_stats: str = F("rows", '"rows" (reference default) or "trajectories" (paper Eq. 3)')
    similarity: float = F(0.0, "0: anchors grouped by identical text; in (0, 1): by similarity ratio")
    dynamic_sampling: bool = F(False, "skip groups whose returns are all equal (counted)")
    lr: float = F(1e-6, "AdamW learning rate")
    weight_decay: float = F(0.01, "AdamW weight decay")
    grad_clip: float = F(1.0, "gradient-norm clip")
    clip_ratio: float = F(0.2, "PPO ratio clip")
    dual_clip: float = F(3.0, "dual-clip constant c for negative advantages")
    kl_coef: float = F(0.01, "low_var_kl (k3) loss coefficient to the frozen reference; 0 disables it")
    entropy_coef: float = F(0.001, "entropy bonus")
    ppo_epochs: int = F(1, "passes over each batch")
    micro_batch_tokens: int = F(16384, "token budget of one micro-batch (rows are packed by tokens)")
    mini_batch_rows: int = F(256, "rows per optimizer step (paper: 256 ALFWorld, 64 WebShop)")
    recompute_old_logprobs: bool = F(False, "recompute old log-probs with the learner instead of using "
                                            "the rollout's")
    zero_stage: int = F(2, "DeepSpeed ZeRO stage (1, 2 or 3)")
    offload: bool = F(False, "ZeRO CPU offload of optimizer state (and params at stage 3)")
    num_processes: int = F(1, "learner processes (one per device)")
    gpus_per_process: float = F(0.0, "GPUs per learner process (0 on CPU-only machines)")
    checkpoint_every: int = F(10, "updates between checkpoints")
    keep_checkpoints: int = F(2, "newest checkpoints kept, older ones deleted (each holds the optimizer state "
                                 "too: several times the model's size); 0 keeps all")
    ack_on_checkpoint: bool = F(True, "exactly-once across restarts: ack trained groups only once a "
                                      "checkpoint holds their update (a crash retrains the updates since "
                                      "the last checkpoint); a checkpoint is forced early when the unacked "
                                      "groups would otherwise fill stream.max_stream_groups")


@dataclass
class RunConfig:
    name: str = F("gigpo", "experiment name (also the TensorBoard run name)")
    output_dir: str = F("runs/default", "checkpoints, logs and TensorBoard files go here")
    seed: int = F(0, "seed of every random draw")
    iterations: int = F(150, "learner updates to run")
    eval_every: int = F(5, "updates between evaluations; 0 disables")
    eval_episodes: int = F(0, "episodes per evaluation; 0: the whole eval split")
    sync: bool = F(False, "synchronous mode: rollout then train in lockstep (the reference's schedule)")
    ray_address: str = F("", 'Ray cluster address; "" starts a local Ray (RAY_ADDRESS also works)')
    resume: bool = F(False, "resume from the latest checkpoint in output_dir")
    resume_tag: str = F("", "with resume: the checkpoint to load instead of the latest, a directory name under "
                            "<output_dir>/checkpoints (e.g. update_0000008)")
    rollout_nice: int = F(5, "niceness added to the rollout side (vLLM engines, rollout actors, their env "
                             "workers): where they share CPUs with the learner, the learner, the critical "
                             "path of async training, gets them first; 0: equal priority")
    learner_cpus: str = F("", 'CPUs the learner processes run on, e.g. "0" or "0-7" (Linux; "" = any): with '
                              "rollout_cpus, gives each side its own CPUs on a shared node")
    rollout_cpus: str = F("", 'CPUs the inference and rollout actors (and their engines and env workers) run '
                              'on, e.g. "1" or "8-15" ("" = any)')


@dataclass
class ExperimentConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------

class ConfigError(ValueError):
    pass


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of fields, got {value!r}")
        return _build(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):          # YAML 1.1 reads "2e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):   # YAML reads `run.learner_cpus=0` as 0
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if tp in (list, dict) or origin in (list, dict):
        want = origin or tp
        if isinstance(value, want):
            return value
        raise ConfigError(f"{where}: expected a {want.__name__}, got {value!r}")
    return value


def _build(cls: type, data: dict, where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config field {path!r}{hint}; fields here: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`section.field=value`; the value is read as YAML (numbers, true/false, lists, quoted strings)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml_tree(path: str | Path, _seen: tuple = ()) -> dict:
    """A config file as a dict. `extends: other.yaml` (relative to this file) starts from another file, so a
    recipe variant states only what differs."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: circular 'extends'")
    tree = yaml.safe_load(path.read_text()) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    parent = tree.pop("extends", None)
    if parent:
        tree = _merge(read_yaml_tree(path.parent / parent, _seen + (path,)), tree)
    return tree


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    tree: dict = read_yaml_tree(path) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    return _build(ExperimentConfig, tree)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(tree: dict) -> ExperimentConfig:
    """The inverse of `to_dict` (actors receive their config as a plain dict), with the same checks."""
    return _build(ExperimentConfig, tree)


def describe(cls: type = ExperimentConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted name, default, doc) of every field, for `gigpo config` and the docs."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(describe(hints[f.name], name + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((name, default, f.metadata.get("doc", "")))
    return rows
