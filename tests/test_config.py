"""Experiment configuration: YAML files, dotted overrides, clear errors, and every shipped config loads."""
from pathlib import Path

import pytest

from common.config import ConfigError, ExperimentConfig, describe, load_config

CONFIGS = sorted(Path(__file__).resolve().parent.parent.joinpath("configs").glob("*.yaml"))


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
