"""ALFWorld on the real TextWorld engine: real and generated games, fast vs upstream engine, errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from env_servers.alfworld_env import GAME_FILE, ALFWorldEnv, list_data_tasks
from env_servers.alfworld_engine import make_engine
from env_servers.alfworld_gen import TASK_TYPES, GeneratorOptions, generate_game, write_games
from env_servers.base import TextEnv
from env_servers import data as env_data
from env_servers.data import (GAME_SET_SHA256, GameSetChecksumError, build_metadata, game_set_digest,
                              prepare_alfworld, traj_data_for)
from tests.support.alfworld_games import REAL_GAMES, SEEN_GAMES, extract_games

@pytest.fixture(scope="module")
def real_games(tmp_path_factory):
    root = tmp_path_factory.mktemp("alfworld")
    dirs = extract_games(root)
    return root, dirs


@pytest.fixture(scope="module")
def gen_env():
    env = ALFWorldEnv(source="generated", generator={"preset": "default"}, num_generated_games=12)
    yield env
    env.close()


def play(env, task_id, actions):
    reports = [env.reset(task_id)]
    for action in actions:
        reports.append(env.step(action))
    return reports


def test_is_a_text_env(gen_env):
    assert isinstance(gen_env, TextEnv)


def test_generated_games_of_every_task_type_are_won_by_their_solution(gen_env):
    seen_types = set()
    for seed in range(40):
        game = generate_game(GeneratorOptions.from_dict({"preset": "default"}), seed)
        if game["task_type"] in seen_types:
            continue
        seen_types.add(game["task_type"])
        engine = make_engine("fast")
        engine.load(game)
        state = engine.reset()
        assert not state["won"]
        for action in game["walkthrough"]:
            assert action in state["admissible_commands"], (game["task_type"], action)
            state, _, _ = engine.step(action)
        assert state["won"], game["task_type"]
    assert seen_types == set(TASK_TYPES)


def test_generated_task_ids_play_to_a_win_through_the_env(gen_env):
    for task_id in gen_env.task_ids("train")[:4] + gen_env.task_ids("eval")[:2]:
        reports = play(gen_env, task_id, gen_env.reset(task_id).info["walkthrough"])
        first, last = reports[0], reports[-1]
        assert first.task and first.task in first.observation and first.task_type in TASK_TYPES
        assert first.anchor == first.observation and not first.done and first.reward == 0.0
        assert all(r.action_admissible for r in reports[1:])
        assert last.won and last.done and last.reward == 1.0 and last.score == 1.0
        assert [r.reward for r in reports[1:-1]] == [0.0] * (len(reports) - 2)


def test_generator_is_deterministic_and_files_load(tmp_path):
    opts = GeneratorOptions.tiny()
    assert generate_game(opts, 5) == generate_game(opts, 5)
    assert generate_game(opts, 5)["pddl_problem"] != generate_game(opts, 6)["pddl_problem"]
    paths = write_games(tmp_path, 3, opts)
    assert paths == write_games(tmp_path, 3, opts)   # same names, same content
    env = ALFWorldEnv(source="generated")
    try:
        for path in paths:
            game = json.loads(open(path).read())
            last = play(env, path, game["walkthrough"])[-1]   # an absolute path is a task id too
            assert last.won
    finally:
        env.close()


def test_tiny_games_are_small_pick_and_place():
    opts = GeneratorOptions.tiny()
    for seed in range(20):
        game = generate_game(opts, seed)
        assert game["task_type"] == "pick_and_place_simple"
        lines = game["pddl_problem"].splitlines()
        n_recep = sum(line.endswith(" - receptacle") and "?" not in line for line in lines)
        n_obj = sum(line.endswith(" - object") and "?" not in line for line in lines)
        assert 3 <= n_recep <= 5 and 1 <= n_obj <= 3 and len(game["walkthrough"]) <= 6


def test_random_policy_sometimes_wins_a_tiny_game_within_15_steps():
    """The embedded default learns from these games only if exploration finds wins: a uniformly random
    policy over the admissible actions (seeded, so this is a fixed check) wins some within 15 steps."""
    import random
    env = ALFWorldEnv(source="generated", num_generated_games=30)
    rng = random.Random(0)
    wins = 0
    try:
        for task_id in env.task_ids("train"):
            report = env.reset(task_id)
            for _ in range(15):
                report = env.step(rng.choice(report.admissible_actions))
                if report.won:
                    wins += 1
                    break
    finally:
        env.close()
    assert 1 <= wins <= 15, wins


def test_real_game_is_won_by_its_walkthrough(real_games):
    _, dirs = real_games
    env = ALFWorldEnv(source="data", data_dir=str(real_games[0]))
    try:
        for game_dir in dirs:
            walkthrough = json.load(open(os.path.join(game_dir, "game.tw-pddl")))["walkthrough"]
            reports = play(env, game_dir, walkthrough)
            first, last = reports[0], reports[-1]
            assert first.observation.startswith("You are in the middle of a room.")
            assert "Your task is to: " + first.task in first.observation
            assert first.task_type == os.path.basename(os.path.dirname(game_dir)).split("-")[0]
            assert last.won and last.done and last.reward == 1.0
        # The same game by its task id (relative to the game-set root).
        report = env.reset(REAL_GAMES[0])
        assert report.info["task_id"] == REAL_GAMES[0] and report.task_type == "pick_clean_then_place_in_recep"
        assert env.task_ids("eval") == sorted(REAL_GAMES)
    finally:
        env.close()


def test_fast_engine_is_byte_identical_to_upstream(real_games):
    """Replays walkthroughs (plus junk, look/inventory/examine and a help) on both engines and compares
    every observation, admissible list, reward and won flag."""
    _, dirs = real_games
    games = [json.load(open(os.path.join(d, "game.tw-pddl"))) for d in dirs]
    games.append(generate_game(GeneratorOptions.from_dict({"preset": "default", "task_types":
                                                           ["pick_heat_then_place_in_recep"]}), 1))
    for game in games:
        actions = ["look", "inventory", "xyzzy", "help", "take nothing from nowhere"] + game["walkthrough"]
        runs = {}
        for name in ("upstream", "fast"):
            engine = make_engine(name)
            engine.load(game)
            state = engine.reset()
            trace = [(state.feedback, state["admissible_commands"], state["won"])]
            for action in actions:
                state, reward, done = engine.step(action)
                trace.append((state.feedback, state["admissible_commands"], state["won"], reward, done))
            runs[name] = trace
        assert runs["fast"] == runs["upstream"]
        assert runs["fast"][-1][2] is True


def test_bad_actions_give_normal_feedback(gen_env):
    task_id = gen_env.task_ids("train")[0]
    first = gen_env.reset(task_id)
    for bad in ["", "   ", "fly to the moon", "GO TO " + first.admissible_actions[0][6:], "help", "x" * 5000,
                "go to\nshelf 1"]:
        report = gen_env.step(bad)
        assert report.action_admissible is False and not report.done
        if bad != "help":
            assert report.observation == "Nothing happens."
    assert "help" not in gen_env.reset(task_id).admissible_actions


def test_same_task_gives_identical_first_reports(gen_env):
    task_id = gen_env.task_ids("train")[3]
    envs = [ALFWorldEnv(source="generated", generator={"preset": "default"}, num_generated_games=12, seed=s)
            for s in range(3)]
    try:
        firsts = [e.reset(task_id, seed=7) for e in envs] + [gen_env.reset(task_id, seed=7)]
        assert all(f == firsts[0] for f in firsts)
        # Instances in one process keep separate game states: one wins, the next is still at the start.
        for action in firsts[0].info["walkthrough"]:
            last = envs[0].step(action)
        assert last.won
        assert envs[1].step("inventory").observation == "You are not carrying anything."
        assert not envs[1].step("look").won
    finally:
        for e in envs:
            e.close()


def test_errors_say_what_to_do(tmp_path, gen_env):
    with pytest.raises(KeyError, match="gen/train/00017"):
        gen_env.reset("gen/valid/1")
    with pytest.raises(KeyError):
        gen_env.reset("no-such-task")
    with pytest.raises(KeyError):
        gen_env.task_ids("nonsense")
    env = ALFWorldEnv(source="data", data_dir=str(tmp_path))
    try:
        with pytest.raises(FileNotFoundError, match="make data"):
            env.task_ids("train")
        with pytest.raises(FileNotFoundError, match="make data"):
            env.reset("valid_unseen/a-b-c-d-1/trial_1")
        with pytest.raises(RuntimeError, match="reset"):
            env.step("look")
    finally:
        env.close()
    with pytest.raises(ValueError, match="task_types"):
        GeneratorOptions.from_dict({"task_types": ["fly"]})
    with pytest.raises(ValueError, match="unknown generator option"):
        GeneratorOptions.from_dict({"room": 2})


def test_a_downloaded_game_set_is_checked_and_a_wrong_one_not_kept(tmp_path, monkeypatch, capsys):
    """Without ALFWORLD_SOURCE, `make data` runs alfworld-download, which needs internet: here a stand-in script
    that copies real games into $ALFWORLD_DATA (a tampered or truncated download cannot be caused for real).
    A set whose games match the expected digests is indexed; one with a game changed by one byte is removed,
    with one line, and nothing is indexed; `make data`'s entry checks against the standard set's digests."""
    staged = tmp_path / "staged"
    extract_games(staged, REAL_GAMES + SEEN_GAMES)
    script = tmp_path / "alfworld-download"
    script.write_text(f'#!/bin/sh\nmkdir -p "$ALFWORLD_DATA" && cp -r {staged}/json_2.1.1 "$ALFWORLD_DATA"/\n')
    script.chmod(0o755)
    monkeypatch.setattr(env_data, "_alfworld_download", lambda: str(script))
    monkeypatch.delenv("ALFWORLD_SOURCE", raising=False)
    expected = {split: game_set_digest(staged / "json_2.1.1", split) for split in ("valid_seen", "valid_unseen")}
    root = prepare_alfworld(str(tmp_path / "good"), log=lambda *_: None, expected_sha256=expected)
    assert sorted(json.load(open(root / "index.json"))) == ["valid_seen", "valid_unseen"]

    game = staged / "json_2.1.1" / REAL_GAMES[0] / GAME_FILE
    game.write_bytes(game.read_bytes().replace(b"Bowl", b"Bow1", 1))
    bad = tmp_path / "bad"
    with pytest.raises(GameSetChecksumError, match=r"valid_unseen split is not the expected one .*nothing was kept"):
        prepare_alfworld(str(bad), log=lambda *_: None, expected_sha256=expected)
    assert not (bad / "json_2.1.1").exists()

    # The standard set's digests, one per split, are what `make data` checks: these four games are not it.
    assert sorted(GAME_SET_SHA256) == sorted(("train", "valid_seen", "valid_unseen", "valid_train"))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "make-data"))
    assert env_data.main(["prepare", "--only", "alfworld"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the expected one" in err[0] and "ALFWORLD_SOURCE" in err[0], err
    assert not (tmp_path / "make-data" / "json_2.1.1").exists()


def test_prepare_unpacks_indexes_and_is_idempotent(tmp_path):
    # A small archive in the standard layout, built from generated games.
    src = tmp_path / "src" / "json_2.1.1" / "valid_unseen"
    games = write_games(tmp_path / "gen", 2, GeneratorOptions.tiny(), split="x")
    for i, path in enumerate(games):
        name = os.path.basename(os.path.dirname(path)).replace("-gen", "-None-Shelf-")
        (src / name / "trial_T0").mkdir(parents=True)
        (src / name / "trial_T0" / "game.tw-pddl").write_text(open(path).read())
    archive = tmp_path / "set.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(tmp_path / "src" / "json_2.1.1", arcname="json_2.1.1")
    dest = tmp_path / "data"
    root = prepare_alfworld(str(dest), str(archive), log=lambda *_: None)
    index = json.load(open(root / "index.json"))
    assert len(index["valid_unseen"]) == 2
    traj = json.load(open(root / index["valid_unseen"][0] / "traj_data.json"))
    assert traj["task_type"] == "pick_and_place_simple"
    assert traj["pddl_params"]["parent_target"] == "Shelf" and traj["pddl_params"]["mrecep_target"] == ""
    said = []
    before = {p: p.stat().st_mtime_ns for p in (root / "valid_unseen").rglob("*")}
    prepare_alfworld(str(dest), str(archive), log=said.append)       # a second time: nothing to do
    assert said == [f"ALFWorld: game set ready at {root}"]
    assert {p: p.stat().st_mtime_ns for p in (root / "valid_unseen").rglob("*")} == before
    env = ALFWorldEnv(source="data", data_dir=str(dest))
    try:
        assert env.task_ids("eval") == index["valid_unseen"]
        assert env.reset(index["valid_unseen"][0]).task_type == "pick_and_place_simple"
    finally:
        env.close()


def test_data_splits_list_task_types_in_turns(tmp_path):
    """Any first N games of a split cover its task types evenly (run.eval_episodes: N), with or without
    the index `make data` writes."""
    root = tmp_path / "json_2.1.1"
    for name in ("look_at_obj_in_light-A-None-DeskLamp-1", "look_at_obj_in_light-B-None-DeskLamp-2",
                 "pick_and_place_simple-C-None-Shelf-3", "pick_two_obj_and_place-D-None-Shelf-4"):
        (root / "valid_seen" / name / "trial_T0").mkdir(parents=True)
        (root / "valid_seen" / name / "trial_T0" / GAME_FILE).write_text('{"solvable": true}')
    want = ["look_at_obj_in_light-A-None-DeskLamp-1", "pick_and_place_simple-C-None-Shelf-3",
            "pick_two_obj_and_place-D-None-Shelf-4", "look_at_obj_in_light-B-None-DeskLamp-2"]
    want = [f"valid_seen/{name}/trial_T0" for name in want]
    assert list_data_tasks(root, "valid_seen") == want
    build_metadata(root)
    assert list_data_tasks(root, "valid_seen") == want


def test_traj_data_from_directory_names():
    look = traj_data_for("look_at_obj_in_light-AlarmClock-None-DeskLamp-308")
    assert look["task_type"] == "look_at_obj_in_light"
    assert look["pddl_params"] == {"object_target": "AlarmClock", "object_sliced": False, "mrecep_target": "",
                                   "parent_target": "", "toggle_target": "DeskLamp"}
    pick = traj_data_for("pick_and_place_with_movable_recep-Pencil-Mug-Desk-309")
    assert pick["pddl_params"]["mrecep_target"] == "Mug" and pick["pddl_params"]["parent_target"] == "Desk"
    with pytest.raises(ValueError):
        traj_data_for("weird")


def test_a_process_that_closed_envs_exits_cleanly():
    # Regression: dlclose-ing one copy of fast-downward's library made the process crash at exit.
    code = ("from env_servers.alfworld_env import ALFWorldEnv\n"
            "envs = [ALFWorldEnv(source='generated', num_generated_games=2, seed=s) for s in range(2)]\n"
            "for e in envs:\n"
            "    e.reset(e.task_ids('train')[0])\n"
            "envs[1].close()\n")    # the copy loaded last: its unmapping crashed the exit
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
