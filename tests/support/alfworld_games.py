"""Helpers for ALFWorld tests: the few real games the tests play, held by the repository.

tests/data/alfworld/json_2.1.1/ holds four games of the standard ALFWorld game set (ALFWorld and ALFRED are
MIT-licensed), the files as `alfworld-download` (or `make data`) puts them under $ALFWORLD_DATA; the tests
copy the ones they play into a directory of their own, so no test depends on what this machine has."""
from __future__ import annotations

import shutil
from pathlib import Path

GAME_FILE = "game.tw-pddl"
HELD = Path(__file__).resolve().parents[1] / "data" / "alfworld" / "json_2.1.1"

# Real valid_unseen games the tests play: a cleaning task (sink, cabinet) and a lamp task.
REAL_GAMES = (
    "valid_unseen/pick_clean_then_place_in_recep-Bowl-None-Cabinet-10/trial_T20190909_061130_844814",
    "valid_unseen/look_at_obj_in_light-AlarmClock-None-DeskLamp-308/trial_T20190908_222917_366542",
)
# And two of valid_seen: a lamp task and a heating task.
SEEN_GAMES = (
    "valid_seen/look_at_obj_in_light-AlarmClock-None-DeskLamp-323/trial_T20190909_044715_250790",
    "valid_seen/pick_heat_then_place_in_recep-Apple-None-DiningTable-26/trial_T20190907_060234_011675",
)


def extract_games(dest: str | Path, task_ids=REAL_GAMES) -> list[str]:
    """Copy the named games (json_2.1.1/<task_id>/game.tw-pddl) into dest/json_2.1.1; returns the absolute
    game directories."""
    found = []
    for task_id in task_ids:
        out = Path(dest) / "json_2.1.1" / task_id
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HELD / task_id / GAME_FILE, out / GAME_FILE)
        found.append(str(out))
    return found
