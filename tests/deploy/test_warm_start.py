"""The supervised warm start: rows built from real generated ALFWorld games look like rollout rows, the
fine-tune lowers the loss, and the warmed model is cached under the run's output dir."""
import re
from pathlib import Path

import pytest

from actors.prompts.shared import action_regex, parse_action
from common.config import load_config
from common.run_dir import WARM_DIR
from deploy.warm_start import collect_examples, row_code_fingerprint, warm_start

pytestmark = [pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def _cfg(out: Path, **model):
    overrides = [f"run.output_dir={out}", "env.num_generated_games=4", "model.warm_start_games=3"]
    overrides += [f"model.{k}={v}" for k, v in model.items()]
    return load_config(REPO / "configs" / "embedded.yaml", overrides)


def test_rows_are_what_constrained_rollouts_produce(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = _cfg(tmp_path)
    examples, counts = collect_examples(cfg, tok)
    assert counts["games"] == 3 and counts["games_skipped"] == 0
    assert len(examples) >= 3 * 4        # pick-and-place walkthroughs: go, take, go, move
    first = tok.decode(examples[0].prompt_ids)
    assert "You are now at step 1" in first and "Your admissible actions" in first
    assert first.endswith("<|im_start|>assistant\n")
    for e in examples:
        assert e.response_ids[-1] == tok.eos_token_id      # vLLM stops on end-of-turn after the regex
        text = tok.decode(e.response_ids[:-1])
        parsed = parse_action(text)
        assert parsed.valid
        # The response is one the action regex admits, for the admissible list shown in the prompt.
        shown = re.search(r"admissible actions of the current situation are: \[(.*)\]\.",
                          tok.decode(e.prompt_ids)).group(1)
        admissible = re.findall(r"'([^']*)'", shown)
        assert parsed.action in admissible
        assert re.fullmatch(action_regex(admissible, 8), text)


def test_warm_start_learns_and_is_cached(tmp_path, tiny_model_path):
    cfg = _cfg(tmp_path, warm_start_steps=0)
    assert warm_start(cfg, tiny_model_path) == tiny_model_path           # disabled: the initial model itself

    cfg = _cfg(tmp_path, warm_start_steps=6, warm_start_batch=4, warm_start_lr=3e-3)
    out = warm_start(cfg, tiny_model_path)
    assert Path(out) == tmp_path / WARM_DIR
    import json
    record = json.loads((Path(out) / "warm_start.json").read_text())
    assert record["loss_last"] < record["loss_first"]
    assert record["settings"]["row_code"] == row_code_fingerprint("alfworld")     # part of what must match
    stamp = (Path(out) / "model.safetensors").stat().st_mtime_ns
    assert warm_start(cfg, tiny_model_path) == out                   # same settings: reused, not retrained
    assert (Path(out) / "model.safetensors").stat().st_mtime_ns == stamp
    cfg.model.warm_start_steps = 7                              # other settings: rebuilt
    warm_start(cfg, tiny_model_path)
    settings = json.loads((Path(out) / "warm_start.json").read_text())["settings"]
    # A constant rate names no decay, so warm models cached before the setting existed stay valid.
    assert settings["steps"] == 7 and "lr_decay" not in settings
    cfg.model.warm_start_lr_decay = 0.5                         # a decayed rate: another model, rebuilt
    warm_start(cfg, tiny_model_path)
    assert json.loads((Path(out) / "warm_start.json").read_text())["settings"]["lr_decay"] == 0.5

    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out)                   # loadable like any HF model


def test_a_warm_start_of_the_last_layers_leaves_the_others_as_loaded(tmp_path, tiny_model_path):
    """model.warm_start_trainable_layers: only the last blocks and the final norm move; the embeddings and
    the first block are the initial model's, bit for bit. Asking for more blocks than the model has is a
    clear error naming the setting."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tmp_path, warm_start_steps=3, warm_start_batch=4, warm_start_lr=3e-3, warm_start_trainable_layers=1)
    out = warm_start(cfg, tiny_model_path)
    before = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all(name.startswith(("model.layers.1.", "model.norm.")) for name in moved), sorted(moved)

    cfg.model.warm_start_trainable_layers = 3                       # the tiny model has 2 blocks
    with pytest.raises(ValueError, match="model.warm_start_trainable_layers=3 but the model has 2 layers"):
        warm_start(cfg, tiny_model_path)


def test_a_change_to_the_code_that_renders_rows_rebuilds_the_warm_model(tmp_path):
    """The cache key follows the source of the prompts and of the env's pages, and nothing else: a warm model
    trained on pages of an older text (say, before WebShop marked a chosen option) is not reused."""
    import shutil

    for part in ("actors/prompts", "env_servers/webshop"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__", "sample"))
    shutil.copy(REPO / "env_servers" / "alfworld_gen.py", tmp_path / "env_servers")
    before = {env: row_code_fingerprint(env, tmp_path) for env in ("alfworld", "webshop")}
    assert before["alfworld"] != before["webshop"]

    engine = tmp_path / "env_servers" / "webshop" / "engine.py"
    engine.write_text(engine.read_text().replace("(chosen)", "(selected)"))
    assert row_code_fingerprint("webshop", tmp_path) != before["webshop"]        # WebShop's pages changed
    assert row_code_fingerprint("alfworld", tmp_path) == before["alfworld"]      # ALFWorld's did not
    (tmp_path / "actors" / "prompts" / "shared.py").write_text("# another prompt layout\n")
    assert row_code_fingerprint("alfworld", tmp_path) != before["alfworld"]      # both envs' prompts changed
    (tmp_path / "env_servers" / "server.py").write_text("# not row text\n")
    after = row_code_fingerprint("alfworld", tmp_path)
    (tmp_path / "env_servers" / "server.py").write_text("# still not row text\n")
    assert row_code_fingerprint("alfworld", tmp_path) == after                  # other code: the same key
    assert row_code_fingerprint("webshop") == row_code_fingerprint("webshop", REPO)   # the default: this source


def test_bad_settings_are_clear_errors(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="warm_start_games"):     # the config refuses it at load ...
        _cfg(tmp_path, warm_start_steps=3, warm_start_games=0)
    cfg = _cfg(tmp_path, warm_start_steps=3)
    cfg.model.warm_start_games = 0                                # ... and so does the warm start itself
    with pytest.raises(ValueError, match="warm_start_games"):
        warm_start(cfg, tiny_model_path)


def test_no_warm_start_game_is_held_out(tmp_path, tiny_model_path, monkeypatch):
    """The warm start refuses to learn the solutions of games the evaluation plays (here: the eval split as
    the training split too), for ALFWorld and for WebShop's goals."""
    from env_servers.webshop.data import SAMPLE_DIR

    cfg = _cfg(tmp_path, warm_start_steps=3)
    cfg.env.train_split = cfg.env.eval_split
    with pytest.raises(ValueError, match="in the held-out split"):
        collect_examples(cfg, None)
    monkeypatch.setenv("WEBSHOP_DATA", SAMPLE_DIR)
    cfg = load_config(REPO / "configs" / "webshop-embedded.yaml", [f"run.output_dir={tmp_path}",
                                                                     "env.train_split=all"])
    with pytest.raises(ValueError, match="in the held-out split"):
        collect_examples(cfg, None)


def test_the_learning_rate_falls_linearly_over_the_last_share_of_steps():
    from learner.supervised import warm_start_lr
    assert [warm_start_lr(s, 10, 2.0, 0.3) for s in range(10)] == [2.0] * 7 + [2.0, 2.0 * 2 / 3, 2.0 / 3]
    assert [warm_start_lr(s, 10, 2.0, 0.0) for s in range(10)] == [2.0] * 10      # the default: constant
    assert [warm_start_lr(s, 4, 2.0, 1.0) for s in range(4)] == [2.0, 1.5, 1.0, 0.5]


def test_finetune_steps_with_the_decayed_learning_rate(tiny_model_path, warm_start_with_sgd):
    """With plain SGD (a step's weight change is lr x the gradient) two steps from the same start and data:
    the first is the same with and without decay; over a decay of the whole run (2 steps: lr, then lr / 2) the
    second moves the weights half as far. Tolerance: the weight changes are differences of float32 weights
    (eps 1.2e-7 relative), so they agree to a few eps of the largest weight."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.supervised import Example, finetune

    rng = torch.Generator().manual_seed(0)
    rows = [Example(ids[:-8], ids[-8:]) for ids in
            (torch.randint(0, 1000, (n,), generator=rng).tolist() for n in (40, 60, 50, 70))]

    def weights_after(steps: int, lr_decay: float) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        finetune(model, rows, steps, 0.5, 2, seed=0, micro_batch_tokens=4096, lr_decay=lr_decay)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    first = weights_after(1, 0.0)
    constant, decayed = weights_after(2, 0.0) - first, weights_after(2, 1.0) - first
    assert weights_after(1, 1.0).equal(first) and constant.abs().max() > 0
    assert torch.allclose(decayed, constant / 2, rtol=0, atol=4e-7 * float(first.abs().max()))
