"""Prompts and action parsing of the rollout plane (GiGPO reference defaults).

Each step's prompt is rebuilt from scratch (no growing chat): a role line, the task, the last K
(observation, action) pairs, the current observation, the admissible actions and the instruction to think
inside <think> </think> and answer with one action inside <action> </action>; then the model's chat template.

Parsing follows the reference: the response is lower-cased, the action is the text between the first
<action> and the first </action> after it; the response is *valid* only if both action tags and both think
tags are present and it contains no CJK characters. An invalid response still drives the environment: the
env gets the raw tail of the response (its last 30 characters), which it normally answers with
"Nothing happens."; the -0.1 penalty is applied by the learner from `StepRow.valid`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# The role line per environment; anything else gets the generic one.
ROLE_LINES = {
    "alfworld": "You are an expert agent operating in the ALFRED Embodied Environment.",
    "webshop": "You are an expert autonomous agent operating in the WebShop e-commerce platform.",
}
GENERIC_ROLE = "You are an expert agent operating in a text environment."

INSTRUCTION = (
    "Now it's your turn to take an action. You should first reason step-by-step about the current "
    "situation. This reasoning process MUST be enclosed within <think> </think> tags. Once you've finished "
    "your reasoning, you should choose an admissible action for current step and present it within "
    "<action> </action> tags."
)

RAW_TAIL_CHARS = 30            # what an unparseable response sends to the env (reference: last 30 chars)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")


@dataclass
class ParsedAction:
    action: str        # what goes to the environment
    valid: bool        # well-formed: both think tags, both action tags, no CJK


def parse_action(response: str) -> ParsedAction:
    """Extract the action of a model response (see the module doc for the rules)."""
    text = response.lower()
    start = text.find("<action>")
    end = text.find("</action>", start + len("<action>")) if start != -1 else -1
    if start == -1 or end == -1:
        return ParsedAction(action=text[-RAW_TAIL_CHARS:].strip(), valid=False)
    action = text[start + len("<action>"):end].strip()
    think_ok = "<think>" in text and "</think>" in text
    valid = think_ok and not _CJK.search(response) and bool(action)
    return ParsedAction(action=action if action else text[-RAW_TAIL_CHARS:].strip(), valid=valid)


def format_admissible(actions: list[str]) -> str:
    # ALFWorld's "help" is an engine command, not a move: the reference hides it from the agent.
    return ", ".join(f"'{a}'" for a in actions if a != "help")


def build_user_message(env_name: str, task: str, observation: str, admissible: list[str],
                       history: list[tuple[str, str]], step: int, history_length: int = 2) -> str:
    """The user message of step `step` (0-based). `history`: all earlier (observation, action) pairs of
    this trajectory, oldest first; only the last `history_length` are shown."""
    parts = [ROLE_LINES.get(env_name, GENERIC_ROLE)]
    if task:
        parts.append(f"Your task is to: {task.strip()}")
    shown = history[-history_length:] if history_length > 0 else []
    if shown:
        first = step - len(shown) + 1
        pairs = " ".join(f"[Observation {first + i}: '{obs.strip()}', Action {first + i}: '{act}']"
                         for i, (obs, act) in enumerate(shown))
        parts.append(f"Prior to this step, you have already taken {step} step(s). Below are the most "
                     f"recent {len(shown)} observations and the corresponding actions you took: {pairs}")
    parts.append(f"You are now at step {step + 1} and your current observation is: {observation.strip()}")
    parts.append(f"Your admissible actions of the current situation are: [{format_admissible(admissible)}].")
    parts.append(INSTRUCTION)
    return "\n".join(parts)


def prompt_ids(tokenizer, user_message: str) -> list[int]:
    """Chat-template the message (one user turn + the assistant header) and tokenize it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_message}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


# The characters that are operators in a regex outside a character class. Only these get a backslash:
# re.escape also escapes spaces, '-', '#', '&' and '~', and vLLM's structured-output backend (xgrammar)
# warns once per request about every such unneeded escape ("Escape sequence '\ ' is not recognized").
_REGEX_OPERATORS = frozenset("\\^$.*+?()[]{}|")


def regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it, in the syntax Python's re and xgrammar share."""
    return "".join("\\" + c if c in _REGEX_OPERATORS else c for c in text)


# A free-text slot in an admissible action: WebShop lists "search[<your query>]", whose query the agent
# writes. Constrained generation fixes the slot's shape, never its words: lower-case letters, digits,
# spaces and the punctuation of product text (no brackets, which end the action, and no < or >, which
# would start a tag), starting with a letter or digit, at most FREE_TEXT_MAX_CHARS characters.
FREE_TEXT_SLOT = "<your query>"
FREE_TEXT_CHARS = "a-z0-9 ,.:'&-"
FREE_TEXT_MAX_CHARS = 160
_FREE_TEXT = rf"[a-z0-9][{FREE_TEXT_CHARS}]{{0,{FREE_TEXT_MAX_CHARS - 1}}}"


def _action_pattern(action: str) -> str:
    """The regex of one admissible action: the action itself, its free-text slot (if any) as _FREE_TEXT."""
    if FREE_TEXT_SLOT not in action:
        return regex_literal(action)
    return _FREE_TEXT.join(regex_literal(piece) for piece in action.split(FREE_TEXT_SLOT))


def is_admissible(action: str, admissible: list[str]) -> bool:
    """Whether constrained generation could produce `action` for this admissible list: one of the listed
    actions, or one with its free-text slot filled in the allowed shape."""
    return any(a == action or (FREE_TEXT_SLOT in a and re.fullmatch(_action_pattern(a), action))
               for a in admissible if a != "help")


def action_regex(admissible: list[str], max_think_chars: int = 200) -> str:
    """For `rollout.constrain_actions`: a short free-text think section, then exactly one admissible
    action (a free-text slot filled in its shape, see FREE_TEXT_SLOT); the format tags stay, so parsing and
    validity work unchanged.

    `max_think_chars` is sized by the caller so that the longest listed action fits the response budget;
    a free-text slot can be longer than its placeholder, and the think section gives up the difference."""
    actions = [a for a in admissible if a != "help"]
    choices = "|".join(_action_pattern(a) for a in actions) or "look"
    slot_growth = max((FREE_TEXT_MAX_CHARS - len(FREE_TEXT_SLOT) for a in actions if FREE_TEXT_SLOT in a),
                      default=0)
    think = max(0, max_think_chars - slot_growth)
    # Printable ASCII except < and >: no stray tags, and no CJK (which would make the response invalid).
    return rf"<think>[ -;=?-~]{{0,{think}}}</think> <action>({choices})</action>"
