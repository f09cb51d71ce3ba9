"""ALFWorld as a TextEnv: real TextWorld PDDL games, from the standard game set or generated locally.

Task ids: source "data": the game directory under `$ALFWORLD_DATA/json_2.1.1`, e.g.
`valid_unseen/pick_and_place_simple-Mug-None-Desk-308/trial_T20190908_125200_737896` (an absolute path to a
game directory or `game.tw-pddl` also works); source "generated": `gen/<split>/<index>` (e.g.
`gen/train/00017`), built in memory by `env_servers.alfworld_gen`, the same games everywhere.
Splits: "train", "valid_seen", "valid_unseen", "valid_train", and "eval" = "valid_unseen" (the paper's
ALFWorld table). Generated games have "train" and "eval" (valid_seen/valid_unseen are aliases of eval).

Reports: `observation` = `anchor` = the TextWorld feedback without its constant banner (at reset the room
and the task; afterwards e.g. "You arrive at desk 1. ..." or "Nothing happens."); `admissible_actions` is
the engine's list without "help"; `reward` and `score` are 1.0 on the winning step (the rollout applies
its own success reward); `done` = won.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
from pathlib import Path

import env_servers
from common.config import EnvConfig, choices
from env_servers.alfworld_engine import make_engine
from env_servers.alfworld_gen import GeneratorOptions, game_seed, generate_game
from env_servers.base import EnvReport

GAME_SET = "json_2.1.1"
GAME_FILE = "game.tw-pddl"
DATA_SPLITS = ("train", "valid_seen", "valid_unseen", "valid_train")
SPLIT_ALIASES = {"eval": "valid_unseen", "test": "valid_unseen"}
# Generated games have two splits, train and eval; the standard names of held-out splits all mean eval.
GENERATED_SPLITS = ("train", "eval", "valid_seen", "valid_unseen", "test")
BANNER = "-= Welcome to TextWorld, ALFRED! =-\n\n"
TASK_PREFIX = "Your task is to: "
HIDDEN_ACTIONS = ("help",)   # admissible to the engine, but only ever prints the command list
MAKE_DATA_HINT = "run `make data` (unpacks the ALFWorld game set into $ALFWORLD_DATA)"


ALFWORLD_OWN_DEFAULT = os.path.expanduser("~/.cache/alfworld")     # what `import alfworld` sets when unset


def default_data_dir() -> str:
    """$ALFWORLD_DATA, else ./data/alfworld (what `make data` fills), as an absolute path: the driver hands
    it to every actor (deploy.run_lifecycle.start_ray), whose working directory is Ray's, not the driver's.
    The value ALFWorld's own import puts there when it was unset (~/.cache/alfworld) counts as unset."""
    value = os.environ.get("ALFWORLD_DATA")
    if value == ALFWORLD_OWN_DEFAULT and env_servers.ALFWORLD_DATA_AT_START != value:
        value = None
    return os.path.abspath(value or os.path.join("data", "alfworld"))


def task_type_of(game_dir_name: str) -> str:
    """ALFWorld's game directories are named <task_type>-<Object>-<Movable>-<Target>-<scene>."""
    return game_dir_name.split("-", 1)[0]


def game_trials(game_root: str | os.PathLike, split: str):
    """(game directory, trial directory) of every game file of a split of the standard game set, sorted."""
    split_dir = Path(game_root) / split
    for game_dir in sorted(split_dir.iterdir()) if split_dir.is_dir() else ():
        for trial in sorted(game_dir.iterdir()) if game_dir.is_dir() else ():
            if (trial / GAME_FILE).is_file():
                yield game_dir, trial


def skipped(game_dir_name: str) -> bool:
    """The games ALFWorld's own loader skips."""
    return "movable" in game_dir_name or "Sliced" in game_dir_name


def list_data_tasks(game_root: str | os.PathLike, split: str) -> list[str]:
    """Task ids of a split of the standard game set: the index written by `make data` when present
    (solvable games only), else every directory holding a game file. Task types take turns (the first game
    of each type, then the second, ...), so that any first N games (`run.eval_episodes: N`) cover every task
    type evenly instead of the alphabetically first one."""
    root = Path(game_root)
    index = root / "index.json"
    ids = None
    if index.exists():
        with open(index) as f:
            ids = json.load(f).get(split)
    if ids is None:
        ids = [f"{split}/{g.name}/{trial.name}" for g, trial in game_trials(root, split) if not skipped(g.name)]
    by_type: dict[str, list[str]] = {}
    for task_id in ids:
        by_type.setdefault(task_type_of(task_id.split("/")[1]), []).append(task_id)
    turns = itertools.zip_longest(*by_type.values())
    return [task_id for turn in turns for task_id in turn if task_id is not None]


class ALFWorldEnv:
    """One ALFWorld game instance (TextEnv). Blocking; not thread-safe (one caller at a time)."""

    def __init__(self, data_dir: str | None = None, source: str = EnvConfig.source, engine: str = EnvConfig.engine,
                 generator: dict | GeneratorOptions | None = None,
                 num_generated_games: int = EnvConfig.num_generated_games, seed: int = 0):
        if source not in choices(EnvConfig, "source"):
            raise ValueError(f"ALFWorld source {source!r}: choose one of {choices(EnvConfig, 'source')}")
        self.source = source
        self.engine_name = engine
        self.data_dir = data_dir or default_data_dir()
        self.game_root = os.path.join(self.data_dir, GAME_SET)
        self.options = (generator if isinstance(generator, GeneratorOptions)
                        else GeneratorOptions.from_dict(generator))
        self.num_generated = {"train": int(num_generated_games), "eval": int(max(8, num_generated_games // 4))}
        self.seed = seed
        self._engine = make_engine(engine)
        self._loaded: str | None = None          # task id whose game the engine holds
        # Generated games by (split, index): generation is deterministic, so a cache only saves time.
        self._generated = functools.lru_cache(maxsize=128)(
            lambda split, index: generate_game(self.options, game_seed(self.options, split, index)))
        self._task_id: str | None = None
        self._task_type = ""
        self._task = ""
        self._admissible: list[str] = []
        self._steps = 0
        self._won = False

    def task_ids(self, split: str) -> list[str]:
        if self.source == "generated":
            gsplit = "train" if split == "train" else "eval"
            if split not in GENERATED_SPLITS:
                raise KeyError(f"unknown split {split!r} for generated ALFWorld games: use 'train' or 'eval'")
            return [f"gen/{gsplit}/{i:05d}" for i in range(self.num_generated[gsplit])]
        split = SPLIT_ALIASES.get(split, split)
        if split not in DATA_SPLITS:
            raise KeyError(f"unknown ALFWorld split {split!r}; splits: {DATA_SPLITS} (+ 'eval' = valid_unseen)")
        self._require_data()
        return list_data_tasks(self.game_root, split)

    def _require_data(self) -> None:
        if not os.path.isdir(self.game_root):
            raise FileNotFoundError(f"ALFWorld games not found under {self.game_root}: {MAKE_DATA_HINT}")

    def _resolve(self, task_id: str) -> tuple[str | dict, str]:
        """(what the engine loads: a game file path or a generated game dict, task type)."""
        if not isinstance(task_id, str) or not task_id:
            raise KeyError(f"task id must be a non-empty string, got {task_id!r}")
        if os.path.isabs(task_id):
            path = Path(task_id)
            path = path / GAME_FILE if path.is_dir() else path
            if not path.is_file():
                raise KeyError(f"no ALFWorld game file at {path}")
            return str(path), task_type_of(path.parent.parent.name if path.parent.name.startswith("trial")
                                           else path.parent.name)
        if task_id.startswith("gen/"):
            parts = task_id.split("/")
            # Any index names a game (generation is deterministic); task_ids() lists the configured count.
            if not (len(parts) == 3 and parts[1] in self.num_generated and parts[2].isdigit()):
                raise KeyError(f"unknown generated task id {task_id!r}; ids look like gen/train/00017 or "
                               f"gen/eval/00003")
            game = self._generated(parts[1], int(parts[2]))
            return game, game["task_type"]
        if self.source == "generated" and not os.path.isdir(self.game_root):
            raise KeyError(f"unknown ALFWorld task id {task_id!r}: generated game ids look like gen/train/00017 "
                           f"or gen/eval/00003 (list them with task_ids(split))")
        self._require_data()
        if task_id.startswith(GAME_SET + "/"):
            task_id = task_id[len(GAME_SET) + 1:]
        path = Path(self.game_root) / task_id / GAME_FILE
        parts = task_id.split("/")
        if len(parts) != 3 or ".." in parts or not path.is_file():
            raise KeyError(f"unknown ALFWorld task id {task_id!r}: no {GAME_FILE} under {self.game_root}. Ids "
                           f"look like valid_unseen/<task_type>-<Object>-...-<scene>/trial_...; list them with "
                           f"task_ids(split) (splits {DATA_SPLITS})")
        return str(path), task_type_of(parts[1])

    def reset(self, task_id: str, seed: int = 0) -> EnvReport:
        game, task_type = self._resolve(task_id)
        if self._loaded != task_id:
            self._loaded = None
            self._engine.load(game)
            self._loaded = task_id
        state = self._engine.reset()
        self._task_id, self._task_type, self._steps, self._won = task_id, task_type, 0, False
        text = self._clean(state.feedback)
        self._task = text.split(TASK_PREFIX, 1)[1].strip().rstrip(".") if TASK_PREFIX in text else ""
        walkthrough = self._engine.unwrapped.walkthrough   # the game's solution, when it carries one
        return self._report(state, text, reward=0.0, admissible=True,
                            extra={"seed": seed, "walkthrough": list(walkthrough or [])})

    def step(self, action: str) -> EnvReport:
        if self._task_id is None:
            raise RuntimeError("ALFWorldEnv.step() before reset(): reset the instance to a task first")
        command = str(action).strip()
        admissible = command in self._admissible
        state, _, _ = self._engine.step(command)   # unknown commands: the engine answers "Nothing happens."
        self._steps += 1
        won = bool(state["won"])
        reward = 1.0 if won and not self._won else 0.0
        self._won = self._won or won
        return self._report(state, self._clean(state.feedback), reward=reward, admissible=admissible, extra={})

    @staticmethod
    def _clean(feedback: str) -> str:
        return feedback.removeprefix(BANNER).strip()

    def _report(self, state, text: str, reward: float, admissible: bool, extra: dict) -> EnvReport:
        self._admissible = [a for a in state["admissible_commands"] if a not in HIDDEN_ACTIONS]
        won = bool(state["won"])
        return EnvReport(observation=text, anchor=text, admissible_actions=list(self._admissible),
                         reward=reward, done=won, won=won, task=self._task, task_type=self._task_type,
                         action_admissible=admissible, score=1.0 if won else 0.0,
                         info={"task_id": self._task_id, "steps": self._steps, "engine": self.engine_name,
                               **extra})

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            lib = getattr(engine.unwrapped, "downward_lib", None)
            if lib is not None:
                # Free the planner's task, but do not dlclose the library copy (fast_downward.close_lib):
                # C++ "unique" symbols bind the plugin registries of all copies loaded in a process to
                # each other, so unmapping one copy makes the process crash at exit (SIGSEGV in
                # RawRegistry's destructor). A closed copy stays mapped until the process ends.
                lib.cleanup()
        except Exception:   # closing is best effort: the process may be going away anyway
            pass
