"""common/run_dir.py: the run directory's names, the run id, the resume/overwrite rule, and that no other
production module spells the layout again."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from common import run_dir
from common.config import ConfigError, ExperimentConfig, load_config
from common.run_dir import (LATEST, LEARNER_STATE, NAMES, PUSHED_VERSION, RUN_ID_FILE, checkpoint_tag,
                            checkpoint_tags, checkpoints_dir, complete_checkpoints, eval_result_file, logs_dir,
                            prepare_checkpoint_dir, prepare_output_dir, resolve_run_id, tag_update)

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("common", "actors", "learner", "env_servers", "deploy")
# Names that are also ordinary words elsewhere (a CLI command, a JSON key, a close step): they count only
# where a path is built from them or a constant is defined as them.
ORDINARY_WORDS = {run_dir.RUN_ID_FILE, run_dir.REDIS_DIR, run_dir.LOGS_DIR, run_dir.LATEST, run_dir.EVAL_DIR}


def _cfg(tmp_path: Path, **run) -> ExperimentConfig:
    cfg = ExperimentConfig()
    cfg.run.output_dir, cfg.run.name = str(tmp_path / "run"), "my run"
    for key, value in run.items():
        setattr(cfg.run, key, value)
    return cfg


def test_names_are_distinct_entries_of_one_directory(tmp_path):
    assert len(set(NAMES)) == len(NAMES)
    assert all(name and "/" not in name and name == name.strip() for name in NAMES)
    assert checkpoints_dir(tmp_path) == tmp_path / run_dir.CHECKPOINTS_DIR
    assert Path(logs_dir("rel")).is_absolute() and Path(logs_dir("rel")).name == run_dir.LOGS_DIR
    assert eval_result_file(tmp_path, 8) == tmp_path.resolve() / run_dir.EVAL_DIR / "update_0000008.json"


def test_checkpoint_tags_are_ordered_by_update_and_complete_ones_are_marked(tmp_path):
    assert checkpoint_tag(12) == "update_0000012" and tag_update(checkpoint_tag(12)) == 12
    assert tag_update("update_x") is None and tag_update(LATEST) is None
    for update in (9999999, 10000000, 3):
        (tmp_path / checkpoint_tag(update)).mkdir()
    (tmp_path / "update_notes").mkdir()
    assert [p.name for p in checkpoint_tags(tmp_path)] == ["update_0000003", "update_9999999", "update_10000000"]
    (tmp_path / checkpoint_tag(9999999) / LEARNER_STATE).write_text("{}")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["update_9999999"]
    assert complete_checkpoints(tmp_path / "none") == []


def test_run_id_new_resumed_and_configured(tmp_path):
    first = _cfg(tmp_path)
    run_id = prepare_output_dir(first)
    assert run_id.startswith("my-run-") and first.stream.run_id == run_id
    assert (tmp_path / "run" / RUN_ID_FILE).read_text() == run_id + "\n"
    assert prepare_output_dir(_cfg(tmp_path, resume=True)) == run_id
    assert resolve_run_id(tmp_path / "run", "my run", resume=False) not in ("", run_id)
    # Resuming a directory without an id file: a new id, written for the next resume.
    assert resolve_run_id(tmp_path / "other", "", resume=True).startswith("run-")
    assert (tmp_path / "other" / RUN_ID_FILE).is_file()
    configured = _cfg(tmp_path / "c")
    configured.stream.run_id = "given"
    assert prepare_output_dir(configured) == "given" and not (tmp_path / "c" / "run" / RUN_ID_FILE).exists()


def test_resume_and_overwrite_together_are_refused_by_one_rule(tmp_path):
    message = run_dir.resume_overwrite_conflict(True, True)
    assert "set one of them" in message
    assert [run_dir.resume_overwrite_conflict(r, o) for r, o in ((True, False), (False, True), (False, False))] \
        == ["", "", ""]
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["run.resume=true", "run.overwrite=true"])
    assert message in str(exc.value) and set(exc.value.fields) == {"run.resume", "run.overwrite"}
    with pytest.raises(ValueError, match="set one of them"):
        prepare_output_dir(_cfg(tmp_path, resume=True, overwrite=True))
    assert not (tmp_path / "run").exists()


def test_another_runs_checkpoints_are_refused_or_deleted(tmp_path):
    root = tmp_path / "checkpoints"
    prepare_checkpoint_dir(root, resume=False, overwrite=False)       # nothing there: nothing to say
    (root / checkpoint_tag(8)).mkdir(parents=True)
    (root / PUSHED_VERSION).write_text("9")
    with pytest.raises(ValueError, match=r"holds another run's checkpoints \(newest: update_0000008\)"):
        prepare_checkpoint_dir(root, resume=False, overwrite=False)
    prepare_checkpoint_dir(root, resume=True, overwrite=False)         # a resume uses them
    prepare_checkpoint_dir(root, resume=False, overwrite=True, rank=1)     # only rank 0 deletes
    assert (root / checkpoint_tag(8)).is_dir()
    prepare_checkpoint_dir(root, resume=False, overwrite=True)
    assert list(root.iterdir()) == []


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _path_parts_and_constants(tree: ast.AST) -> set[int]:
    """The string constants a path is built from (`x / "a"`, os.path.join, Path(...), joinpath) or that a
    module-level UPPER_CASE name is set to."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found |= {id(node.left), id(node.right)}
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("join", "Path", "joinpath"):
                found |= {id(arg) for arg in node.args}
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            found.add(id(node.value))
    return found


def test_no_production_module_but_run_dir_spells_the_layout():
    spelled = []
    for folder in PRODUCTION:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "common" / "run_dir.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            docstrings, path_like = _docstrings(tree), _path_parts_and_constants(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docstrings
                        and (node.value not in ORDINARY_WORDS or id(node) in path_like)):
                    spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not spelled, "use common.run_dir's names instead of:\n" + "\n".join(spelled)


def test_resume_point_follows_latest_and_a_save_cut_short(tmp_path):
    """What a resumed learner loads (and what a lost run says it will): `latest` when it names a complete
    checkpoint; when it names one a crash left incomplete, the newest complete one below it (those above it are
    a history the run branched off); without `latest`, the newest complete one; a `latest` naming nothing
    raises DamagedLatest with the override that picks the newest complete one."""
    from common.run_dir import DamagedLatest, resume_point

    assert resume_point(tmp_path / "none") == (None, "")
    for update, complete in ((2, True), (4, True), (6, False), (9, True)):
        (tmp_path / checkpoint_tag(update)).mkdir()
        if complete:
            (tmp_path / checkpoint_tag(update) / LEARNER_STATE).write_text("{}")
    assert resume_point(tmp_path) == (tmp_path / checkpoint_tag(9), "")        # no latest
    (tmp_path / LATEST).write_text("update_0000004\n")
    assert resume_point(tmp_path) == (tmp_path / checkpoint_tag(4), "")        # update 9: another history
    (tmp_path / LATEST).write_text("update_0000006")
    found, note = resume_point(tmp_path)
    assert found == tmp_path / checkpoint_tag(4)
    assert note == f"{tmp_path / LATEST} names update_0000006, which is not complete (a save cut short): resuming " \
                   "from update_0000004"
    for damaged, problem in (("", "is empty, naming no checkpoint"), ("../../etc", "holds '../../etc', naming no "
                                                                                   "checkpoint"),
                             ("update_0000011", "names update_0000011, which is not there")):
        (tmp_path / LATEST).write_text(damaged)
        with pytest.raises(DamagedLatest) as caught:
            resume_point(tmp_path)
        assert str(caught.value) == (f"{tmp_path / LATEST} {problem} (complete ones: update_0000002, "
                                     "update_0000004, update_0000009): resume with run.resume_tag=update_0000009")


def test_a_checkpoint_loads_only_when_its_user_wrote_it_and_no_one_else_could_change_it(tmp_path):
    """Its files are pickles (DeepSpeed's): loading one runs what its writer put there. A file others can write
    (group or world write bit), a symbolic link, another user's file: refused, saying which; seal_checkpoint
    (what the learner does to what it saved) takes the write bits a 002 umask gave away."""
    from common.run_dir import UntrustedCheckpoint, check_checkpoint_is_ours, seal_checkpoint

    tag = tmp_path / checkpoint_tag(4)
    (tag / "global_step4").mkdir(parents=True)
    shard = tag / "global_step4" / "mp_rank_00_model_states.pt"
    shard.write_bytes(b"pickle")
    (tag / LEARNER_STATE).write_text("{}")
    for path in (tag, tag / "global_step4", shard, tag / LEARNER_STATE):
        path.chmod(0o775 if path.is_dir() else 0o664)         # as a 002 umask makes them
    with pytest.raises(UntrustedCheckpoint, match="can be written by others .mode 775.: a checkpoint is loaded only"):
        check_checkpoint_is_ours(tag)
    seal_checkpoint(tag)
    check_checkpoint_is_ours(tag)
    assert oct(shard.stat().st_mode & 0o777) == "0o644"
    link = tag / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    link.symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(UntrustedCheckpoint, match="is a symbolic link"):
        check_checkpoint_is_ours(tag)
    link.unlink()
    if os.getuid() == 0:                                       # handing a file to another user needs root
        os.chown(shard, 65534, 65534)
        with pytest.raises(UntrustedCheckpoint, match=f"{shard} belongs to user id 65534"):
            check_checkpoint_is_ours(tag)
