"""The learning check's statistics (deploy/experiment.py): per-game measures, paired differences and
their intervals, on hand-made evaluations whose answers follow from the arithmetic."""
import math

import pytest

from common.config import LearnerConfig, choices
from deploy.experiment import COMPARED, Protocol, mean_ci, paired, per_game, read_evals, summarize, t_quantile_975


def ep(task, success, steps):
    return {"task_id": task, "success": success, "steps": steps}


def test_per_game_counts_a_failure_as_the_budget_and_success_within_fast_steps():
    table = per_game([ep("a", True, 5), ep("b", True, 12), ep("c", False, 30), ep("a", True, 9)],
                     budget=30, fast_steps=8)
    assert table["a"] == {"steps": 7.0, "fast": 0.5, "success": 1.0}     # two episodes: their mean
    assert table["b"] == {"steps": 12.0, "fast": 0.0, "success": 1.0}    # solved, but not within 8
    assert table["c"] == {"steps": 30.0, "fast": 0.0, "success": 0.0}


def test_t_quantiles_match_the_table_and_the_normal_limit():
    assert t_quantile_975(2) == 4.303
    assert t_quantile_975(10) == pytest.approx(2.228, abs=0.002)
    assert t_quantile_975(127) == pytest.approx(1.979, abs=0.002)
    assert t_quantile_975(10 ** 6) == pytest.approx(1.96, abs=1e-3)


def test_mean_ci_of_known_values():
    m, ci = mean_ci([1.0, 2.0, 3.0])          # sd 1, n 3: 4.303 / sqrt(3)
    assert m == 2.0 and ci == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(mean_ci([5.0])[1])


def test_paired_difference_over_games_and_over_seeds():
    # Seed 0: A is 2 steps shorter on every game; seed 1: 4 shorter. By game: -3 each (no spread); by seed:
    # -2 and -4 (mean -3, sd sqrt(2), t(1) = 12.706).
    a = {0: {"g1": {"steps": 8.0}, "g2": {"steps": 10.0}}, 1: {"g1": {"steps": 6.0}, "g2": {"steps": 8.0}}}
    b = {0: {"g1": {"steps": 10.0}, "g2": {"steps": 12.0}}, 1: {"g1": {"steps": 10.0}, "g2": {"steps": 12.0}}}
    d = paired(a, b, "steps")
    assert d["diff"] == pytest.approx(-3.0) and d["ci_games"] == pytest.approx(0.0)
    assert d["ci_seeds"] == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2))
    assert (d["games"], d["seeds"]) == (2, 2) and d["by_seed"] == {0: -2.0, 1: -4.0}


def test_summarize_reads_the_runs_evaluations(tmp_path):
    protocol = Protocol(step_budget=30, fast_steps=8)
    (tmp_path / "evals.jsonl").write_text(
        '{"when": "before training", "episodes_detail": [{"task_id": "g", "success": false, "steps": 30}]}\n'
        '{"when": "after update 4", "episodes_detail": []}\n'
        '{"when": "after training", "episodes_detail": [{"task_id": "g", "success": true, "steps": 6}]}\n')
    gigpo = read_evals(tmp_path)
    assert set(gigpo) == {"before", "after"}
    grpo = {"before": gigpo["before"], "after": [ep("g", True, 10)]}
    s = summarize({"gigpo": {0: gigpo}, "grpo": {0: grpo}}, protocol)
    assert s["algorithms"]["gigpo"]["before"]["steps"][0] == 30.0
    assert s["algorithms"]["gigpo"]["after"]["fast"][0] == 1.0
    assert s["paired"]["steps"]["diff"] == -4.0 and s["paired"]["fast"]["diff"] == 1.0


def test_report_of_finished_runs(tmp_path, capsys):
    """`--report` runs nothing: it reads the run directories (evaluations, per-update metrics, how each run
    ended) and writes the table and the plot."""
    import json

    from deploy.experiment import RUN_INFO, main

    work, out = tmp_path / "runs", tmp_path / "out"
    for algo, after_steps in (("gigpo", 6), ("grpo", 10)):
        run = work / f"{algo}-s0"
        run.mkdir(parents=True)
        before = [ep(f"g{i}", i % 2 == 0, 12) for i in range(4)]
        after = [ep(f"g{i}", True, after_steps) for i in range(4)]
        run.joinpath("evals.jsonl").write_text("".join(json.dumps({"when": w, "episodes_detail": e}) + "\n" for w, e in
                                                       (("before training", before), ("after training", after))))
        run.joinpath("metrics.jsonl").write_text("".join(json.dumps(
            {"update": u, "batch/success_rate": 0.5, "batch/episode_steps_mean": 9.0, "diag/adv_cosine_vs_grpo": 0.9})
            + "\n" for u in (1, 2)))
        run.joinpath(RUN_INFO).write_text(json.dumps({"ok": True, "rc": 0, "wall_s": 60.0, "log": "train.log"}))
    assert main(["--report", "--seeds", "1", "--work-dir", str(work), "--out", str(out)]) == 0
    md = (out / "learning-check.md").read_text()
    # GiGPO 6 steps on every game, GRPO 10: -4 paired, no spread over games.
    assert "| mean steps (failure = budget) | -4.0 | ± 0.0 (4 games) | n/a (1 seeds) | s0: -4.0 |" in md
    assert "| gigpo | 1 | before | 21.0 | 0.0% | 50.0% |" in md       # failures count as the budget (30)
    assert (out / "learning-check.png").stat().st_size > 0
    assert main(["--report", "--work-dir", str(tmp_path / "none"), "--out", str(out)]) == 1
    assert "no finished runs" in capsys.readouterr().err


def test_the_compared_algorithms_are_choices_of_the_config():
    assert set(COMPARED) <= set(choices(LearnerConfig, "algorithm"))
