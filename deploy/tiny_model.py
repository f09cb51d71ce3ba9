"""A tiny local policy for tests and CPU runs: random Qwen2 weights + a byte-level BPE trained on env text.

    path = build_tiny_model("runs/tiny")        # -> "runs/tiny", loadable by transformers and vLLM

Qwen2, so the code paths (vLLM model class, weight names, chat template) of the real Qwen2.5 policies serve
it; head_dim 64 because vLLM's CPU attention rejects smaller heads. A 1,024-token vocabulary trained on
env-style text keeps generation fast (151k makes a tiny model ~20x slower on CPU). The tag tokens are single
ordinary tokens: they survive `skip_special_tokens` decoding. Offline; a build with the same parameters and
corpus is reused, and a half-written one is never visible (tmp dir + rename).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

# The chat-format tokens (Qwen's names); the tag tokens of the reference's prompt format.
IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TAG_TOKENS = ["<think>", "</think>", "<action>", "</action>"]
# Qwen2's pre-tokenization split (contractions, letter runs, single digits, punctuation, whitespace).
QWEN_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen-style chat template: <|im_start|>role\ncontent<|im_end|>\n ... then the assistant header.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

BUILD_INFO = "tiny_build.json"
_BUILD_FORMAT = 2   # bump when the builder changes what it writes

_ROOMS = ["kitchen", "bathroom", "bedroom", "living room", "office", "dining room", "garage", "hallway"]
_RECEPTACLES = ["countertop", "cabinet", "drawer", "fridge", "microwave", "sinkbasin", "stoveburner",
                "shelf", "diningtable", "sidetable", "dresser", "bed", "sofa", "armchair", "desk",
                "garbagecan", "toilet", "bathtubbasin", "coffeemachine", "safe", "laundryhamper"]
_OBJECTS = ["apple", "mug", "cup", "plate", "bowl", "knife", "fork", "spoon", "egg", "potato", "tomato",
            "lettuce", "bread", "pan", "pot", "kettle", "book", "pen", "pencil", "cellphone", "keychain",
            "creditcard", "remotecontrol", "pillow", "cloth", "soapbar", "towel", "candle", "vase",
            "statue", "watch", "laptop", "desklamp", "alarmclock", "newspaper", "box", "spraybottle"]
_TASKS = [
    "put a {o} in {r}.", "put some {o} on {r}.", "clean some {o} and put it in {r}.",
    "heat some {o} and put it in {r}.", "cool some {o} and put it in {r}.",
    "look at {o} under the desklamp.", "put two {o} in {r}.", "find two {o} and put them in {r}.",
]
_SHOP_WORDS = ["men", "women", "shoes", "shirt", "dress", "jacket", "size", "color", "black", "white",
               "blue", "red", "small", "medium", "large", "x-large", "pack", "ounce", "price", "lower",
               "than", "dollars", "organic", "gluten free", "wireless", "bluetooth", "headphones",
               "long lasting", "easy to clean", "machine wash", "cotton", "leather", "water resistant"]
_PROMPT_TEXT = [
    "You are an expert agent operating in the ALFRED Embodied Environment.",
    "You are an expert autonomous agent operating in the WebShop e-commerce platform.",
    "Your task is to: ",
    "Prior to this step, you have already taken {n} step(s). Below are the most recent {k} observations "
    "and the corresponding actions you took: ",
    "[Observation 1: 'You arrive at countertop 1.', Action 1: 'go to countertop 1']",
    "You are now at step {n} and your current observation is: ",
    "Your admissible actions of the current situation are: [",
    "Now it's your turn to take an action. You should first reason step-by-step about the current "
    "situation. This reasoning process MUST be enclosed within <think> </think> tags. Once you've finished "
    "your reasoning, you should choose an admissible action for current step and present it within "
    "<action> </action> tags.",
    "<think> I need to find the object first, then go to the receptacle. </think> <action> go to cabinet 1 "
    "</action>",
    "Nothing happens.", "You won!", "Thank you for shopping with us!",
    "search[", "click[", "buy now", "next >", "< prev", "back to search", "description", "features",
]


def builtin_corpus(seed: int = 0, size: int = 3000) -> list[str]:
    """ALFWorld/WebShop-like sentences, admissible-action strings and the prompt template's words."""
    rng = random.Random(seed)
    lines: list[str] = list(_PROMPT_TEXT) * 20
    for _ in range(size):
        room = rng.choice(_ROOMS)
        recs = [f"{rng.choice(_RECEPTACLES)} {rng.randint(1, 6)}" for _ in range(rng.randint(3, 8))]
        objs = [f"{rng.choice(_OBJECTS)} {rng.randint(1, 3)}" for _ in range(rng.randint(1, 4))]
        r, o = rng.choice(recs), rng.choice(objs)
        lines.append(f"-= Welcome to TextWorld, ALFRED! =- You are in the middle of a {room}. Looking "
                     f"quickly around you, you see a {', a '.join(recs)}.")
        lines.append("Your task is to: " + rng.choice(_TASKS).format(o=o.split()[0], r=r.split()[0]))
        lines.append(f"You arrive at {r}. On the {r}, you see a {', a '.join(objs)}.")
        lines.append(f"You arrive at {r}. The {r} is closed.")
        lines.append(f"You open the {r}. The {r} is open. In it, you see a {', and a '.join(objs)}.")
        lines.append(f"You pick up the {o} from the {r}.")
        lines.append(f"You put the {o} in/on the {r}.")
        actions = [f"go to {x}" for x in recs] + [f"take {o} from {r}", f"put {o} in/on {r}",
                                                  f"open {r}", f"close {r}", f"examine {r}",
                                                  f"heat {o} with microwave 1", f"cool {o} with fridge 1",
                                                  f"clean {o} with sinkbasin 1", "use desklamp 1",
                                                  "look", "inventory"]
        rng.shuffle(actions)
        lines.append(", ".join(f"'{a}'" for a in actions) + "]")
        lines.append(f"<think> I should {rng.choice(actions)} to find the {o}. </think> "
                     f"<action> {rng.choice(actions)} </action>")
        words = rng.sample(_SHOP_WORDS, 5)
        lines.append(f"search[{' '.join(words[:3])}]")
        lines.append(f"i need {' '.join(words)}, and price lower than {rng.randint(1, 99) * 10}.00 dollars")
        lines.append(f"click[b0{rng.randint(10000000, 99999999)}] click[{words[0]}] click[buy now]")
        lines.append(f"Instruction: [SEP] {' '.join(words)} [SEP] Back to Search [SEP] Page 1 (Total results: "
                     f"50) [SEP] Next > [SEP] ${rng.randint(1, 99)}.{rng.randint(10, 99)}")
    return lines


def _train_tokenizer(lines: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [END_OF_TEXT, IM_START, IM_END]
    tok = Tokenizer(models.BPE())
    # Exactly the normalizer and pre-tokenizer transformers' Qwen2Tokenizer installs when it loads a
    # qwen2 model's tokenizer (AutoTokenizer, and so vLLM, do that): training with the same split makes
    # every loader produce the same ids.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # The tag tokens are added after training (as ordinary added tokens), so leave room for them.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TAG_TOKENS), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=END_OF_TEXT,
                                   bos_token=None, unk_token=None, model_max_length=32768)
    fast.add_tokens(TAG_TOKENS)          # ordinary tokens: kept when decoding with skip_special_tokens
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_model_atomically(model, tokenizer, out: Path, info_name: str, info: dict) -> None:
    """save_pretrained into a temporary sibling directory, then rename it to `out`: a reader never sees a
    half-written model. `info` is written as `info_name` beside the weights (what the build was from)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)         # mkdtemp's 0700 would hide the model from other users of a shared machine
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / info_name).write_text(json.dumps(info, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_tiny_model(out_dir: str, corpus: list[str] | None = None, *, vocab_size: int = 1024,
                     hidden_size: int = 128, num_layers: int = 2, num_heads: int = 2, seed: int = 0) -> str:
    """Build (or reuse) a random Qwen2 policy with an env-text tokenizer in `out_dir`; returns `out_dir`.

    `corpus`: extra lines (e.g. observations of the env in use) the tokenizer is trained on besides the
    built-in ALFWorld/WebShop-like text. The model's vocabulary equals the tokenizer's (<= vocab_size).
    """
    if hidden_size % num_heads or hidden_size // num_heads != 64:
        raise ValueError(f"hidden_size / num_heads must be 64 (vLLM CPU needs head_dim 64); got "
                         f"{hidden_size} / {num_heads}")
    if vocab_size < 300:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE (needs >= 300)")
    out = Path(out_dir)
    info = {"format": _BUILD_FORMAT, "vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers,
            "num_heads": num_heads, "seed": seed,
            "corpus": hashlib.sha256("\n".join(corpus or []).encode()).hexdigest()[:16]}
    info_path = out / BUILD_INFO
    if info_path.exists():
        try:
            if json.loads(info_path.read_text()) == info:
                return str(out)
        except (OSError, json.JSONDecodeError):
            pass
        # A different (or broken) build lives there: replace it below.

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tokenizer(builtin_corpus(seed) + list(corpus or []), vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
        # Wider than HF's 0.02 so that the random policy's next-token distribution is not flat: greedy
        # decoding then has clear margins and vLLM vs transformers comparisons are stable.
        initializer_range=0.05,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT), dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)

    try:
        save_model_atomically(model, tokenizer, out, BUILD_INFO, info)
    except BaseException:
        if out.exists() and (out / BUILD_INFO).exists():
            return str(out)      # a concurrent builder won the race; its build is complete
        raise
    return str(out)

