"""Experiment configuration: YAML files, dotted overrides, clear errors, and every shipped config loads."""
import re
from pathlib import Path

import pytest

from common.config import ConfigError, ExperimentConfig, describe, load_config, with_fields

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(REPO.joinpath("configs").glob("*.yaml"))


def test_defaults_and_overrides():
    cfg = load_config(None, ["learner.lr=2e-6", "rollout.group_size=4", "learner.normalize_std=false",
                             "run.name=x"])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.learner.lr == 2e-6 and cfg.rollout.group_size == 4
    assert cfg.learner.normalize_std is False and cfg.run.name == "x"
    assert cfg.learner.gamma == 0.95       # untouched default
    # A string field given a bare number on the command line (YAML reads `0` as an integer).
    assert load_config(None, ["run.learner_cpus=0"]).run.learner_cpus == "0"
    with pytest.raises(ConfigError, match="run.name: expected a string"):
        load_config(None, ["run.name=[1, 2]"])


def test_unknown_field_names_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'group_size'"):
        load_config(None, ["rollout.group_sise=4"])
    with pytest.raises(ConfigError, match="unknown config field 'nope'"):
        load_config(None, ["nope.x=1"])


def test_wrong_type_is_an_error():
    with pytest.raises(ConfigError, match="rollout.group_size: expected an integer"):
        load_config(None, ["rollout.group_size=many"])
    with pytest.raises(ConfigError, match="expected true/false"):
        load_config(None, ["learner.normalize_std=3"])
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["learner.lr"])


def test_extends_merges_sections(tmp_path):
    (tmp_path / "base.yaml").write_text("learner:\n  lr: 3.0e-6\n  gamma: 0.9\nrun:\n  name: base\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nlearner:\n  gamma: 0.99\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.learner.lr == 3e-6 and cfg.learner.gamma == 0.99 and cfg.run.name == "base"


def test_every_field_is_documented():
    rows = describe()
    assert len(rows) > 40
    undocumented = [name for name, _, doc in rows if not doc.strip()]
    assert not undocumented, undocumented


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.learner.algorithm in ("gigpo", "grpo", "rloo")
    assert cfg.env.name in ("alfworld", "webshop")


def test_choice_fields_list_the_allowed_values():
    with pytest.raises(ConfigError, match=r"learner.algorithm: 'ppo' is not a choice; use 'gigpo', 'grpo' or 'rloo'"):
        load_config(None, ["learner.algorithm=ppo"])
    for override, allowed in [("env.name=alfwrld", "'alfworld' or 'webshop'"),
                              ("env.source=files", "'generated' or 'data'"),
                              ("env.engine=slow", "'fast' or 'upstream'"),
                              ("model.dtype=fp16", "'auto', 'bfloat16' or 'float32'"),
                              ("learner.episode_stats=steps", "'rows' or 'trajectories'"),
                              ("learner.zero_stage=4", "1, 2 or 3"),
                              ("learner.zero_stage=true", "1, 2 or 3")]:     # true == 1 in Python, not a stage
        with pytest.raises(ConfigError, match=re.escape(allowed)):
            load_config(None, [override])
    assert load_config(None, ["learner.zero_stage=3", "model.dtype=float32"]).learner.zero_stage == 3
    assert ("learner.algorithm", "gigpo") in [(name, default) for name, default, _ in describe()]


@pytest.mark.parametrize("override, message", [
    ("stream.max_policy_lag=-1", "stream.max_policy_lag = -1 is not allowed; it must be >= 0"),
    ("rollout.group_size=1", "rollout.group_size = 1 is not allowed; it must be >= 2"),
    ("learner.lr=0", "learner.lr = 0.0 is not allowed; it must be > 0"),
    ("learner.lr=.nan", "learner.lr = nan is not allowed"),
    ("learner.gamma=1.01", "must be in [0, 1]"),
    ("learner.omega=-1", "learner.omega = -1.0 is not allowed; it must be >= 0"),
    ("learner.similarity=1", "must be in [0, 1)"),
    ("rollout.eval_temperature=0", "must be > 0"),
    ("inference.gpu_memory_utilization=1.5", "must be in (0, 1]"),
    ("learner.dual_clip=0.5", "must be > 1, or 0"),
    ("learner.correction_cap=1.0", "learner.correction_cap = 1.0 is not allowed; it must be > 1"),
    ("rollout.temperature=0", "rollout.temperature = 0.0 is not allowed; it must be > 0"),
    ("run.rollout_nice=-1", "must be in 0..19"),
    ("run.name=''", "run.name = '' is not allowed; it must not be empty"),
    ("run.rollout_cpus=3-1", "run.rollout_cpus: CPU list '3-1': bad range"),
    ("run.resume_tag=update_0000008", "run.resume_tag is set but run.resume is false"),
    ("stream.redis_url=localhost:6379", "stream.redis_url has no scheme; it must start with redis://"),
    # The default stream.max_stream_groups (64) over rollout.groups_per_actor (2): more could not all play.
    ("rollout.num_actors=33", "rollout.num_actors (33) is above rollout.max_actors' bound (32)"),
    ("inference.num_actors=513", "inference.num_actors (513) is above inference.max_actors' bound (512)"),
    ("autoscale.learner_wait_target=1", "autoscale.learner_wait_target = 1.0 is not allowed; it must be in (0, 1)"),
    ("autoscale.max_inference_actors=513", "autoscale.max_inference_actors (513) is above inference.max_actors' "
                                           "bound (512)"),
])
def test_ranges_and_rules_are_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_autoscale_is_refused_where_it_cannot_work():
    """Sync mode (the learner waits for every batch by design) and a floor above the most actors a run may
    have: one line naming both fields, at load."""
    with pytest.raises(ConfigError, match=re.escape("autoscale.enabled=true needs run.sync=false")):
        load_config(None, ["autoscale.enabled=true", "run.sync=true"])
    for bounds, shown in ((["autoscale.min_rollout_actors=33"], "from 33 to 32"),
                          (["autoscale.min_rollout_actors=4", "autoscale.max_rollout_actors=3"], "from 4 to 3"),
                          (["autoscale.max_rollout_actors=33"], "from 1 to 33")):
        with pytest.raises(ConfigError, match=re.escape(f"autoscale's rollout actors {shown} (autoscale.min_rollout_"
                                                        "actors, autoscale.max_rollout_actors) must lie within 1 to "
                                                        "rollout.max_actors' bound (32)")):
            load_config(None, ["autoscale.enabled=true", *bounds])
    assert load_config(None, ["autoscale.enabled=true", "autoscale.min_rollout_actors=32"]).autoscale.enabled


def test_a_batch_larger_than_the_stream_bound_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["learner.groups_per_batch=32", "stream.max_stream_groups=16"])
    text = str(err.value)
    assert "would deadlock" in text and "set stream.max_stream_groups >= 32" in text
    # Where it was set: a command-line override of either field before the file's lines.
    assert text.startswith("override 'learner.groups_per_batch=32': ")
    with pytest.raises(ConfigError, match=re.escape("override 'stream.max_stream_groups=2': learner.groups_per")):
        load_config(REPO / "configs" / "embedded.yaml", ["stream.max_stream_groups=2"])
    assert load_config(None, ["learner.groups_per_batch=16", "stream.max_stream_groups=16"])   # equal is fine


def test_errors_name_the_file_and_line(tmp_path):
    config = tmp_path / "x.yaml"
    config.write_text("run:\n  name: x\n\nrollout:\n  group_size: 4\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match=re.escape(f"{config}:6: unknown config field 'rollout.group_sise' "
                                                    "(did you mean 'group_size'?)")):
        load_config(config)
    config.write_text("learner:\n  gamma: 0.9\n  lr: -1\n")
    with pytest.raises(ConfigError, match=re.escape(f"{config}:3: learner.lr = -1.0 is not allowed")):
        load_config(config)
    config.write_text("learner: {gamma: 0.9, algorithm: ppo}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{config}:1: learner.algorithm: 'ppo' is not a choice")):
        load_config(config)
    # An override of the same field replaces the file's location with the override.
    with pytest.raises(ConfigError, match=re.escape("override 'learner.algorithm=ppo2': learner.algorithm")):
        load_config(config, ["learner.algorithm=ppo2"])


def test_yaml_errors_name_the_file_and_line(tmp_path):
    config = tmp_path / "x.yaml"
    config.write_text("run:\n  name: x\n   iterations: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{config}:3: not valid YAML: mapping values are not allowed")):
        load_config(config)
    config.write_text("run:\n  name: x\n  name: y\n")
    with pytest.raises(ConfigError, match=re.escape(f"{config}:3: 'run.name' is set twice (also at line 2)")):
        load_config(config)
    config.write_text("- run\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(config)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'nope.yaml'}: no such config file")):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"override 'learner.lr=\[1,': the value is not valid YAML"):
        load_config(None, ["learner.lr=[1,"])
    # A section whose fields are all commented out is an empty section, not an error.
    config.write_text("learner:\n  # lr: 1.0e-5\nrun:\n  name: x\n")
    assert load_config(config).learner.lr == 1e-6


def test_extends_errors_name_the_file_the_key_came_from(tmp_path):
    (tmp_path / "base.yaml").write_text("run:\n  name: base\nlearner:\n  gama: 0.9\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nlearner:\n  lr: 1.0e-5\n")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'base.yaml'}:4: unknown config field "
                                                    "'learner.gama' (did you mean 'gamma'?)")):
        load_config(tmp_path / "child.yaml")
    (tmp_path / "child.yaml").write_text("extends: nothing.yaml\n")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'child.yaml'}:1: extends 'nothing.yaml', but "
                                                    "there is no file")):
        load_config(tmp_path / "child.yaml")
    (tmp_path / "child.yaml").write_text("extends: child.yaml\n")
    with pytest.raises(ConfigError, match="circular 'extends'"):
        load_config(tmp_path / "child.yaml")


def test_errors_never_show_a_redis_password():
    """In the user part or as a query parameter (common/redaction.py)."""
    for url, shown in (("http://user:hunter2@host:6379/0", "http://user:***@host:6379/0"),
                       ("http://host:6379/0?password=hunter2", "http://host:6379/0?password=***")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"stream.redis_url={url}"])
        assert "hunter2" not in str(err.value) and f"override 'stream.redis_url={shown}'" in str(err.value)


def test_no_plane_restates_a_config_default():
    """A default lives in common/config.py only: every process receives the typed config (or a section of
    it) and reads its fields, never a dict of it with `.get(name, default)`, which would keep serving the old
    default after config.py's changes. Flags a section read as a dict (`cfg["inference"]`, `cfg["inference"]
    .get(`) and `.get(` on a name bound to one."""
    import dataclasses

    sections = "|".join(f.name for f in dataclasses.fields(ExperimentConfig))
    as_dict = re.compile(rf'\b\w*(cfg|config)\w*\[["\']({sections})["\']\]')
    alias = re.compile(rf'\b(\w+)\s*=\s*[\w.]+\[["\']({sections})["\']\]')
    found = []
    for path in _plane_modules():
        if path == REPO / "common" / "config.py":
            continue
        text = path.read_text()
        names = {m.group(1) for line in text.splitlines() if (m := alias.search(line.strip()))}
        on_alias = re.compile(rf"\b({'|'.join(map(re.escape, names))})\.get\(") if names else None
        for number, line in enumerate(text.splitlines(), 1):
            if as_dict.search(line) or (on_alias and on_alias.search(line)):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


# The planes in the order data flows (env_servers -> actors -> learner); deploy drives them all, and common
# holds only what two planes share, so it imports none.
FLOW = ("common", "env_servers", "actors", "learner", "deploy")


def _plane_modules():
    return sorted(path for folder in FLOW for path in (REPO / folder).rglob("*.py"))


def test_no_import_runs_against_the_flow():
    """Every import of the project's own modules (those inside functions too) goes to common/ or to a plane
    upstream of the importing one, never downstream: common imports no plane, env_servers neither actors nor
    the learner, actors not the learner, and no plane imports deploy."""
    import ast

    found = []
    for path in _plane_modules():
        plane = path.relative_to(REPO).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            for name in names:
                target = name.split(".")[0]
                if target in FLOW and target != plane and (
                        plane == "common" or FLOW.index(target) > FLOW.index(plane)):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {plane} imports {name}")
    assert not found, "\n".join(found)


def test_with_fields_copies_the_sections_it_changes_and_leaves_the_original():
    cfg = ExperimentConfig()
    derived = with_fields(cfg, {"model.path": "/elsewhere", "run.resume": True, "run.output_dir": "out"})
    assert (derived.model.path, derived.run.resume, derived.run.output_dir) == ("/elsewhere", True, "out")
    assert (cfg.model.path, cfg.run.resume) == (ExperimentConfig().model.path, False)
    assert derived.learner is cfg.learner          # sections not named are shared, not copied
    with pytest.raises(TypeError):
        with_fields(cfg, {"model.no_such_field": 1})


def test_the_autoscale_command_docs_deploy_md_gives_loads():
    """docs/deploy.md's autoscale example, as written there, is a valid config (bounds included)."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    line = next(line for line in docs.splitlines() if line.startswith("gigpo train") and "autoscale.enabled" in line)
    _, _, path, *overrides = line.split()
    cfg = load_config(REPO / path, overrides)
    assert cfg.autoscale.enabled and cfg.autoscale.max_inference_actors == 8
