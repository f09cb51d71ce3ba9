"""README: common/config.py is "the only place a default is written". A function parameter named after a config
field has no default, None ("not given"), or the field's own (`engine: str = EnvConfig.engine`); a literal
would go on saying 512 after the config says 256."""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from common import config

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = ("common", "actors", "learner", "env_servers", "deploy")
CONFIG_FILE = REPO / "common" / "config.py"

# Parameters that share a config field's name but not its meaning: (function, parameter) -> why their literal
# default restates nothing. "*": in any function.
ALLOWED = {
    ("*", "seed"): "the seed of one thing (an env instance, an episode, a generated game or catalog, the tiny "
                   "model): callers derive it from run.seed, which seeds the run's draws through them",
    ("write_job_file", "run_id"): '"" is "not recorded" (job.json then names the run by run.name), not '
                                  "stream.run_id's \"generate one at the first start\"",
    ("write_job_file", "stream"): '"" is "not recorded" in job.json, not stream.stream\'s "name it after the run"',
}


def config_fields() -> set[str]:
    """The names of every field of every config dataclass in common/config.py."""
    return {f.name for obj in vars(config).values()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == config.__name__
            for f in dataclasses.fields(obj)}


def _is_literal(node: ast.expr) -> bool:
    """A number, string or bool written out (-1.0 included); None is "not given" and allowed."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and node.value is not None


def literal_defaults(tree: ast.AST) -> Iterator[tuple[str, str, int, str]]:
    """(function, parameter, line, default as written) of every parameter of `tree` with a literal default."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            with_defaults = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                             *zip(args.kwonlyargs, args.kw_defaults)]
            for arg, default in with_defaults:
                if default is not None and _is_literal(default):
                    yield getattr(node, "name", "<lambda>"), arg.arg, default.lineno, ast.unparse(default)


def production_files() -> list[Path]:
    return [path for folder in PRODUCTION for path in sorted((REPO / folder).rglob("*.py")) if path != CONFIG_FILE]


def restated_defaults() -> list[tuple[str, str, str]]:
    """(where, function, parameter) of every literal default of a parameter named after a config field."""
    fields = config_fields()
    found = []
    for path in production_files():
        for function, name, line, default in literal_defaults(ast.parse(path.read_text(), str(path))):
            if name in fields:
                found.append((f"{path.relative_to(REPO)}:{line} {function}({name}={default})", function, name))
    return found


def test_no_production_parameter_restates_a_config_default():
    offenders = [where for where, function, name in restated_defaults()
                 if (function, name) not in ALLOWED and ("*", name) not in ALLOWED]
    assert not offenders, (
        "literal defaults of parameters named after config fields (common/config.py is the only place a "
        "default is written): make the parameter required, or default it to the field, e.g. "
        "`engine: str = EnvConfig.engine`; if the name only collides, add it to ALLOWED with the reason:\n  "
        + "\n  ".join(offenders))


def test_every_allowed_entry_is_a_config_field_still_in_use():
    fields = config_fields()
    in_use = {(function, name) for _, function, name in restated_defaults()}
    for function, name in ALLOWED:
        assert name in fields, f"ALLOWED names {name!r}, which no config dataclass declares"
        assert any(name == used and function in ("*", used_in) for used_in, used in in_use), \
            f"ALLOWED entry ({function!r}, {name!r}) matches no parameter any more: remove it"


def test_the_check_sees_literal_defaults_only():
    source = ("def f(engine='fast', gamma=-0.5, normalize_std=True, weights_dir=None,\n"
              "      history_length=RolloutConfig.history_length, *, omega=1.0): pass\n"
              "g = lambda group_size=8: group_size\n")
    found = {(function, name) for function, name, _, _ in literal_defaults(ast.parse(source))}
    assert found == {("f", "engine"), ("f", "gamma"), ("f", "normalize_std"), ("f", "omega"),
                     ("<lambda>", "group_size")}
    assert {"engine", "gamma", "normalize_std", "omega", "group_size", "history_length"} <= config_fields()
