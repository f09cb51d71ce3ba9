"""A run's output directory (run.output_dir): the one place its layout is named. Standard library only, so
that the CLI, the viewer and the reports read it without torch.

    <output_dir>/             (node: who writes it)
      run_id                  driver: the run's id (stream.run_id), made by a new run, read by a resume
      job.json                driver: how `gigpo status` / `gigpo scale` find the job (deploy/control_channel.py)
      redis/                  driver: the embedded Redis's append-only file while the run lasts (none with
                              stream.redis_url or stream.embedded_dir); a finished run removes it
      logs/                   absolute path made on the driver; each actor writes its <component>.log there on
                              its own node (common/processes/log_files.py); logs/ray links the driver node's Ray logs
      metrics.jsonl           driver: one line per update (deploy/tracking.py), and TensorBoard's tensorboard/
      evals.jsonl             driver: one line per evaluation of a training run (deploy/reports.py)
      groups.jsonl            driver: learner rank 0 builds each update's line, the driver writes it
      tiny_model/             driver: model.path=tiny built here (deploy/models.py)
      warm_model/             driver: the warm-started model (deploy/warm_start.py)
      checkpoints/            learner ranks, each on its own node, under run.output_dir as it sees it:
        update_0000008/         DeepSpeed's files of every rank, then learner_state.json (rank 0, last: the
                                mark of a complete checkpoint)
        latest                  DeepSpeed's: the newest complete tag
        pushed_version          rank 0: the highest policy version ever pushed (learner/loop.py)
      eval/                   `gigpo eval` (driver): update_<N>.json, and its logs/
      view.html               `gigpo view`'s page, by default

Everything but checkpoints/ is on the driver's node. A resume runs its learner wherever Ray places it and
reads checkpoints/ there: when that is not the node that wrote them, run.output_dir must be on a filesystem
both nodes mount (`deploy.run_lifecycle.lost_run_message` says so after a lost learner).
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from pathlib import Path

RUN_ID_FILE = "run_id"
JOB_FILE = "job.json"
REDIS_DIR = "redis"
LOGS_DIR = "logs"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
EVALS_FILE = "evals.jsonl"
GROUPS_FILE = "groups.jsonl"
TINY_DIR = "tiny_model"
WARM_DIR = "warm_model"
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"                      # DeepSpeed's name; the learner writes the tag there, last (resume_point)
PUSHED_VERSION = "pushed_version"
LEARNER_STATE = "learner_state.json"   # JSON of a checkpoint's client state, for humans and tools
EVAL_DIR = "eval"
VIEW_FILE = "view.html"
NAMES = (RUN_ID_FILE, JOB_FILE, REDIS_DIR, LOGS_DIR, METRICS_FILE, TENSORBOARD_DIR, EVALS_FILE, GROUPS_FILE,
         TINY_DIR, WARM_DIR, CHECKPOINTS_DIR, LATEST, PUSHED_VERSION, LEARNER_STATE, EVAL_DIR, VIEW_FILE)

_TAG_PREFIX = "update_"


def checkpoints_dir(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def logs_dir(output_dir: str | os.PathLike) -> str:
    """The run's log directory, absolute: actors may run in another working directory."""
    return str(Path(output_dir).resolve() / LOGS_DIR)


def eval_dir(output_dir: str | os.PathLike) -> Path:
    """Where `gigpo eval` writes (absolute, as the logs)."""
    return Path(output_dir).resolve() / EVAL_DIR


def eval_result_file(output_dir: str | os.PathLike, update: int) -> Path:
    """`gigpo eval`'s result for the weights of `update`."""
    return eval_dir(output_dir) / f"{checkpoint_tag(update)}.json"


# -- checkpoints -----------------------------------------------------------------------------------------

def checkpoint_tag(update: int) -> str:
    """The checkpoint directory name of `update` (12 -> update_0000012)."""
    return f"{_TAG_PREFIX}{update:07d}"


def tag_update(name: str) -> int | None:
    """The update number of a checkpoint directory name (update_0000012 -> 12); None for other names."""
    digits = name[len(_TAG_PREFIX):]
    return int(digits) if name.startswith(_TAG_PREFIX) and digits.isdigit() else None


def checkpoint_tags(root: str | os.PathLike) -> list[Path]:
    """The checkpoint directories under `root`, oldest update first (by number: update_10000000 sorts before
    update_9999999 as a string)."""
    tags = [p for p in Path(root).glob(_TAG_PREFIX + "*") if p.is_dir() and tag_update(p.name) is not None]
    return sorted(tags, key=lambda p: tag_update(p.name))


def is_complete_checkpoint(tag_dir: str | os.PathLike) -> bool:
    """Whether `tag_dir` (<checkpoints>/update_*) is a whole checkpoint: its LEARNER_STATE is written last,
    after DeepSpeed's files."""
    return (Path(tag_dir) / LEARNER_STATE).is_file()


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under `root`, oldest first ([] when there is no such directory)."""
    return [p for p in checkpoint_tags(root) if is_complete_checkpoint(p)]


class UntrustedCheckpoint(PermissionError):
    """A checkpoint someone other than this user wrote, or could have rewritten: loading it would unpickle
    what they put there (DeepSpeed's files are pickles)."""


def check_checkpoint_is_ours(tag_dir: str | os.PathLike) -> None:
    """Raise UntrustedCheckpoint unless every file and directory of the checkpoint `tag_dir` belongs to this
    process's user and no one else can write it (the rule ssh applies to its keys): a run unpickles only what it,
    or its user, wrote."""
    root = Path(tag_dir)
    uid = os.getuid()
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            raise UntrustedCheckpoint(f"{path} is a symbolic link: a checkpoint is loaded only from its own files "
                                      "(they are pickles)")
        if info.st_uid != uid:
            raise UntrustedCheckpoint(f"{path} belongs to user id {info.st_uid}, not to this user ({uid}): a "
                                      "checkpoint is loaded only when its own user wrote it (its files are pickles)")
        if info.st_mode & 0o022:
            raise UntrustedCheckpoint(f"{path} can be written by others (mode {stat.S_IMODE(info.st_mode):o}): "
                                      f"a checkpoint is loaded only when no one else could have changed it (its "
                                      f"files are pickles); chmod -R go-w {root} if its contents are yours")


def seal_checkpoint(tag_dir: str | os.PathLike) -> None:
    """Make what check_checkpoint_is_ours asks true of the files of `tag_dir` this user owns: no write bit for
    the group or others (a umask of 002, many distributions' default, leaves new files group-writable)."""
    root = Path(tag_dir)
    uid = os.getuid()
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        if info.st_uid == uid and info.st_mode & 0o022 and not stat.S_ISLNK(info.st_mode):
            os.chmod(path, stat.S_IMODE(info.st_mode) & ~0o022)


class DamagedLatest(FileNotFoundError):
    """`latest` names no checkpoint a resume can follow (empty, unreadable, not a checkpoint's name, or the name
    of one that is not there)."""


def resume_point(root: str | os.PathLike) -> tuple[Path | None, str]:
    """The checkpoint a resumed run loads from the checkpoint directory `root` (None: none, start at update 0),
    and a note when it is not the one `latest` names ("" otherwise). One answer for the learner and for what a
    lost run tells the user.

    `latest` names the newest checkpoint of the run's history: the learner writes it, durably, after the
    checkpoint is complete (its LEARNER_STATE written), so normally it names a complete one. A checkpoint saved
    before that order, cut short by a crash, leaves `latest` naming an incomplete one: then the newest complete
    checkpoint numbered below it (those above it belong to a history the run branched off, run.resume_tag).
    Without `latest` (a crash before the first was written): the newest complete checkpoint. A `latest` that
    names no checkpoint, or one that is not there (deleted), raises DamagedLatest: which history to follow is
    then the user's choice."""
    root = Path(root)
    complete = complete_checkpoints(root)
    try:
        named = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return (complete[-1] if complete else None), ""
    except (OSError, UnicodeDecodeError) as exc:
        named, problem = None, f"cannot be read ({exc}), naming no checkpoint"
    else:
        problem = ("is empty, naming no checkpoint" if not named
                   else f"holds {named[:40]!r}, naming no checkpoint" if tag_update(named) is None
                   else f"names {named}, which is not there" if not (root / named).is_dir() else "")
    if problem:
        have = ", ".join(p.name for p in complete) or "none"
        fix = f"run.resume_tag={complete[-1].name}" if complete else "run.overwrite=true to start afresh"
        raise DamagedLatest(f"{root / LATEST} {problem} (complete ones: {have}): resume with {fix}")
    if is_complete_checkpoint(root / named):
        return root / named, ""
    older = [p for p in complete if tag_update(p.name) < tag_update(named)]
    fallback = older[-1] if older else None
    return fallback, (f"{root / LATEST} names {named}, which is not complete (a save cut short): resuming from "
                      + (fallback.name if fallback else "update 0 (no complete checkpoint before it)"))


def resume_overwrite_conflict(resume: bool, overwrite: bool) -> str:
    """What is wrong with run.resume and run.overwrite together ("" when nothing): the config's check, and the
    learner's for a config built without it."""
    if resume and overwrite:
        return ("run.resume=true continues the run in run.output_dir, run.overwrite=true deletes its "
                "checkpoints: set one of them")
    return ""


def other_runs_checkpoints(checkpoint_dir: str | os.PathLike) -> str:
    """What a fresh run says of a checkpoint directory that holds another run's checkpoints ("" for none)."""
    root = Path(checkpoint_dir)
    tags = checkpoint_tags(root) if root.is_dir() else []
    if not tags and not (root / LATEST).exists():
        return ""
    newest = f" (newest: {tags[-1].name})" if tags else ""
    return (f"{root} holds another run's checkpoints{newest}: continue that run with run.resume=true, delete "
            "them with run.overwrite=true, or set another run.output_dir")


def prepare_checkpoint_dir(checkpoint_dir: str | os.PathLike, *, resume: bool, overwrite: bool,
                           rank: int = 0) -> None:
    """Before a learner starts: refuse (ValueError) to start a fresh run in a directory holding another run's
    checkpoints, which it would mix with its own (pruning, `latest`, resume); with `overwrite`, delete them
    (rank 0). Resuming uses what is there."""
    conflict = resume_overwrite_conflict(resume, overwrite)
    if conflict:
        raise ValueError(conflict)
    root = Path(checkpoint_dir)
    if resume:
        return
    problem = other_runs_checkpoints(root)
    if not problem:
        return
    if not overwrite:
        raise ValueError(problem)
    if rank == 0:
        for path in checkpoint_tags(root):
            shutil.rmtree(path)
        for name in (LATEST, PUSHED_VERSION):
            (root / name).unlink(missing_ok=True)
            for left in root.glob(f".{name}.*.tmp"):      # a write_atomically cut short
                left.unlink(missing_ok=True)


# -- the run's id ----------------------------------------------------------------------------------------

def resolve_run_id(output_dir: str | os.PathLike, run_name: str, resume: bool) -> str:
    """The run's id: resuming, the one in <output_dir>/run_id; else (or when there is none) a new one, the
    run name and 8 random hex digits, written there."""
    path = Path(output_dir) / RUN_ID_FILE
    known = path.read_text().strip() if resume and path.is_file() else ""
    if not known:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_name).strip("-") or "run"
        known = f"{slug}-{uuid.uuid4().hex[:8]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(known + "\n")
    return known


def prepare_output_dir(cfg) -> str:
    """Before anything of a training run starts: `prepare_checkpoint_dir` for its checkpoints, then its id, set
    in the config (stream.run_id): the configured one, else `resolve_run_id`'s. Stream, consumer-group and
    control keys and every record carry it, so runs that share a Redis never mix. Returns the id."""
    prepare_checkpoint_dir(checkpoints_dir(cfg.run.output_dir), resume=cfg.run.resume, overwrite=cfg.run.overwrite)
    if not cfg.stream.run_id:
        cfg.stream.run_id = resolve_run_id(cfg.run.output_dir, cfg.run.name, cfg.run.resume)
    return cfg.stream.run_id
