"""`gigpo`: the command-line tool.

    gigpo train configs/embedded.yaml learner.lr=2e-6 rollout.num_actors=4
    gigpo eval  configs/embedded.yaml run.output_dir=runs/embedded
    gigpo status --output-dir runs/embedded [--watch]
    gigpo scale  --output-dir runs/embedded --rollout 6
    gigpo config [configs/embedded.yaml] [overrides...]     # every field, its value and its doc

Ray is local unless `--address` (or RAY_ADDRESS, or run.ray_address) names a cluster.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from common.config import ConfigError, describe, load_config, to_dict


def _load(args) -> "object":
    overrides = list(args.overrides)
    if getattr(args, "address", None):
        overrides.append(f"run.ray_address={args.address}")
    try:
        return load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        sys.exit(f"gigpo: config error: {exc}")


def cmd_train(args) -> int:
    from deploy.system import train
    cfg = _load(args)
    summary = train(cfg)
    return 0 if summary.get("ok", True) else 1


def cmd_eval(args) -> int:
    from deploy.system import evaluate_only
    cfg = _load(args)
    try:
        evaluate_only(cfg, checkpoint=args.checkpoint)
    except FileNotFoundError as exc:
        sys.exit(f"gigpo: {exc}")
    return 0


def _channel(output_dir: str):
    from common.redis_server import connect
    from deploy.control import ControlChannel, read_job_file
    job = read_job_file(output_dir)
    return ControlChannel(connect(job["redis_url"]), job["run"])


def cmd_status(args) -> int:
    from deploy.control import format_status
    try:
        channel = _channel(args.output_dir)
    except FileNotFoundError as exc:
        sys.exit(f"gigpo: {exc}")
    while True:
        text = format_status(channel.read_status())
        if not args.watch:
            print(text)
            return 0
        sys.stdout.write("\x1b[2J\x1b[H" + text + "\n")
        sys.stdout.flush()
        time.sleep(args.interval)


def cmd_scale(args) -> int:
    if args.rollout < 0:
        sys.exit("gigpo: --rollout must be >= 0")
    try:
        channel = _channel(args.output_dir)
    except FileNotFoundError as exc:
        sys.exit(f"gigpo: {exc}")
    channel.send_command({"op": "scale_rollout", "num_actors": args.rollout, "drain": not args.discard})
    print(f"asked run {channel.run_name!r} to run {args.rollout} rollout actors "
          f"({'discarding' if args.discard else 'finishing'} the in-flight groups of removed actors); "
          "`gigpo status` shows when it is done")
    return 0


def cmd_config(args) -> int:
    import yaml
    if args.config or args.overrides:
        print(yaml.safe_dump(to_dict(_load(args)), sort_keys=False))
        return 0
    for name, default, doc in describe():
        print(f"{name} = {default!r}\n    {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gigpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p, required=True):
        p.add_argument("config", nargs=None if required else "?", help="experiment YAML file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=2e-6")
        p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", ""),
                       help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")

    p = sub.add_parser("train", help="train: rollout actors, inference actors and the learner")
    with_config(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("eval", help="evaluate a checkpoint (success per task type, WebShop score)")
    with_config(p)
    p.add_argument("--checkpoint", default="",
                   help="a checkpoint directory, <run.output_dir>/checkpoints/update_* (default: the latest in "
                        "run.output_dir)")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("status", help="what a running job is doing: versions, lags, throughput")
    p.add_argument("--output-dir", default="runs/embedded", help="the job's run.output_dir")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=2.0)
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("scale", help="add or remove rollout actors of a running job")
    p.add_argument("--output-dir", default="runs/embedded", help="the job's run.output_dir")
    p.add_argument("--rollout", type=int, required=True, help="number of rollout actors wanted")
    p.add_argument("--discard", action="store_true",
                   help="discard in-flight groups of removed actors instead of finishing them")
    p.set_defaults(fn=cmd_scale)
    p = sub.add_parser("config", help="print every config field with its doc, or a resolved config")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*")
    p.set_defaults(fn=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
