"""The trajectory viewer: the learner's record of each update's groups (learner/group_record.py) holds the
advantages build_batch trained with and the anchor groups of learner.gigpo, and `gigpo view` turns it into a
static page whose step cells carry them (checked with html.parser, and in headless Chromium when there)."""
from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser

import numpy as np
import pytest

from common.config import ExperimentConfig, LearnerConfig
from common.run_dir import GROUPS_FILE
from common.stream.records import EpisodeGroup, StepRow, Termination, Trajectory
from deploy import cli
from learner.batching import build_batch
from learner.group_record import MAX_TEXT_CHARS, GroupRecorder, cut, group_record
from tests.support.synthetic import synthetic_groups

PENALTY = 0.1
LONG_PAGE = "WebShop [SEP] results " + "item & <b>price</b> " * 400       # past MAX_TEXT_CHARS


def played(gid: str, anchors: list[list[str]], winners: set[int], *, empty: tuple[int, int] | None = None,
           invalid: tuple[int, int] | None = None, env_error: set[int] = frozenset(), version: int = 3):
    """A group whose trajectory k takes the steps `anchors[k]` (shared texts: shared anchor states); the
    winners get 10 on their last step. `empty`: (trajectory, step) of a row with an empty response;
    `invalid`: of an invalid action."""
    rng = np.random.default_rng(len(gid))
    trajs = []
    for k, texts in enumerate(anchors):
        steps = []
        for t, text in enumerate(texts):
            n = 0 if empty == (k, t) else 4
            logprobs = -rng.random(n).astype(np.float32) - 0.1
            if n:
                logprobs[-1] = 0.0         # a token the grammar forced: out of the loss and of the gap
            reward = 10.0 if k in winners and t == len(texts) - 1 else 0.0
            steps.append(StepRow(prompt_ids=rng.integers(1, 500, 12), response_ids=rng.integers(1, 500, n),
                                 response_logprobs=logprobs, reward=reward, anchor=text, valid=invalid != (k, t),
                                 step=t, policy_version=version + t % 2,
                                 action=f"go to {text.split()[-1]} <now> & then"))
        won = k in winners
        trajs.append((Trajectory(traj_id=f"{gid}/{k}", success=won, episode_return=10.0 if won else 0.0,
                                 task_type="pick_and_place_simple", score=float(won),
                                 termination=Termination.ENV_ERROR if k in env_error else Termination.DONE), steps))
    return EpisodeGroup.pack(gid, f"task-{gid}", "alfworld", trajs)


def scenario() -> list[EpisodeGroup]:
    """Four groups: one all-failed (skipped under dynamic sampling), two with anchors shared across their
    trajectories (a long page, an empty response, an invalid action, an env-error trajectory), and one more."""
    return [
        played("flat", [["room a", "room b"], ["room a", "room c"]], winners=set()),
        played("g1", [["room a", "desk 1", "drawer 2"], ["room a", "desk 1", "room a", "desk 1", "drawer 2"],
                      ["room a", LONG_PAGE, "shelf 3"]], winners={0}, empty=(1, 2), invalid=(2, 1)),
        played("g2", [["hall x", "sofa y"], ["hall x", "sofa y", "hall x"], ["hall x", "bed z"], ["hall x"]],
               winners={0, 2}, env_error={3}),
        played("g3", [["yard", "gate"], ["yard", "shed"]], winners={1}),
    ]


def learner_cfg(**kw) -> LearnerConfig:
    return LearnerConfig(dynamic_sampling=True, omega=0.5, **kw)


def test_the_record_holds_the_advantages_build_batch_trained_with_and_the_anchor_groups():
    groups, cfg = scenario(), learner_cfg()
    batch = build_batch(groups, cfg, invalid_action_penalty=PENALTY)
    assert batch.skipped_group_ids == ["flat"]
    # As if the learner had recomputed them: 0.25 nat below vLLM's, far off where the grammar forced the token.
    learner_logprobs = [np.where(lp == 0, np.float32(-3), lp - np.float32(0.25)) for lp in batch.old_logprobs]
    line = group_record(groups, batch, cfg, keep=2, update=7, invalid_action_penalty=PENALTY,
                        learner_logprobs=learner_logprobs)
    assert line["update"] == 7 and line["algorithm"] == "gigpo" and line["groups_in_update"] == 4
    assert [g["group_id"] for g in line["groups"]] == ["g1", "g2"]        # the first trained ones
    grpo_batch = build_batch(groups, learner_cfg(algorithm="grpo"), invalid_action_penalty=PENALTY)
    for g, rec in zip(groups[1:3], line["groups"]):
        rows = rec["rows"]
        keep = [t.termination != Termination.ENV_ERROR for t in g.trajectories]
        assert len(rec["trajectories"]) == sum(keep) and rec["env_error_trajectories"] == len(keep) - sum(keep)
        usable = np.flatnonzero(np.array(keep)[g.row_trajectory()])
        assert len(rows) == len(usable)
        trained = [r for r in rows if r["adv"] is not None]
        # The advantage of every trained row is the batch's, in the batch's order; GRPO's is GRPO's batch's.
        in_batch = [a for a, gid in zip(batch.advantages.tolist(), batch.row_group) if gid == g.group_id]
        assert [r["adv"] for r in trained] == in_batch
        grpo = [a for a, gid in zip(grpo_batch.advantages.tolist(), grpo_batch.row_group) if gid == g.group_id]
        np.testing.assert_allclose([r["grpo_adv"] for r in trained], grpo, rtol=0, atol=1e-12)
        for r in rows:
            assert r["episode_adv"] == r["grpo_adv"]          # GRPO's advantage is GiGPO's episode part
            if r["adv"] is not None:
                assert r["adv"] == pytest.approx(r["episode_adv"] + cfg.omega * r["step_adv"], abs=1e-12)
                assert r["logprob_gap"] == pytest.approx(0.25, abs=1e-6)
            else:
                assert r["logprob_gap"] is None
        # Anchor groups are exactly the rows with equal anchors; each distinct observation is stored once.
        anchors = [g.rows.text("anchor")[i] for i in usable]
        for a, ra in zip(anchors, rows):
            for b, rb in zip(anchors, rows):
                assert (ra["anchor_group"] == rb["anchor_group"]) == (a == b) == (ra["obs"] == rb["obs"])
            obs = rec["observations"][ra["obs"]]
            assert obs["chars"] == len(a) and obs["text"] == cut(a) and len(obs["text"]) <= MAX_TEXT_CHARS + 3
        steps = [(rec["trajectories"][r["traj"]]["traj_id"], r["step"]) for r in rows]
        assert steps == [(g.trajectories[k].traj_id, int(g.rows["step"][i]))
                         for k, i in zip(g.row_trajectory()[usable], usable)]
        assert [r["policy_version"] for r in rows] == g.rows["policy_version"][usable].tolist()
        assert [r["valid"] for r in rows] == g.rows["valid"][usable].tolist()
    g1 = line["groups"][0]
    assert sum(r["adv"] is None for r in g1["rows"]) == 1                 # the empty response: not trained
    assert any(o["chars"] == len(LONG_PAGE) and len(o["text"]) < len(LONG_PAGE) for o in g1["observations"])
    assert any(r["step_adv"] != 0 for r in g1["rows"])
    # Without a recompute there is no per-row gap.
    plain = group_record(groups, batch, cfg, keep=1, update=7, invalid_action_penalty=PENALTY)
    assert [r["logprob_gap"] for r in plain["groups"][0]["rows"]] == [None] * len(g1["rows"])


def test_synthetic_batches_line_up_with_build_batch():
    for seed in range(4):
        groups = synthetic_groups(6, 5, max_steps=6, num_anchors=3, seed=seed)
        cfg = LearnerConfig(episode_stats="trajectories" if seed % 2 else "rows")
        batch = build_batch(groups, cfg, invalid_action_penalty=PENALTY)
        line = group_record(groups, batch, cfg, keep=6, update=seed, invalid_action_penalty=PENALTY)
        recorded = [r["adv"] for g in line["groups"] for r in g["rows"] if r["adv"] is not None]
        assert recorded == batch.advantages.tolist()


def run_dir_with_records(tmp_path, updates=(1, 2, 3)):
    cfg = ExperimentConfig()
    cfg.run.output_dir = str(tmp_path / "run")
    cfg.learner = learner_cfg()
    recorder = GroupRecorder(cfg, resume=False)
    lines = []
    for u in updates:
        groups = scenario()
        batch = build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty)
        lines.append(recorder.record(groups, batch, u, learner_logprobs=None))
    return tmp_path / "run", lines


def test_the_recorder_starts_a_new_run_anew_and_appends_on_resume(tmp_path):
    run, lines = run_dir_with_records(tmp_path)
    path = run / GROUPS_FILE
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines
    assert len(lines[0]["groups"]) == ExperimentConfig().run.record_groups
    cfg = ExperimentConfig()
    cfg.run.output_dir = str(run)
    groups = scenario()
    batch = build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty)
    GroupRecorder(cfg, resume=True).record(groups, batch, 4, learner_logprobs=None)
    assert len(path.read_text().splitlines()) == 4
    GroupRecorder(cfg, resume=False).record(groups, batch, 1, learner_logprobs=None)
    assert len(path.read_text().splitlines()) == 1
    cfg.run.record_groups = 0
    assert GroupRecorder(cfg, resume=True).record(groups, batch, 2, learner_logprobs=None) is None
    assert len(path.read_text().splitlines()) == 1


class Page(HTMLParser):
    """What the tests look at in a page: every element's tag, attributes and text, by id and class."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[dict] = []
        self.open: list[dict] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        element = {"tag": tag, "attrs": dict(attrs), "text": "", "children": []}
        self.elements.append(element)
        for parent in self.open:
            parent["children"].append(element)
        if tag not in ("meta", "br", "input", "link"):
            self.open.append(element)

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for element in self.open:
            element["text"] += data

    def find(self, cls: str) -> list[dict]:
        return [e for e in self.elements if cls in e["attrs"].get("class", "").split()]

    def by_id(self, ident: str) -> dict:
        return next(e for e in self.elements if e["attrs"].get("id") == ident)


def check_page(page: Page, lines: list[dict]) -> None:
    assert not any(e["tag"] in ("now", "b") for e in page.elements)     # the actions' and pages' markup is text
    cells = page.find("step")
    assert len(cells) == sum(len(g["rows"]) for line in lines for g in line["groups"])
    colour_of_anchor = {}
    by_key = {(int(c["attrs"]["data-update"]), int(c["attrs"]["data-group"]), int(c["attrs"]["data-traj"]),
               int(c["attrs"]["data-step"])): c for c in cells}
    for line in lines:
        assert page.by_id(f"update-{line['update']}")["attrs"]["data-update"] == str(line["update"])
        for gi, group in enumerate(line["groups"]):
            for row in group["rows"]:
                cell = by_key[(line["update"], gi, row["traj"], row["step"])]
                a = cell["attrs"]
                for attr, key in (("data-adv", "adv"), ("data-step-adv", "step_adv"),
                                  ("data-episode-adv", "episode_adv"), ("data-grpo-adv", "grpo_adv")):
                    assert (float(a[attr]) if a[attr] else None) == row[key]
                assert int(a["data-anchor-group"]) == row["anchor_group"]
                adv = row["adv"]
                sign = "none" if adv is None else "pos" if adv > 0 else "neg" if adv < 0 else "zero"
                assert sign in a["class"].split()
                shown = next(ch for ch in cell["children"] if ch["attrs"].get("class") == "adv")["text"]
                assert shown[0] == {"pos": "+", "neg": "-", "zero": "0", "none": "n"}[sign]
                label = next(ch for ch in cell["children"] if "anchor" in ch["attrs"].get("class", "").split())
                assert label["text"] == f"A{row['anchor_group']}"
                # One colour per anchor group (in the cell's border and its label), the same for all its steps.
                colour = label["attrs"]["style"]
                assert colour_of_anchor.setdefault((line["update"], gi, row["anchor_group"]), colour) == colour
                assert colour.split(":", 1)[1] in a["style"]
    # Different anchor groups of a group look different (as far as the palette goes).
    for line in lines:
        for gi, group in enumerate(line["groups"]):
            colours = {colour_of_anchor[(line["update"], gi, r["anchor_group"])] for r in group["rows"]}
            assert len(colours) == len({r["anchor_group"] for r in group["rows"]})


def write_evals(run):
    detail = [{"task_id": f"gen/eval/{i}", "task_type": "pick_and_place_simple", "success": i % 2 == 0,
               "steps": 4 + i, "return": 10.0 * (i % 2 == 0), "score": float(i % 2 == 0), "termination": "done",
               "policy_version": 0} for i in range(3)]
    lines = [{"when": "before training", "update": 0, "split": "eval", "policy_version": 0, "episodes": 3,
              "success": 2 / 3, "per_task_type": {"pick_and_place_simple": 2 / 3}, "mean_steps": 5.0,
              "episodes_detail": detail},
             {"when": "after update 2", "update": 2, "split": "eval", "policy_version": 2, "episodes": 3,
              "success": 1.0, "per_task_type": {"pick_and_place_simple": 1.0}, "mean_steps": 4.0}]
    (run / "evals.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_gigpo_view_writes_one_static_page_with_every_step_and_evaluation(tmp_path, capsys):
    run, lines = run_dir_with_records(tmp_path)
    write_evals(run)
    assert cli.main(["view", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [str(run / "view.html")]
    text = (run / "view.html").read_text()
    assert "http://" not in text and "https://" not in text and "<link" not in text and " src=" not in text
    page = Page(text)
    check_page(page, lines)
    assert len(page.find("episode")) == 3 and len(page.find("eval")) == 2
    won = [e for e in page.find("episode") if e["attrs"]["data-success"] == "1"]
    assert len(won) == 2 and all(e["attrs"]["data-task-type"] == "pick_and_place_simple" for e in won)
    assert {o["attrs"]["value"] for o in page.elements if o["tag"] == "option"} >= {"", "1", "0", "2",
                                                                                      "pick_and_place_simple"}
    # The long page is folded in a <details>, cut, escaped.
    folded = [e for e in page.elements if e["tag"] == "pre" and "item & <b>price</b>" in e["text"]]
    assert folded and all(len(e["text"]) <= MAX_TEXT_CHARS + 3 for e in folded)
    assert "<b>price</b>" not in text
    out_file = tmp_path / "elsewhere.html"
    assert cli.main(["view", str(run), "--out", str(out_file)]) == 0
    assert capsys.readouterr().out.strip() == str(out_file) and out_file.read_text() == text


def test_bad_run_directories_are_one_line_and_exit_2(tmp_path, capsys):
    def one_error(argv) -> str:
        assert cli.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
        assert captured.err.startswith("gigpo: ")
        return captured.err

    assert "groups.jsonl: no such file" in one_error(["view", str(tmp_path)])
    assert "no such directory" in one_error(["view", str(tmp_path / "missing")])
    run, lines = run_dir_with_records(tmp_path)
    path = run / GROUPS_FILE
    good = path.read_text().splitlines(keepends=True)
    path.write_text(good[0] + good[1][: len(good[1]) // 2] + "\n" + good[2])      # damaged in the middle
    assert "line 2 is not valid JSON" in one_error(["view", str(run)])
    path.write_text(good[0] + "[1, 2]\n")
    assert "line 2 is not a JSON object" in one_error(["view", str(run)])
    path.write_text(good[0] + json.dumps({"update": 5, "groups": [{"group_id": "x"}]}) + "\n")
    assert "line 2: a group without" in one_error(["view", str(run)])
    path.write_text(good[0] + good[1] + good[2][:100] + "\n")          # a damaged last line, newline and all
    assert "line 3 is not valid JSON" in one_error(["view", str(run)])
    # A last line still being written (no newline yet): skipped with a note, the rest shown.
    path.write_text(good[0] + good[1] + good[2][:100])
    assert cli.main(["view", str(run)]) == 0
    captured = capsys.readouterr()
    assert "line 3 is not finished" in captured.err and captured.out.strip() == str(run / "view.html")
    check_page(Page((run / "view.html").read_text()), lines[:2])


def dump_dom(chromium: str, url: str, workdir) -> str:
    """The DOM of `url` after its scripts ran, from headless Chromium (as deploy/tools/check_dashboard.py runs it)."""
    from deploy.tools.check_dashboard import headless_chromium

    code, out, err = headless_chromium(chromium, url, workdir, "--virtual-time-budget=5000", "--dump-dom")
    assert code == 0 and out, err.decode()[-2000:]
    return out.decode()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (`make chromium`)")
def test_the_page_in_headless_chromium_has_the_same_cells_and_its_filters_work(tmp_path):
    run, lines = run_dir_with_records(tmp_path)
    write_evals(run)
    assert cli.main(["view", str(run)]) == 0
    url = (run / "view.html").resolve().as_uri()
    page = Page(dump_dom(shutil.which("chromium"), url, tmp_path / "profile"))
    check_page(page, lines)
    assert page.by_id("update-2") and page.elements[0]["tag"] == "html"
    body = next(e for e in page.elements if e["tag"] == "body")
    assert body["attrs"].get("data-filters-ready") == "1"           # the script ran
    assert not any("hidden" in e["attrs"] for e in page.find("filterable"))
    # Filters from the query: update 2's section only, failed trajectories only.
    page = Page(dump_dom(shutil.which("chromium"), url + "?update=2&success=0", tmp_path / "profile"))
    shown = {e["attrs"]["id"] for e in page.find("update") if "hidden" not in e["attrs"]}
    assert shown == {"update-2"}
    trajs = page.find("traj")
    assert trajs and all(("hidden" in e["attrs"]) == (e["attrs"]["data-success"] == "1") for e in trajs)
    episodes = page.find("episode")
    assert episodes and all("hidden" in e["attrs"] for e in episodes)      # evaluated at update 0, not 2
