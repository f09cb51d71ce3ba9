"""The learning check's statistics (deploy/tools/experiment.py): per-game measures, paired differences and
their intervals, on hand-made evaluations whose answers follow from the arithmetic (the t quantiles and
intervals themselves: tests/deploy/test_stats.py)."""
import math

import pytest

from common.config import load_config
from deploy.tools.experiment import STUDIES, Protocol, paired, per_game, read_evals, summarize


def ep(task, success, steps):
    return {"task_id": task, "success": success, "steps": steps}


def test_per_game_counts_a_failure_as_the_budget_and_success_within_fast_steps():
    table = per_game([ep("a", True, 5), ep("b", True, 12), ep("c", False, 30), ep("a", True, 9)],
                     budget=30, fast_steps=8)
    assert table["a"] == {"steps": 7.0, "fast": 0.5, "success": 1.0}     # two episodes: their mean
    assert table["b"] == {"steps": 12.0, "fast": 0.0, "success": 1.0}    # solved, but not within 8
    assert table["c"] == {"steps": 30.0, "fast": 0.0, "success": 0.0}


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
    s = summarize({"gigpo": {0: gigpo}, "grpo": {0: grpo}}, protocol, ("gigpo", "grpo"))
    assert s["arms"]["gigpo"]["before"]["steps"][0] == 30.0
    assert s["arms"]["gigpo"]["after"]["fast"][0] == 1.0
    assert s["paired"]["steps"]["diff"] == -4.0 and s["paired"]["fast"]["diff"] == 1.0


def _write_record(records, study: str, arm: str, seed: int, won: int, games: int = 4, **curve) -> None:
    import json

    from deploy.tools.experiment import record_path

    path = record_path(study, arm, seed, records)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "study": study, "arm": arm, "overrides": [], "seed": seed, "ok": True, "rc": 0, "wall_s": 60.0,
        "commit": "abc1234", "finished_at": "2026-11-27 20:00 UTC",
        "before": [ep(f"g{i}", False, 30) for i in range(games)],
        "after": [{**ep(f"g{i}", i < won, 6 if i < won else 30), "task_type": "heat" if i % 2 else "pick"}
                  for i in range(games)],
        "curves": [{"update": u, "batch/success_rate": 0.5, "batch/episode_steps_mean": 9.0, **curve}
                   for u in (1, 2)]}))


def test_report_from_the_records_keeps_the_plan(tmp_path, capsys):
    """`--report` runs nothing: it reads every study's records (what each finished run gave) and rewrites the
    results below the plan, which it keeps as written; a study without records says so."""
    from deploy.tools.experiment import RESULTS_MARK, main

    records, doc = tmp_path / "records", tmp_path / "learning-check.md"
    doc.write_text("# Learning check\n\n## Plan\n\nwritten before the runs\n\n" + RESULTS_MARK + "\nold results\n")
    for seed, (gigpo_won, grpo_won) in enumerate(((4, 2), (3, 1))):
        for algo, won in (("gigpo", gigpo_won), ("grpo", grpo_won)):
            _write_record(records, "tiny-pick", algo, seed, won)
    assert main(["--report", "--records", str(records), "--doc", str(doc)]) == 0
    md = doc.read_text()
    assert md.startswith("# Learning check\n\n## Plan\n\nwritten before the runs\n") and "old results" not in md
    # GiGPO solves 2 more games of 4 in both seeds: +50 points, no spread over seeds; by game: g2, g3 differ
    # by 1 in seed 0, g1... the mean over games is +50.
    assert "| success | +50.0% | ± 0.0% (2 seeds) |" in md, md
    assert "at commit(s) abc1234, on 2026-11-27" in md
    for name in set(STUDIES) - {"tiny-pick"}:
        assert "No finished runs yet." in md.split(f"### {name}:", 1)[1].split("###", 1)[0]
    assert (tmp_path / "learning-check-tiny-pick.png").stat().st_size > 0
    assert main(["--report", "--records", str(tmp_path / "none"), "--doc", str(doc)]) == 1
    assert "no records" in capsys.readouterr().err


def test_a_failed_rerun_keeps_the_finished_record(tmp_path):
    """A run that fails writes its record (the report lists it as not finished), but never over the record of
    a finished run of the same study, algorithm and seed."""
    import json

    from deploy.tools.experiment import save_record

    path = tmp_path / "tiny-pick" / "gigpo-s0.json"
    failed = {"algorithm": "gigpo", "seed": 0, "ok": False, "rc": -9}
    assert save_record(failed, path) and json.loads(path.read_text()) == failed          # nothing there yet
    finished = {**failed, "ok": True, "rc": 0, "after": [ep("g", True, 6)]}
    assert save_record(finished, path) and json.loads(path.read_text()) == finished      # a finished run replaces it
    assert not save_record(failed, path) and json.loads(path.read_text()) == finished    # a failed rerun does not
    again = {**finished, "after": [ep("g", False, 30)]}
    assert save_record(again, path) and json.loads(path.read_text()) == again            # a finished rerun does


def test_a_replication_is_reported_beside_the_plan_not_pooled(tmp_path):
    """Seeds past the plan's cap (Protocol.max_seeds) are replications: the per-seed table shows them, marked,
    and the paired analysis is the plan's seeds' alone."""
    from deploy.tools.experiment import RESULTS_MARK, main

    records, doc = tmp_path / "records", tmp_path / "learning-check.md"
    doc.write_text(RESULTS_MARK)
    cap = STUDIES["tiny-six"].protocol.max_seeds
    for seed, (gigpo_won, grpo_won) in ((0, (4, 2)), (1, (3, 1)), (cap + 3, (0, 4))):
        for algo, won in (("gigpo", gigpo_won), ("grpo", grpo_won)):
            _write_record(records, "tiny-six", algo, seed, won, **{"adv/zero_share": 0.25})
    assert main(["--report", "--records", str(records), "--doc", str(doc)]) == 0
    md = doc.read_text().split("### tiny-six:", 1)[1].split("###", 1)[0]
    assert "| success | +50.0% | ± 0.0% (2 seeds) |" in md          # the replication's -100 left out
    # Per seed: the replication marked; GiGPO's training: 50% batch success, a quarter of its rows without signal.
    assert f"| {cap + 3} r | abc1234 | 0.0% -> 0.0% | 0.0% -> 100.0% | -100.0 | 50.0% | - | 25.0% | - |" in md, md
    assert "| 0 | abc1234 | 0.0% -> 100.0% | 0.0% -> 50.0% | +50.0 |" in md
    # By task type (g1, g3 heat; g0, g2 pick): seed 1, GiGPO solves g0-g2 and GRPO g0: heat +50, pick +50.
    assert "| heat | pick |" in md and "| 1 | +50 (2) | +50 (2) |" in md


def test_every_arm_is_a_valid_config():
    """Each study's arms, over its protocol, load as configs (their overrides name real fields and choices)."""
    for study in STUDIES.values():
        for arm in study.arms:
            load_config(study.config, [*study.protocol.overrides(), *arm.overrides])
