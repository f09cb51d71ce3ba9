"""What every environment's prompt shares: the step prompt, the response format and its parsing, and the
grammar of a constrained response. Per environment (`alfworld.py`, `webshop.py`): the role line and the
rules of its action list (actions hidden from the agent, free-text slots). An action list is read with every
environment's rules at once: they never meet (only ALFWorld lists "help", only WebShop has a free-text slot).

Each step's prompt is rebuilt from scratch (the reference's defaults, no growing chat): a role line, the task,
the last K (observation, action) pairs, the observation, the admissible actions and the instruction to think
inside <think> </think> and answer inside <action> </action>; then the model's chat template.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from actors.prompts import alfworld, webshop

# The role line per environment; anything else gets the generic one.
ROLE_LINES = {"alfworld": alfworld.ROLE_LINE, "webshop": webshop.ROLE_LINE}
GENERIC_ROLE = "You are an expert agent operating in a text environment."

INSTRUCTION = (
    "Now it's your turn to take an action. You should first reason step-by-step about the current "
    "situation. This reasoning process MUST be enclosed within <think> </think> tags. Once you've finished "
    "your reasoning, you should choose an admissible action for current step and present it within "
    "<action> </action> tags."
)

RAW_TAIL_CHARS = 30            # what an unparseable response sends to the env (reference: last 30 chars)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")

# -- the prompt of a step -----------------------------------------------------------------------------------


def shown_actions(admissible: list[str]) -> list[str]:
    """The admissible actions the agent sees and may choose."""
    return [a for a in admissible if a not in alfworld.HIDDEN_ACTIONS]


def format_admissible(actions: list[str]) -> str:
    return ", ".join(f"'{a}'" for a in shown_actions(actions))


def build_user_message(env_name: str, task: str, observation: str, admissible: list[str],
                       history: list[tuple[str, str]], step: int, history_length: int) -> str:
    """The user message of step `step` (0-based). `history`: all earlier (observation, action) pairs of
    this trajectory, oldest first; only the last `history_length` (rollout.history_length) are shown."""
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


_MESSAGE_SLOT = "\x00gigpo-user-message\x00"      # where the message goes in the rendered template


def prompt_token_ids(tokenizer, user_message: str) -> list[int]:
    """Chat-template the message (one user turn + the assistant header) and tokenize it. The message is
    environment text and history: a special token's text in it (a web page holding `<|im_end|>`) stays text,
    never the control token that would end the user's turn; the template's own are the prompt's only ones."""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    if not any(special in user_message for special in specials):     # (every ordinary prompt: one encode)
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_message}],
                                             add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MESSAGE_SLOT}],
                                         add_generation_prompt=True, tokenize=False)
    head, tail = text.split(_MESSAGE_SLOT)
    return [*tokenizer.encode(head, add_special_tokens=False),
            *tokenizer.encode(user_message, add_special_tokens=False, split_special_tokens=True),
            *tokenizer.encode(tail, add_special_tokens=False)]


# -- the action in a response -------------------------------------------------------------------------------


@dataclass
class ParsedAction:
    action: str        # what goes to the environment
    valid: bool        # well-formed: both think tags, both action tags, no CJK


def parse_action(response: str) -> ParsedAction:
    """The action of a model response, as the reference parses it: lower-cased, the text between the first
    <action> and the first </action> after it; valid only with both action tags, both think tags and no CJK.
    An invalid response still drives the env with its last RAW_TAIL_CHARS characters (which the env normally
    answers with "Nothing happens."); the learner applies the penalty from `StepRow.valid`."""
    text = response.lower()
    found = re.search(r"<action>(.*?)</action>", text, re.DOTALL)
    action = found.group(1).strip() if found else ""
    valid = bool(action) and "<think>" in text and "</think>" in text and not _CJK.search(response)
    return ParsedAction(action=action or text[-RAW_TAIL_CHARS:].strip(), valid=valid)


def response_text(action: str) -> str:
    """The response constrained generation yields for `action` with an empty think section."""
    return f"<think></think> <action>{action}</action>"


# -- the grammar of a constrained response (rollout.constrain_actions) -----------------------------------

# The characters that are operators in a regex outside a character class. Only these get a backslash:
# re.escape also escapes spaces, '-', '#', '&' and '~', and vLLM's structured-output backend (xgrammar)
# warns once per request about every such unneeded escape ("Escape sequence '\ ' is not recognized").
_REGEX_OPERATORS = frozenset("\\^$.*+?()[]{}|")

MAX_THINK_CHARS = 200          # the longest think section a constrained response may write


def regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it, in the syntax Python's re and xgrammar share."""
    return "".join("\\" + c if c in _REGEX_OPERATORS else c for c in text)


def _action_pattern(action: str) -> str:
    """The regex of one admissible action: the action itself, its free-text slot (if any) in its shape."""
    if webshop.FREE_TEXT_SLOT not in action:
        return regex_literal(action)
    return webshop.FREE_TEXT.join(regex_literal(piece) for piece in action.split(webshop.FREE_TEXT_SLOT))


def is_admissible(action: str, admissible: list[str]) -> bool:
    """Whether constrained generation could produce `action` for this admissible list: one of the listed
    actions, or one with its free-text slot filled in the allowed shape."""
    return any(a == action or (webshop.FREE_TEXT_SLOT in a and re.fullmatch(_action_pattern(a), action))
               for a in shown_actions(admissible))


def action_regex(admissible: list[str], max_think_chars: int = MAX_THINK_CHARS) -> str:
    """A short free-text think section, then exactly one admissible action (a free-text slot filled in its
    shape); the format tags stay, so parsing and validity work unchanged. `max_think_chars`: see think_chars;
    a free-text slot can be longer than its placeholder, and the think section gives up the difference."""
    actions = shown_actions(admissible)
    choices = "|".join(_action_pattern(a) for a in actions) or "look"
    slot_growth = max((webshop.FREE_TEXT_MAX_CHARS - len(webshop.FREE_TEXT_SLOT)
                       for a in actions if webshop.FREE_TEXT_SLOT in a), default=0)
    think = max(0, max_think_chars - slot_growth)
    # Printable ASCII except < and >: no stray tags, and no CJK (which would make the response invalid).
    return rf"<think>[ -;=?-~]{{0,{think}}}</think> <action>({choices})</action>"


def think_chars(admissible: list[str], max_response_tokens: int) -> int:
    """action_regex's think budget: the grammar constrains characters, not tokens, and a token is >= 1
    character, so even a one-character-per-token answer must end within max_response_tokens."""
    fixed = len(response_text("")) + max(map(len, admissible))
    return max(0, min(MAX_THINK_CHARS, max_response_tokens - fixed))


def response_regex(admissible: list[str], max_response_tokens: int) -> str:
    """The regex a constrained step samples under: action_regex with the think budget the response has."""
    return action_regex(admissible, think_chars(admissible, max_response_tokens))
