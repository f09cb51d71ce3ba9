"""`gigpo view RUN_DIR [--out FILE]`: one static, self-contained HTML page of a run's trajectories with the
credit GiGPO gave every step, from RUN_DIR/groups.jsonl (learner/group_record.py, run.record_groups) and
RUN_DIR/evals.jsonl if any; README.md ("Trajectories and their credit") describes the page. An update recorded
twice (a resumed run) shows its last record. Bad input is a ViewError; a partly written last line (a run still
writing it) is skipped with a note.
"""
from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path
from typing import Callable

from common.run_dir import EVALS_FILE, GROUPS_FILE, VIEW_FILE

GROUP_KEYS = {"group_id", "task_id", "task_type", "trajectories", "observations", "rows"}
ROW_KEYS = {"traj", "step", "obs", "action", "valid", "reward", "anchor_group", "adv", "episode_adv", "step_adv",
            "grpo_adv", "policy_version", "logprob_gap"}
INT_KEYS = ("traj", "step", "obs", "anchor_group", "policy_version")
NUMBER_KEYS = ("reward", "adv", "episode_adv", "step_adv", "grpo_adv", "logprob_gap")     # (or null)
ACTION_CHARS = 60        # an action longer than this shows cut in its cell (whole in the cell's tooltip)
SUMMARY_CHARS = 100      # the first characters of an observation shown while it is folded


class ViewError(ValueError):
    """A run directory the page cannot be made from (the message says what is wrong, in one line)."""


# -- reading -----------------------------------------------------------------------------------------------

def read_jsonl(path: Path, note: Callable[[str], None]) -> list[dict]:
    """The JSON objects of `path`, one a line; ViewError for a line that is not one, except an unfinished last
    line (the run is still writing it), skipped with a note."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    except OSError as exc:
        raise ViewError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            if number == len(lines):         # the last line, without its newline
                note(f"{path}: line {number} is not finished (a run still writing it?); skipped")
                continue
            raise ViewError(f"{path}: line {number} is not valid JSON ({exc}); the file is damaged") from None
        if not isinstance(value, dict):
            raise ViewError(f"{path}: line {number} is not a JSON object")
        value["_line"] = number
        records.append(value)
    return records


def check_group_record(record: dict, where: str) -> None:
    """Raise ViewError unless `record` has what the page shows (learner.group_record's line)."""
    if not isinstance(record.get("update"), int) or not isinstance(record.get("groups"), list):
        raise ViewError(f"{where}: not a group record (it needs an integer 'update' and a list of 'groups')")
    for group in record["groups"]:
        missing = GROUP_KEYS - set(group) if isinstance(group, dict) else GROUP_KEYS
        if missing:
            raise ViewError(f"{where}: a group without {sorted(missing)}")
        for name in ("trajectories", "observations", "rows"):
            if not isinstance(group[name], list) or not all(isinstance(x, dict) for x in group[name]):
                raise ViewError(f"{where}: group {group['group_id']}: '{name}' is not a list of objects")
        for row in group["rows"]:
            missing = ROW_KEYS - set(row)
            if missing:
                raise ViewError(f"{where}: group {group['group_id']}: a step row without {sorted(missing)}")
            if not all(isinstance(row[k], int) for k in INT_KEYS) or not all(
                    row[k] is None or isinstance(row[k], (int, float)) for k in NUMBER_KEYS):
                raise ViewError(f"{where}: group {group['group_id']}: a step row with a value of the wrong type")


def read_run(run_dir: Path, note: Callable[[str], None]) -> tuple[list[dict], list[dict]]:
    """(group records by update, the last of each update; evaluation lines) of a run directory."""
    if not run_dir.is_dir():
        raise ViewError(f"{run_dir}: no such directory; pass a run's output directory (run.output_dir)")
    path = run_dir / GROUPS_FILE
    if not path.is_file():
        raise ViewError(f"{path}: no such file; the learner writes it on each update when run.record_groups > 0")
    by_update = {}
    for record in read_jsonl(path, note):
        check_group_record(record, f"{path}: line {record['_line']}")
        by_update[record["update"]] = record
    evals_path = run_dir / EVALS_FILE
    evals = read_jsonl(evals_path, note) if evals_path.is_file() else []
    return [by_update[u] for u in sorted(by_update)], evals


# -- formatting --------------------------------------------------------------------------------------------

def esc(value) -> str:
    return html.escape(str(value), quote=True)


def number(value: float | None) -> str:
    """A data attribute's value: the float as Python writes it (it reads back the same), "" for None."""
    return "" if value is None else repr(float(value))


def signed(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "0" if value == 0 else f"{value:+.2f}"


def sign_class(value: float | None) -> str:
    if value is None:
        return "none"
    return "pos" if value > 0 else "neg" if value < 0 else "zero"


def adv_colour(value: float | None, scale: float) -> str:
    """Diverging colour: white at 0, blue towards +scale, red towards -scale; grey for no value."""
    if value is None:
        return "#d9d9d9"
    t = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
    end = (33, 102, 172) if t > 0 else (178, 24, 43)
    r, g, b = (round(255 + (c - 255) * abs(t)) for c in end)
    return f"rgb({r},{g},{b})"


def anchor_colour(index: int) -> str:
    """A categorical colour per anchor group (golden-angle hues: neighbours differ)."""
    return f"hsl({(45 + index * 137.508) % 360:.0f},70%,38%)"


def percent(value) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "-"


# -- the page ----------------------------------------------------------------------------------------------

def render(records: list[dict], evals: list[dict], title: str) -> str:
    task_types = sorted({g["task_type"] for r in records for g in r["groups"] if g["task_type"]}
                        | {e.get("task_type") for ev in evals for e in ev.get("episodes_detail") or []
                           if e.get("task_type")})
    parts = [f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>",
             f"<style>{CSS}</style></head><body>", f"<h1>{esc(title)}</h1>", _intro(records),
             _filters(task_types, [r["update"] for r in records]), _evaluations(evals),
             "<section id=\"training\"><h2>Training groups</h2>"]
    if not records:
        parts.append("<p class=\"empty\">No update recorded yet.</p>")
    parts += [_update(r) for r in records]
    parts.append(f"</section><script>{SCRIPT}</script></body></html>\n")
    return "\n".join(parts)


def _intro(records: list[dict]) -> str:
    algorithms = sorted({r.get("algorithm", "?") for r in records})
    links = " ".join(f"<a href=\"#update-{r['update']}\">{r['update']}</a>" for r in records)
    return (f"<p>{len(records)} updates recorded (algorithm: {esc(', '.join(algorithms) or '-')}). A step's colour "
            "is the advantage the learner trained it with: <span class=\"swatch\" style=\"background:"
            f"{adv_colour(-1, 1)}\">&minus;</span> below 0, <span class=\"swatch\" style=\"background:"
            f"{adv_colour(1, 1)}\">+</span> above, white at 0, grey: not trained (an empty response); full colour "
            "at the update's largest |advantage|. E and S: GiGPO's episode and step parts (A = E + &omega; S); "
            "the lower band: GRPO's advantage of the same step (E alone). A<i>n</i>: the step's anchor group "
            "(the steps of the group taken from the same state share it; a dashed label is a group of one).</p>"
            f"<nav>updates: {links}</nav>")


def _filters(task_types: list[str], updates: list[int]) -> str:
    def select(name: str, label: str, options: list[tuple[str, str]]) -> str:
        items = "".join(f"<option value=\"{esc(v)}\">{esc(t)}</option>" for v, t in [("", "all"), *options])
        return f"<label>{label} <select id=\"filter-{name}\" data-filter=\"{name}\">{items}</select></label>"
    return ("<form id=\"filters\">" + select("task-type", "task type", [(t, t) for t in task_types])
            + select("success", "success", [("1", "succeeded"), ("0", "failed")])
            + select("update", "update", [(str(u), str(u)) for u in updates]) + "</form>")


def _evaluations(evals: list[dict]) -> str:
    if not evals:
        return "<section id=\"evals\"><h2>Evaluations</h2><p class=\"empty\">No evals.jsonl.</p></section>"
    types = sorted({t for ev in evals for t in (ev.get("per_task_type") or {})})
    head = "".join(f"<th>{esc(t)}</th>" for t in ["when", "update", "split", "policy version", "episodes",
                                                   "success", "mean steps", *types])
    rows = []
    for ev in evals:
        per_type = ev.get("per_task_type") or {}
        steps = _mean_steps_by_type(ev.get("episodes_detail") or [])
        cells = [ev.get("when", ""), ev.get("update", ""), ev.get("split", ""), ev.get("policy_version", ""),
                 ev.get("episodes", ""), percent(ev.get("success")),
                 f"{ev['mean_steps']:.1f}" if isinstance(ev.get("mean_steps"), (int, float)) else "-"]
        cells += [percent(per_type.get(t)) + (f" ({steps[t]:.1f} steps)" if t in steps else "") for t in types]
        rows.append(f"<tr class=\"eval filterable\" data-update=\"{esc(ev.get('update', ''))}\" "
                    f"data-split=\"{esc(ev.get('split', ''))}\">" + "".join(f"<td>{esc(c)}</td>" for c in cells)
                    + "</tr>")
    details = [_eval_episodes(i, ev) for i, ev in enumerate(evals) if ev.get("episodes_detail")]
    return ("<section id=\"evals\"><h2>Evaluations</h2><p>Success per task type (mean steps in brackets)."
            + ("" if details else " These lines hold no per-episode records.") + "</p>"
            f"<table class=\"evals\"><tr>{head}</tr>{''.join(rows)}</table>{''.join(details)}</section>")


def _mean_steps_by_type(episodes: list[dict]) -> dict[str, float]:
    by_type: dict[str, list] = {}
    for e in episodes:
        if isinstance(e.get("steps"), (int, float)):
            by_type.setdefault(e.get("task_type") or "", []).append(e["steps"])
    return {t: sum(steps) / len(steps) for t, steps in by_type.items()}


def _eval_episodes(index: int, ev: dict) -> str:
    episodes = ev["episodes_detail"]
    header = "".join(f"<th>{h}</th>" for h in ("task", "task type", "success", "steps", "return", "score",
                                               "termination", "policy version"))
    rows = []
    for e in episodes:
        won = bool(e.get("success"))
        cells = [e.get("task_id", ""), e.get("task_type", ""), "yes" if won else "no", e.get("steps", ""),
                 e.get("return", ""), e.get("score", ""), e.get("termination", ""), e.get("policy_version", "")]
        rows.append(f"<tr class=\"episode filterable {'won' if won else 'lost'}\" "
                    f"data-update=\"{esc(ev.get('update', ''))}\" data-split=\"{esc(ev.get('split', ''))}\" "
                    f"data-task-type=\"{esc(e.get('task_type', ''))}\" data-success=\"{int(won)}\">"
                    + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    won = sum(bool(e.get("success")) for e in episodes)
    return (f"<details class=\"eval-episodes filterable\" id=\"eval-{index}\" "
            f"data-update=\"{esc(ev.get('update', ''))}\">"
            f"<summary>{esc(ev.get('when', ''))}, split {esc(ev.get('split', ''))}: {won} of {len(episodes)} "
            f"episodes succeeded</summary><table class=\"episodes\"><tr>{header}</tr>{''.join(rows)}</table></details>")


def _update(record: dict) -> str:
    update = record["update"]
    values = [abs(row[k]) for g in record["groups"] for row in g["rows"] for k in ("adv", "grpo_adv")
              if row[k] is not None]
    scale = max(values, default=0.0)
    groups = "".join(_group(update, i, g, scale, record.get("omega")) for i, g in enumerate(record["groups"]))
    return (f"<section class=\"update filterable\" id=\"update-{update}\" data-update=\"{update}\">"
            f"<h3>update {update}</h3><p>{len(record['groups'])} of the update's "
            f"{esc(record.get('groups_in_update', '?'))} groups; algorithm {esc(record.get('algorithm', '?'))}, "
            f"full colour at |A| = {scale:.3g}</p>{groups}</section>")


def _group(update: int, index: int, group: dict, scale: float, omega) -> str:
    trajs, rows = group["trajectories"], group["rows"]
    sizes = Counter(row["anchor_group"] for row in rows)
    lines = []
    for k, t in enumerate(trajs):
        won = bool(t.get("success"))
        head = (f"<th class=\"traj-head\">traj {k} {'&#10003;' if won else '&#10007;'}<br><small>return "
                f"{esc(t.get('return'))}, {esc(t.get('steps'))} steps, {esc(t.get('termination'))}</small></th>")
        cells = "".join(_step(update, index, row, sizes[row["anchor_group"]], scale)
                        for row in sorted((r for r in rows if r["traj"] == k), key=lambda r: r["step"]))
        lines.append(f"<tr class=\"traj filterable {'won' if won else 'lost'}\" data-traj=\"{k}\" "
                     f"data-success=\"{int(won)}\">{head}{cells}</tr>")
    singletons = sum(1 for n in sizes.values() if n == 1)
    errors = group.get("env_error_trajectories") or 0
    return (f"<div class=\"group filterable\" id=\"update-{update}-group-{index}\" data-update=\"{update}\" "
            f"data-group=\"{index}\" data-task-type=\"{esc(group['task_type'])}\">"
            f"<h4>group {esc(group['group_id'])}: task {esc(group['task_id'])}"
            f"{', ' + esc(group['task_type']) if group['task_type'] else ''}</h4>"
            f"<p>{sum(bool(t.get('success')) for t in trajs)} of {len(trajs)} trajectories succeeded; "
            f"{len(sizes)} anchor groups over {len(rows)} steps ({singletons} of one step)"
            f"{f'; {errors} trajectories ended by an env error left out' if errors else ''}; &omega; = {esc(omega)}</p>"
            f"<table class=\"steps\">{''.join(lines)}</table>{_observations(update, index, group['observations'])}"
            "</div>")


def _step(update: int, group: int, row: dict, anchor_size: int, scale: float) -> str:
    adv, grpo = row["adv"], row["grpo_adv"]
    anchor = row["anchor_group"]
    action = str(row["action"])
    shown = action if len(action) <= ACTION_CHARS else action[:ACTION_CHARS] + "..."
    gap = f", log-prob gap {row['logprob_gap']:.4f}" if row["logprob_gap"] is not None else ""
    tip = (f"step {row['step']}: {action}\nreward {row['reward']}, {'valid' if row['valid'] else 'INVALID'}, "
           f"policy version {row['policy_version']}{gap}\nA {signed(adv)} = E {signed(row['episode_adv'])} + "
           f"omega x S {signed(row['step_adv'])}; GRPO {signed(grpo)}")
    attrs = {"update": update, "group": group, "traj": row["traj"], "step": row["step"], "anchor-group": anchor,
             "anchor-size": anchor_size, "obs": row["obs"], "adv": number(adv), "step-adv": number(row["step_adv"]),
             "episode-adv": number(row["episode_adv"]), "grpo-adv": number(grpo), "reward": number(row["reward"]),
             "valid": int(bool(row["valid"])), "policy-version": row["policy_version"],
             "logprob-gap": number(row["logprob_gap"])}
    data = " ".join(f"data-{k}=\"{esc(v)}\"" for k, v in attrs.items())
    single = " single" if anchor_size == 1 else ""
    return (f"<td class=\"step {sign_class(adv)}{'' if row['valid'] else ' invalid'}\" {data} "
            f"style=\"background:{adv_colour(adv, scale)};border-left-color:{anchor_colour(anchor)}\" "
            f"title=\"{esc(tip)}\">"
            f"<div class=\"adv\">{signed(adv)}</div>"
            f"<div class=\"parts\">E {signed(row['episode_adv'])} &middot; S {signed(row['step_adv'])}</div>"
            f"<div class=\"act\">{esc(shown)}</div>"
            f"<div class=\"meta\"><span class=\"anchor{single}\" style=\"background:{anchor_colour(anchor)}\">"
            f"A{anchor}</span> <a class=\"obs\" href=\"#update-{update}-group-{group}-obs-{row['obs']}\">"
            f"o{row['obs']}</a>{' r=' + esc(row['reward']) if row['reward'] else ''}</div>"
            f"<div class=\"grpo {sign_class(grpo)}\" style=\"background:{adv_colour(grpo, scale)}\">"
            f"GRPO {signed(grpo)}</div></td>")


def _observations(update: int, group: int, observations: list[dict]) -> str:
    items = []
    for i, obs in enumerate(observations):
        text = str(obs.get("text", ""))
        chars = obs.get("chars", len(text))
        summary = " ".join(text[:SUMMARY_CHARS].split()) + ("..." if len(text) > SUMMARY_CHARS else "")
        was_cut = isinstance(chars, int) and chars > len(text)
        cut = f"(cut by the record: the observation has {chars} characters)" if was_cut else ""
        items.append(f"<li id=\"update-{update}-group-{group}-obs-{i}\"><details><summary>o{i}: {esc(summary)}"
                     f"</summary><pre>{esc(text)}</pre>{esc(cut)}</details></li>")
    return (f"<details class=\"observations\"><summary>{len(observations)} distinct observations</summary>"
            f"<ol start=\"0\">{''.join(items)}</ol></details>")


def write_view(run_dir: str | Path, out: str | Path | None = None,
               note: Callable[[str], None] = lambda message: None) -> Path:
    """Write the page of `run_dir` to `out` (default RUN_DIR/view.html); returns its path. Raises ViewError."""
    run_dir = Path(run_dir)
    records, evals = read_run(run_dir, note)
    path = Path(out) if out else run_dir / VIEW_FILE
    page = render(records, evals, f"gigpo view: {run_dir.resolve().name}")
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ViewError(f"{path}: cannot write the page ({exc.strerror or exc})") from None
    return path


CSS = """
body{font:13px/1.35 system-ui,sans-serif;margin:1em 2em;color:#222}
h3{margin-top:2em;border-bottom:1px solid #999}
nav a{margin-right:.4em}
#filters{position:sticky;top:0;background:#f4f4f4;padding:.4em;border:1px solid #ccc;z-index:1}
#filters label{margin-right:1.2em}
.swatch{display:inline-block;width:1.4em;text-align:center;color:#fff}
table{border-collapse:collapse}
table.evals td,table.evals th,table.episodes td,table.episodes th{border:1px solid #ccc;padding:2px 6px}
tr.episode.won td:nth-child(3){color:#1a7f37;font-weight:bold}
table.steps{margin:.3em 0}
th.traj-head{text-align:left;white-space:nowrap;padding-right:.6em;vertical-align:top}
tr.traj.won th.traj-head{color:#1a7f37}
td.step{border:1px solid #bbb;border-left:6px solid;min-width:7.5em;max-width:11em;vertical-align:top;padding:0}
td.step>div{padding:1px 4px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
td.step .adv{font-weight:bold;font-size:14px}
td.step.invalid .act{text-decoration:line-through}
td.step .grpo{border-top:1px solid #999;font-size:11px}
.anchor{color:#fff;border-radius:3px;padding:0 4px;font-weight:bold}
.anchor.single{opacity:.55;border:1px dashed #000}
.observations{margin:.3em 0 1em}
pre{white-space:pre-wrap;max-width:100em;background:#fafafa;border:1px solid #ddd;padding:.4em}
.empty{color:#777}
"""

SCRIPT = """
(function () {
  const selects = Array.from(document.querySelectorAll('#filters select'));
  const key = s => s.dataset.filter.replace(/-(.)/g, (_, c) => c.toUpperCase());
  function apply() {
    const want = selects.filter(s => s.value !== '').map(s => [key(s), s.value]);
    document.querySelectorAll('.filterable').forEach(el => {
      el.hidden = want.some(([k, v]) => k in el.dataset && el.dataset[k] !== v);
    });
  }
  const query = new URLSearchParams(location.search);
  selects.forEach(s => {
    const v = query.get(s.dataset.filter.replace('-', '_'));
    if (v !== null && Array.from(s.options).some(o => o.value === v)) s.value = v;
    s.addEventListener('change', apply);
  });
  function reveal() {       // a link to #update-N shows that update, whatever the update filter said
    const m = location.hash.match(/^#update-(\\d+)$/);
    const u = document.getElementById('filter-update');
    if (m && u.value !== '' && u.value !== m[1]) { u.value = m[1]; apply(); }
    const target = location.hash && document.getElementById(location.hash.slice(1));
    if (target) { for (let d = target.closest('details'); d; d = d.parentElement.closest('details')) d.open = true; }
  }
  document.addEventListener('click', e => {
    const a = e.target.closest('a.obs');
    const target = a && document.getElementById(a.hash.slice(1));
    if (target) { target.closest('details.observations').open = true; target.querySelector('details').open = true; }
  });
  window.addEventListener('hashchange', reveal);
  apply();
  reveal();
  document.body.dataset.filtersReady = '1';
})();
"""
