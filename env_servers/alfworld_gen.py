"""Small ALFWorld games, generated from the PDDL domain and grammar that the alfworld package ships.

A game is one room with a few receptacles and objects and one of ALFWorld's six task types, in the standard
`game.tw-pddl` format (JSON: `pddl_domain`, `grammar`, `pddl_problem`, `solvable`, `walkthrough`), so it
plays on the same engine. Solvable by construction, it carries its solution; generation is deterministic:

    game = generate_game(GeneratorOptions.tiny(), seed=3)     # dict, loadable by the engine directly
    write_games("/tmp/games", 8, GeneratorOptions())          # <dir>/train/<task_type>-.../game.tw-pddl

In the tiny setting (one room, 3-5 receptacles, 1-3 objects, pick_and_place_simple) a random policy over
the admissible actions sometimes wins within 10-15 steps.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from common.atomic_write import write_atomically
from common.seeds import stable_seed

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

# Receptacles a room of each kind draws from (ALFWorld's scene kinds).
ROOM_RECEPTACLES = {
    "kitchen": ["CounterTop", "Cabinet", "Drawer", "Fridge", "Microwave", "SinkBasin", "StoveBurner",
                "DiningTable", "Shelf", "GarbageCan", "CoffeeMachine", "Toaster", "SideTable"],
    "livingroom": ["Sofa", "ArmChair", "CoffeeTable", "SideTable", "TVStand", "Shelf", "Drawer", "Cabinet",
                   "GarbageCan", "Dresser", "DiningTable", "Safe"],
    "bedroom": ["Bed", "Desk", "Drawer", "Shelf", "Dresser", "SideTable", "GarbageCan", "LaundryHamper",
                "Safe", "ArmChair"],
    "bathroom": ["Toilet", "CounterTop", "SinkBasin", "Cabinet", "Drawer", "TowelHolder", "HandTowelHolder",
                 "GarbageCan", "BathtubBasin", "Shelf", "ToiletPaperHanger"],
}
# Receptacles that need to exist for a task type, and what the task does there.
TASK_TOOL = {"pick_clean_then_place_in_recep": ("SinkBasin", "clean", "isClean", "cleanable"),
             "pick_heat_then_place_in_recep": ("Microwave", "heat", "isHot", "heatable"),
             "pick_cool_then_place_in_recep": ("Fridge", "cool", "isCool", "coolable")}
LAMP_RECEPTACLES = ("Desk", "SideTable", "Dresser", "Shelf", "CoffeeTable")
# Receptacles that are never a task target (as in ALFWorld: you do not "put a mug in microwave" goals).
NON_TARGETS = {"Microwave", "SinkBasin", "StoveBurner", "Toaster", "CoffeeMachine", "BathtubBasin",
               "GarbageCan"}
# Types the domain names as constants: the problem must declare them even when unused.
DOMAIN_OTYPES = ("Knife", "ButterKnife")
DOMAIN_RTYPES = ("SinkBasin", "Sink", "Microwave", "Fridge")


@dataclass
class GeneratorOptions:
    """Size and kind of the generated games. Counts are inclusive [low, high] ranges."""

    rooms: list = field(default_factory=lambda: list(ROOM_RECEPTACLES))   # room kinds a game draws from
    receptacles: list = field(default_factory=lambda: [4, 8])
    objects: list = field(default_factory=lambda: [2, 6])                  # movable objects in the room
    task_types: list = field(default_factory=lambda: list(TASK_TYPES))
    openable: bool = True          # allow openable receptacles (drawers, cabinets...; they start closed)
    seed: int = 0                                                          # seed of the game set

    @classmethod
    def tiny(cls) -> "GeneratorOptions":
        """One room, 3-5 receptacles, 1-3 objects, pick_and_place_simple: a random policy wins sometimes."""
        return cls(rooms=["kitchen", "bedroom", "livingroom"], receptacles=[3, 5], objects=[1, 3],
                   task_types=["pick_and_place_simple"], openable=False)

    @classmethod
    def from_dict(cls, opts: dict | None) -> "GeneratorOptions":
        """From EnvConfig.generator: {} gives the tiny setting; {"preset": "default"} the larger one."""
        opts = dict(opts or {})
        preset = opts.pop("preset", "tiny")
        if preset not in ("tiny", "default"):
            raise ValueError(f"generator preset {preset!r}: choose 'tiny' or 'default'")
        base = cls.tiny() if preset == "tiny" else cls()
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(opts) - names
        if unknown:
            raise ValueError(f"unknown generator option(s) {sorted(unknown)}; options: {sorted(names)}")
        for key, value in opts.items():
            if key in ("receptacles", "objects"):
                value = [int(value), int(value)] if isinstance(value, int) else [int(v) for v in value]
                if len(value) != 2 or value[0] > value[1] or value[0] < 1:
                    raise ValueError(f"generator.{key} must be a count or [low, high] with 1 <= low <= high")
            setattr(base, key, value)
        for key, allowed in (("task_types", TASK_TYPES), ("rooms", sorted(ROOM_RECEPTACLES))):
            bad = [v for v in getattr(base, key) if v not in allowed]
            if bad or not getattr(base, key):
                raise ValueError(f"generator.{key} {bad or '[]'}: choose from {allowed}")
        return base


@lru_cache(maxsize=1)
def _package_logic() -> tuple[str, str, dict, dict, set]:
    """(domain, grammar template, receptacle -> objects it can hold, property -> objects, openable)."""
    import alfworld.gen.constants as constants
    import alfworld.info
    data = Path(alfworld.info.__file__).parent / "data"   # ships alfred.pddl and alfred.twl2
    domain = (data / "alfred.pddl").read_text()
    grammar = (data / "alfred.twl2").read_text()
    can_hold = {r: {o for o in objs if not o.endswith("Sliced")}
                for r, objs in constants.VAL_RECEPTACLE_OBJECTS.items()}
    props = {k: set(v) for k, v in constants.VAL_ACTION_OBJECTS.items()}
    return domain, grammar, can_hold, props, set(constants.OPENABLE_CLASS_LIST)


def _display_names(ids: list[str]) -> dict[str, str]:
    """The names the engine shows ("mug 1"): ALFWorld's demangler over the lower-cased ids (fast-downward
    lower-cases every PDDL name)."""
    from types import SimpleNamespace
    from alfworld.agents.utils.misc import Demangler
    infos = {i.lower(): SimpleNamespace(id=i.lower()) for i in ids}
    demangler = Demangler(game_infos=infos)
    return {i: demangler.demangle_alfred_name(i.lower()) for i in ids}


class _Scene:
    """Receptacles and objects of one room, with ids in ALFWorld's `Name_bar_...` form."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.receptacles: dict[str, str] = {}           # id -> type, in the order added
        self.objects: dict[str, str] = {}               # id -> type, in the order added
        self.inside: dict[str, str] = {}                # object id -> receptacle id
        self._used: set[str] = set()

    def _new_id(self, kind: str) -> str:
        while True:   # ALFWorld ids carry coordinates; any unique "_bar_" suffix demangles the same way
            ident = f"{kind}_bar__plus_{self.rng.randrange(100):02d}_dot_{self.rng.randrange(100):02d}"
            if ident not in self._used:
                self._used.add(ident)
                return ident

    def add_receptacle(self, kind: str) -> str:
        ident = self._new_id(kind) if kind != "SinkBasin" else self._new_id("Sink") + "_bar_SinkBasin"
        self.receptacles[ident] = kind
        return ident

    def add_object(self, kind: str, receptacle: str) -> str:
        ident = self._new_id(kind)
        self.objects[ident] = kind
        self.inside[ident] = receptacle
        return ident


def _goal(task_type: str, obj: str, target: str, tool: tuple | None) -> str:
    """The PDDL goal; `tool` is the task type's TASK_TOOL entry (None when it has none)."""
    if task_type == "look_at_obj_in_light":
        return (f"(and (exists (?ot - object ?r - receptacle ?a - agent ?l - location) (and "
                f"(objectType ?ot {target}Type) (toggleable ?ot) (isToggled ?ot) (receptacleAtLocation ?r ?l) "
                f"(atLocation ?a ?l) (inReceptacle ?ot ?r))) "
                f"(exists (?o - object ?a - agent) (and (objectType ?o {obj}Type) (holds ?a ?o))))")
    if task_type == "pick_two_obj_and_place":
        return (f"(and (exists (?r - receptacle) (exists (?o1 - object) (and (objectType ?o1 {obj}Type) "
                f"(receptacleType ?r {target}Type) (inReceptacle ?o1 ?r) (exists (?o2 - object) (and "
                f"(not (= ?o1 ?o2)) (objectType ?o2 {obj}Type) (receptacleType ?r {target}Type) "
                f"(inReceptacle ?o2 ?r)))))))")
    extra = f"({tool[3]} ?o) ({tool[2]} ?o) " if tool else ""
    return (f"(and (exists (?r - receptacle) (exists (?o - object) (and {extra}(objectType ?o {obj}Type) "
            f"(receptacleType ?r {target}Type) (inReceptacle ?o ?r)))))")


@dataclass
class _Draw:
    """What a game's seed drew: the task, the room and what is in it (see `_draw`)."""
    task_type: str
    tool: tuple[str, str] | None      # (the receptacle kind a clean/heat/cool needs, the verb), or None
    room: str
    scene: _Scene
    rids: list[str]                   # the receptacles' ids, in the order added
    target: str                       # the kind the task's objects go to (or DeskLamp: look at one in its light)
    obj_kind: str                     # the task's object type
    task_objs: list[str]              # the task's objects' ids


def generate_game(options: GeneratorOptions | None = None, seed: int = 0) -> dict:
    """One solvable game as a `game.tw-pddl` dict, with `walkthrough` (the solution), `task_type` and
    `task` (the instruction). Deterministic from (options, seed): its phases draw from one RNG in order (the
    scene, the locations in the PDDL problem, the instruction's template)."""
    options = options or GeneratorOptions.tiny()
    domain, grammar_template, can_hold, props, openable = _package_logic()
    rng = random.Random(stable_seed("alfworld-gen", seed, separator="/", bits=64))
    draw = _draw(options, rng, can_hold, props, openable)
    if draw is None:   # this draw of receptacles supports no such task: draw again from a new seed
        return generate_game(options, stable_seed("retry", seed, separator="/", bits=64))
    problem = _pddl_problem(draw, seed, rng, can_hold, props, openable)
    import alfworld.gen.goal_library as goal_library
    template = rng.choice(goal_library.gdict[draw.task_type]["templates"])
    target = draw.target.lower()
    task = template.format(obj=draw.obj_kind.lower(), recep=target, toggle=target, mrecep="")
    return {
        "pddl_domain": domain,
        "grammar": grammar_template.replace("UNKNOWN GOAL", task),
        "pddl_problem": problem,
        "solvable": True,
        "walkthrough": _walkthrough(draw, openable),
        "task_type": draw.task_type,
        "task": task,
        "generator": {"options": dataclasses.asdict(options), "seed": seed, "room": draw.room},
    }


def _draw(options: GeneratorOptions, rng: random.Random, can_hold: dict, props: dict,
          openable: set) -> _Draw | None:
    """The task type, the room, its receptacles and objects; None when the receptacles drawn support no task
    of the type drawn."""
    task_type = rng.choice(sorted(options.task_types))
    tool = TASK_TOOL.get(task_type)
    rooms = sorted(options.rooms)
    if tool:   # clean/heat/cool happen where a sink/microwave/fridge belongs, when such a room is allowed
        rooms = [r for r in rooms if tool[0] in ROOM_RECEPTACLES[r]] or rooms
    room = rng.choice(rooms)
    n_recep = rng.randint(*options.receptacles)
    n_obj = rng.randint(*options.objects)
    scene = _Scene(rng)

    # Receptacles: what the task needs, then the room's others (a kind may repeat, like "drawer 2").
    pool = [k for k in ROOM_RECEPTACLES[room] if options.openable or k not in openable]
    needed = [tool[0]] if tool else []
    if task_type == "look_at_obj_in_light":
        needed.append(rng.choice([r for r in LAMP_RECEPTACLES if r in pool] or list(LAMP_RECEPTACLES)))
    kinds = list(needed)
    while len(kinds) < max(n_recep, len(needed) + 2):
        kinds.append(rng.choice(pool))
    rids = [scene.add_receptacle(k) for k in kinds]

    # The task's object type and target: an object type the target can hold, that has the tool property,
    # and that some *other* receptacle can hold (where it starts). The tool itself is never the target.
    candidates = []
    for target in sorted({k for k in kinds if k not in NON_TARGETS and not (tool and k == tool[0])}):
        if task_type == "look_at_obj_in_light":
            objs = set().union(*(can_hold.get(k, set()) for k in kinds))
        else:
            objs = set(can_hold.get(target, set()))
        if tool:
            objs &= props[tool[1].capitalize() + "able"]
        for obj in sorted(objs):
            starts = [r for r in rids if obj in can_hold.get(scene.receptacles[r], set())
                      and (task_type == "look_at_obj_in_light" or scene.receptacles[r] != target)]
            if starts:
                candidates.append((target, obj, starts))
    if not candidates:
        return None
    target, obj_kind, starts = rng.choice(candidates)
    if task_type == "look_at_obj_in_light":
        target = "DeskLamp"
        lamp_home = next(r for r in rids if scene.receptacles[r] == needed[0])
        scene.add_object("DeskLamp", lamp_home)

    n_task_objs = 2 if task_type == "pick_two_obj_and_place" else 1
    task_objs = [scene.add_object(obj_kind, rng.choice(starts)) for _ in range(n_task_objs)]
    # Distractors: other movable objects, never of the task's type (keeps the walkthrough the solution
    # a reader expects; the goal would accept any object of the type anyway).
    for _ in range(max(0, n_obj - n_task_objs)):
        rid = rng.choice(rids)
        holdable = sorted(can_hold.get(scene.receptacles[rid], set()) - {obj_kind, "DeskLamp", "FloorLamp"})
        if holdable:
            scene.add_object(rng.choice(holdable), rid)
    return _Draw(task_type, tool, room, scene, rids, target, obj_kind, task_objs)


def _pddl_problem(draw: _Draw, seed: int, rng: random.Random, can_hold: dict, props: dict, openable: set) -> str:
    """The game's PDDL problem: its objects, the facts of the drawn scene (each receptacle at a location
    drawn here), and the task's goal."""
    scene = draw.scene
    # Locations: one per receptacle, plus the agent's start in the middle of the room.
    loc = {rid: f"loc_bar_{i}_bar_{rng.randrange(10)}" for i, rid in enumerate(draw.rids)}
    start = "loc_bar_start"
    facts = [f"(atLocation agent1 {start})"]
    otypes = sorted(set(scene.objects.values()) | set(DOMAIN_OTYPES))
    rtypes = sorted(set(scene.receptacles.values()) | set(DOMAIN_RTYPES))
    for rid, kind in scene.receptacles.items():
        facts += [f"(receptacleType {rid} {kind}Type)", f"(receptacleAtLocation {rid} {loc[rid]})"]
        if kind in openable:
            facts.append(f"(openable {rid})")
    facts += [f"(canContain {rk}Type {ok}Type)" for rk in rtypes for ok in otypes if ok in can_hold.get(rk, set())]
    for oid, kind in scene.objects.items():
        rid = scene.inside[oid]
        facts += [f"(objectType {oid} {kind}Type)", f"(inReceptacle {oid} {rid})",
                  f"(objectAtLocation {oid} {loc[rid]})"]
        if kind in ("DeskLamp", "FloorLamp"):
            facts.append(f"(toggleable {oid})")
            continue
        facts.append(f"(pickupable {oid})")
        facts += [f"({prop.lower()} {oid})" for prop in ("Cleanable", "Heatable", "Coolable") if kind in props[prop]]

    objects = (["agent1 - agent"] + [f"{i} - object" for i in scene.objects]
               + [f"{t}Type - otype" for t in otypes] + [f"{i} - receptacle" for i in scene.receptacles]
               + [f"{t}Type - rtype" for t in rtypes] + [f"{x} - location" for x in [start, *loc.values()]])
    goal = _goal(draw.task_type, draw.obj_kind, draw.target, draw.tool)
    return ("(define (problem gen_%d)\n(:domain alfred)\n(:objects\n  %s\n)\n(:init\n  %s\n)\n(:goal %s)\n)\n"
            % (seed, "\n  ".join(objects), "\n  ".join(facts), goal))


def _walkthrough(draw: _Draw, openable: set) -> list[str]:
    """The solution, in the engine's display names: to each task object, take it, use the tool on it, then put
    it on the target (or use the lamp)."""
    scene, rids = draw.scene, draw.rids
    names = _display_names([*scene.receptacles, *scene.objects])
    steps: list[str] = []
    here: str | None = None
    opened: set[str] = set()

    def visit(rid: str, open_it: bool = True) -> None:
        nonlocal here
        if here != rid:
            steps.append(f"go to {names[rid]}")
            here = rid
        if open_it and scene.receptacles[rid] in openable and rid not in opened:
            steps.append(f"open {names[rid]}")
            opened.add(rid)

    goal_rid = next((r for r in rids if scene.receptacles[r] == draw.target), None)
    for oid in draw.task_objs:
        visit(scene.inside[oid])
        steps.append(f"take {names[oid]} from {names[scene.inside[oid]]}")
        if draw.tool:
            tool_rid = next(r for r in rids if scene.receptacles[r] == draw.tool[0])
            visit(tool_rid, open_it=False)   # heat/cool/clean work on a closed microwave/fridge
            steps.append(f"{draw.tool[1]} {names[oid]} with {names[tool_rid]}")
        if draw.task_type == "look_at_obj_in_light":
            lamp = next(i for i, k in scene.objects.items() if k == "DeskLamp")
            visit(scene.inside[lamp], open_it=False)
            steps.append(f"use {names[lamp]}")
        else:
            visit(goal_rid)
            steps.append(f"move {names[oid]} to {names[goal_rid]}")
    return steps


def game_seed(options: GeneratorOptions, split: str, index: int) -> int:
    """Seed of game `index` of a split: train and eval games never share a seed."""
    return stable_seed("alfworld-gen-set", options.seed, split, index, separator="/", bits=64) % (2 ** 31)


def game_name(game: dict, index: int) -> str:
    """Directory name: <task_type>-<Object>-gen<index>, Object being the type of the problem's last object."""
    problem = game["pddl_problem"]
    kinds = [line.split()[-1][:-5] for line in problem.splitlines() if line.strip().startswith("(objectType")]
    return f"{game['task_type']}-{kinds[-1] if kinds else 'None'}-gen{index:05d}"


def write_games(out_dir: str | os.PathLike, count: int, options: GeneratorOptions | None = None,
                split: str = "train") -> list[str]:
    """Write `count` games as <out_dir>/<split>/<name>/game.tw-pddl; returns the game file paths."""
    options = options or GeneratorOptions.tiny()
    paths = []
    for index in range(count):
        game = generate_game(options, game_seed(options, split, index))
        path = Path(out_dir) / split / game_name(game, index) / "game.tw-pddl"
        write_atomically(path, json.dumps(game))
        paths.append(str(path))
    return paths

