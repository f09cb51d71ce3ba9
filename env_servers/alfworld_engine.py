"""The TextWorld PDDL engine that plays ALFWorld games, upstream or with memoized text generation.

Upstream (`textworld.envs.pddl.PddlEnv`) spends most of a step re-parsing the same grammar templates with
TatSu (every `grammar.derive` parses its start string and every rule condition, and deep-copies symbols and
contexts). The "fast" engine keeps the upstream game logic (fast-downward state, applicable actions, goal
check) and replaces only the text generation with an interpreter of the *same* parsed templates: templates,
conditions and eval expressions are parsed once per process; symbols are never mutated, so nothing is
deep-copied; the PDDL -> SAS translation (run twice per reset) and the parsed game logic are memoized.

The fast engine swaps upstream module attributes while it builds a state, so engines must not run
concurrently in threads of one process (env servers run one request at a time per worker process).
Its output is byte-identical to upstream's (tests/env_servers/test_env_alfworld.py replays walkthroughs both ways).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Mapping
from unittest import mock

from common.config import EnvConfig, choices

ENGINES = choices(EnvConfig, "engine")

try:  # The engine is an optional heavy dependency: import errors become a clear message at use time.
    import fast_downward
    import textworld
    from textworld.envs.pddl import PddlEnv
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.envs.pddl import textgen
    from textworld.logic import Rule
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    _UPSTREAM_PDDL2SAS, _UPSTREAM_GAME_LOGIC = fast_downward.pddl2sas, pddl_logic.GameLogic
    _IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # pragma: no cover - exercised only on machines without the engine
    _IMPORT_ERROR = exc


def require_engine() -> None:
    """Raise a clear ImportError when textworld/alfworld/fast_downward are missing."""
    if _IMPORT_ERROR is not None:
        raise ImportError("the ALFWorld engine is not installed (needs alfworld==0.4.2, textworld[pddl]==1.7.0 "
                          f"with fast_downward): run `make install` ({_IMPORT_ERROR})") from _IMPORT_ERROR


@functools.lru_cache(maxsize=4096)
def _parse_symbols(text: str) -> tuple:
    """Template text -> upstream symbol objects (TerminalSymbol, NonterminalSymbol, ...), parsed once."""
    return tuple(textgen._parse_and_convert(text, rule_name="symbols"))


@functools.lru_cache(maxsize=4096)
def _parse_query(expression: str) -> "Rule":
    return Rule.parse_conjunctive_query(expression)


@functools.lru_cache(maxsize=4096)
def _compile_eval(expression: str):
    return compile(expression, "<string>", "eval")


class FastGrammar:
    """Derives text from the production rules of an upstream ContextSensitiveGrammar.

    Semantics follow upstream exactly: a nonterminal takes the first rule whose condition holds in the
    symbol's context; `{expr | query}` expands `expr` once per assignment of the query (in the state's
    order); `[...]` joins the expansions with #list_separator# / #list_last_separator# (or #list_empty#);
    `{python expr}` is evaluated with the context's variables as locals.
    """

    def __init__(self, grammar: "textgen.ContextSensitiveGrammar"):
        self._rules = grammar._rules
        self._globals = vars(textgen)   # upstream evaluates expressions in textgen's module globals

    def _pick_rule(self, name: str, ctx: dict) -> tuple:
        rules = self._rules.get(name)
        if not rules:
            raise textgen.CSGUnknownSymbolError(name)
        for rule in rules:
            if not rule.condition or any(True for _ in ctx["state"].all_assignments(_parse_query(rule.condition),
                                                                                     ctx["mapping"])):
                return rule.rhs
        # Upstream indexes the filtered list and fails with IndexError when no rule applies.
        raise IndexError(f"no applicable production rule for #{name}#")

    @staticmethod
    def _expand_conditional(symbol, ctx: dict) -> list[tuple[Any, dict]]:
        """(symbol.expression, context) for each assignment of the symbol's query (the context as it is when
        it has none)."""
        if not symbol.given:
            return [(symbol.expression, ctx)]
        items = []
        infos = ctx["entity_infos"]
        for mapping in ctx["state"].all_assignments(_parse_query(symbol.given), ctx["mapping"]):
            variables = dict(ctx["variables"])
            variables.update({ph.name: infos[var.name] for ph, var in mapping.items()})
            new_mapping = dict(ctx["mapping"])
            new_mapping.update(mapping)
            items.append((symbol.expression, {"state": ctx["state"], "facts": ctx["facts"], "variables": variables,
                                              "mapping": new_mapping, "entity_infos": infos}))
        return items

    def derive(self, start: str, context: Mapping = {}) -> str:
        ctx = {"state": context["state"], "facts": context["facts"], "variables": dict(context["variables"]),
               "mapping": dict(context["mapping"]), "entity_infos": context["entity_infos"]}
        T, N = textgen.TerminalSymbol, textgen.NonterminalSymbol
        C, E, L = textgen.ConditionalSymbol, textgen.EvalSymbol, textgen.ListSymbol
        stack = [(s, ctx) for s in reversed(_parse_symbols(start))]
        out: list[str] = []
        while stack:
            symbol, ctx = stack.pop()
            kind = type(symbol)
            if kind is T:
                out.append(str(symbol.symbol))
            elif kind is N:
                stack.extend((s, ctx) for s in reversed(self._pick_rule(str(symbol.symbol), ctx)))
            elif kind is C:
                stack.extend(reversed(self._expand_conditional(symbol, ctx)))
            elif kind is E:
                local_vars = dict(ctx["variables"])
                local_vars["context"] = ctx   # upstream's eval frame also sees `context` (and `self`)
                value = eval(_compile_eval(symbol.expression), self._globals, local_vars)
                out.append(str(value))
            elif kind is L:
                items = self._expand_conditional(symbol.symbol, ctx)
                if not items:
                    stack.append((N("list_empty"), ctx))
                    continue
                seq = [items[0]]
                for i, item in enumerate(items[1:], 2):
                    seq += [(N("list_last_separator" if i == len(items) else "list_separator"), ctx), item]
                stack.extend(reversed(seq))
            else:
                raise NotImplementedError(f"unknown symbol {symbol!r}")
        return "".join(out)


# Bounded: a real game's two translations and parsed logic take ~3 MB; a worker serves a few games at once.
@functools.lru_cache(maxsize=32)
def _game_logic(domain: str, grammar: str):
    """Parsed GameLogic per (domain, grammar), with its grammar served by FastGrammar. Shared by every
    instance in the process: the fast interpreter never mutates it."""
    logic = _UPSTREAM_GAME_LOGIC(domain=domain, grammar=grammar)
    logic.grammar = FastGrammar(logic.grammar)
    return logic


@functools.lru_cache(maxsize=64)
def _memo_pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
    """fast_downward.pddl2sas, memoized (the translation is deterministic; PddlState only reads the task)."""
    return _UPSTREAM_PDDL2SAS(domain, problem, verbose=verbose, optimize=optimize)


_SWAP_LOCK = threading.RLock()


@contextlib.contextmanager
def _memoized():
    """Upstream's GameLogic and fast_downward.pddl2sas replaced by the memos for the duration of the block
    (under a lock), so that upstream engines in the same process keep their own behaviour outside it."""
    with _SWAP_LOCK, mock.patch.object(pddl_logic, "GameLogic", _game_logic), \
            mock.patch.object(fast_downward, "pddl2sas", _memo_pddl2sas):
        yield


if _IMPORT_ERROR is None:

    class FastPddlEnv(PddlEnv):
        """PddlEnv with memoized logic parsing, SAS translation and text generation: upstream's own load and
        reset (game dynamics, the admissible-command list and the goal check are upstream's code), run
        with the memos in place."""

        def load(self, filename_or_data) -> None:
            with _memoized():
                super().load(filename_or_data)

        def reset(self):
            with _memoized():
                return super().reset()


def make_engine(engine: str = EnvConfig.engine):
    """A TextWorld env for ALFWorld games: the PDDL engine wrapped by ALFWorld's name demangler (which
    turns `Mug_bar__minus_02...` into `mug 1`). `engine`: env.engine, "fast" or "upstream"."""
    if engine not in ENGINES:
        raise ValueError(f"unknown ALFWorld engine {engine!r}; choose one of {ENGINES}")
    require_engine()
    infos = textworld.EnvInfos(won=True, admissible_commands=True)
    base = FastPddlEnv(infos) if engine == "fast" else PddlEnv(infos)
    return AlfredDemangler(base, shuffle=False)
