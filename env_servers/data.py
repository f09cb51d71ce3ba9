"""`python -m env_servers.data prepare`: put the environments' data in place (what `make data` runs).

ALFWorld: unpack `json_2.1.1.tar.xz` ($ALFWORLD_SOURCE) into $ALFWORLD_DATA, else run `alfworld-download`
(needs internet); then write each game's `traj_data.json` (ALFWorld's loader wants it; rebuilt from the
directory name `<task_type>-<Object>-<MovableRecep>-<ParentTarget>-<scene>`) and `index.json`, the solvable
games of every split (what `ALFWorldEnv.task_ids` reads). WebShop: `env_servers.webshop.data.prepare`.

Idempotent: a prepared game set (index.json present) and a catalog in place are left alone. Exit status 2,
one line on stderr per data set, when data cannot be had here; the line says how to provide it instead.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common.atomic_write import write_atomically
from env_servers.alfworld_env import DATA_SPLITS, GAME_FILE, GAME_SET, default_data_dir, game_trials, skipped
from env_servers.webshop import data as webshop_data

_SOLVABLE = re.compile(r'"solvable"\s*:\s*(true|false)')
_ALFWORLD_HOW = "set ALFWORLD_SOURCE to a local copy of ALFWorld's json_2.1.1.tar.xz"

# What a downloaded game set must hold: per split, the sha256 of its games (`game_set_digest`: every game file's
# path and sha256, in order). Computed from a copy of the standard set (the one `alfworld-download` fetches,
# repacked as json_2.1.1.tar.xz), not checked against a download from here (no internet). Only the game files
# count: the download's other files (ALFRED's trajectories, PDDL) are not read, and traj_data.json is rebuilt.
GAME_SET_SHA256: dict[str, str] = {
    "train": "799ef5d70913ad6dcac3c31288857340f1ba23da53329f55d5de0c433d613c51",
    "valid_seen": "330dc4ba16bd6625292e46d79f75d6fb883d32c4e2ded46414b675b7d7e95a0d",
    "valid_unseen": "dddc48d4dfaff6342c1406c31ded04cd125bb8f80028de8b8c74ac2bf79323cb",
    "valid_train": "08ee42c6b42df9dbf4d7eeb3f52c10e139a542ba7bba6fef1a01553129c6edb1",
}


def default_alfworld_source() -> str | None:
    """$ALFWORLD_SOURCE (the path of json_2.1.1.tar.xz), else None."""
    return os.environ.get("ALFWORLD_SOURCE") or None


def traj_data_for(game_dir_name: str) -> dict:
    """ALFWorld's traj_data.json fields, rebuilt from a game directory name. For look_at_obj_in_light the
    fourth field is the toggle target and the parent target is empty."""
    parts = game_dir_name.split("-")
    if len(parts) < 5:
        raise ValueError(f"game directory {game_dir_name!r} is not <task_type>-<Object>-<Movable>-<Target>-<scene>")
    task_type, obj, mrecep, target, scene = parts[0], parts[1], parts[2], parts[3], parts[-1]
    none = lambda s: "" if s == "None" else s   # noqa: E731 - a one-word helper
    look = task_type == "look_at_obj_in_light"
    return {
        "task_type": task_type,
        "scene": {"scene_num": int(scene) if scene.isdigit() else scene},
        "pddl_params": {
            "object_target": none(obj),
            "object_sliced": "Sliced" in obj,
            "mrecep_target": none(mrecep),
            "parent_target": "" if look else none(target),
            "toggle_target": none(target) if look else "",
        },
    }


def _is_solvable(game_file: Path) -> bool:
    """Reads only the file's tail: `solvable` comes after the large pddl fields in ALFWorld game files."""
    with open(game_file, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 16384))
        tail = f.read().decode("utf-8", "replace")
    match = _SOLVABLE.search(tail)
    if match is None:   # unusual layout: parse the whole file
        with open(game_file) as f:
            return bool(json.load(f).get("solvable", False))
    return match.group(1) == "true"


def game_set_digest(game_root: str | os.PathLike, split: str) -> str:
    """sha256 over a split's game files: for each, in game_trials' order, its path under the split and its
    own sha256."""
    root = Path(game_root) / split
    digest = hashlib.sha256()
    for _, trial in game_trials(game_root, split):
        with open(trial / GAME_FILE, "rb") as f:
            file_digest = hashlib.file_digest(f, "sha256").hexdigest()
        digest.update(f"{(trial / GAME_FILE).relative_to(root).as_posix()}\0{file_digest}\n".encode())
    return digest.hexdigest()


def check_game_set(game_root: str | os.PathLike, expected: dict[str, str]) -> None:
    """Raise GameSetChecksumError unless every split of `expected` that the game set holds has that digest and
    it holds at least one of them."""
    root = Path(game_root)
    held = [split for split in expected if (root / split).is_dir()]
    if not held:
        raise GameSetChecksumError(f"ALFWorld: the downloaded game set at {root} holds none of the splits "
                                   f"{', '.join(expected)}")
    for split in held:
        got = game_set_digest(root, split)
        if got != expected[split]:
            raise GameSetChecksumError(f"ALFWorld: the downloaded game set's {split} split is not the expected one "
                                       f"(sha256 of its games {got}, expected {expected[split]})")


def build_metadata(game_root: str | os.PathLike) -> dict[str, list[str]]:
    """Write traj_data.json for every game lacking one and index.json (solvable game ids per split)."""
    root = Path(game_root)
    index: dict[str, list[str]] = {}
    for split in [s for s in DATA_SPLITS if (root / s).is_dir()]:
        index[split] = []
        for game_dir, trial in game_trials(root, split):
            try:
                traj = traj_data_for(game_dir.name)
            except ValueError:
                continue
            traj_file = trial / "traj_data.json"
            if not traj_file.exists():
                traj_file.write_text(json.dumps(traj))
            if not skipped(game_dir.name) and _is_solvable(trial / GAME_FILE):
                index[split].append(f"{split}/{game_dir.name}/{trial.name}")
    write_atomically(root / "index.json", json.dumps(index))   # written last: its presence marks a prepared game set
    return index


def _unpack(archive: str, dest: Path) -> None:
    """Unpack into a temporary directory beside the destination, then move the game set into place, so
    an interrupted run never leaves a half game set that looks complete."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".unpack-") as tmp:
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(tmp, filter="data")
        unpacked = Path(tmp) / GAME_SET
        if not unpacked.is_dir():
            raise RuntimeError(f"{archive} holds no {GAME_SET}/ directory: is it the ALFWorld game set?")
        target = dest / GAME_SET
        if target.exists():
            shutil.rmtree(target)
        unpacked.rename(target)


class GameSetChecksumError(webshop_data.DownloadError):
    """A downloaded game set's games are not the expected ones (the set was not kept)."""


def _alfworld_download() -> str | None:
    """ALFWorld's download script: beside this Python (the venv's bin/, which `make` does not put on PATH),
    else on PATH."""
    beside = Path(sys.executable).parent / "alfworld-download"
    return str(beside) if beside.is_file() else shutil.which("alfworld-download")


def prepare_alfworld(dest: str | None = None, source: str | None = None, log=print,
                     expected_sha256: dict[str, str] | None = None) -> Path:
    """Make $ALFWORLD_DATA/json_2.1.1 ready (unpacked + metadata). Returns the game-set root. A downloaded
    game set must match `expected_sha256` (split -> `game_set_digest`; default GAME_SET_SHA256) or is removed;
    a local archive is the operator's own choice and is not checked (as WebShop's local files are not)."""
    dest_dir = Path(dest or default_data_dir())
    root = dest_dir / GAME_SET
    if (root / "index.json").is_file():
        log(f"ALFWorld: game set ready at {root}")
        return root
    start = time.time()
    if not root.is_dir():
        archive = source or default_alfworld_source()
        if archive:
            if not os.path.isfile(archive):
                raise FileNotFoundError(f"ALFWorld archive {archive} not found (set ALFWORLD_SOURCE to the "
                                        f"json_2.1.1.tar.xz path)")
            log(f"ALFWorld: unpacking {archive} into {dest_dir}")
            _unpack(archive, dest_dir)
        elif _alfworld_download():
            log("ALFWorld: no local archive ($ALFWORLD_SOURCE); running alfworld-download (needs internet, "
                "several minutes)")
            env = dict(os.environ, ALFWORLD_DATA=str(dest_dir))
            # Its progress bars and, offline, its traceback go to stderr: kept for the one-line error.
            done = subprocess.run([_alfworld_download()], env=env, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                last = next((ln.strip() for ln in reversed(done.stderr.splitlines()) if ln.strip()),
                            f"exit status {done.returncode}")
                last = last if len(last) <= 160 else last[:157] + "..."
                raise webshop_data.DownloadError(f"ALFWorld: alfworld-download failed ({last}): it needs internet "
                                                 f"(github.com); without it, {_ALFWORLD_HOW}")
            if not root.is_dir():
                raise RuntimeError(f"alfworld-download finished but {root} does not exist")
            try:
                check_game_set(root, GAME_SET_SHA256 if expected_sha256 is None else expected_sha256)
            except GameSetChecksumError as exc:
                shutil.rmtree(root)
                raise GameSetChecksumError(f"{exc}; nothing was kept. To use a game set you have checked "
                                           f"yourself, {_ALFWORLD_HOW}") from None
        else:
            raise FileNotFoundError(f"no ALFWorld game set: {_ALFWORLD_HOW}, or install alfworld "
                                    "(for alfworld-download)")
    index = build_metadata(root)
    counts = ", ".join(f"{k} {len(v)}" for k, v in index.items())
    log(f"ALFWorld: {counts} solvable games indexed in {time.time() - start:.1f}s")
    return root


def prepare_webshop(dest: str | None = None, source: str | None = None, log=print) -> str:
    """Make $WEBSHOP_DATA hold the catalog: a copy of `source` / $WEBSHOP_SOURCE, else the one already
    there, else the original files downloaded (from $WEBSHOP_BASE_URL when set). Returns the directory."""
    dest = dest or webshop_data.default_data_dir()
    source = source or webshop_data.default_source()
    start = time.time()
    done = webshop_data.prepare(dest, source=source, log=log)
    how = {"copied": f"copied from {source}", "kept": "already there; kept as it is",
           "downloaded": f"downloaded and checked in {time.time() - start:.1f}s"}[done]
    log(f"WebShop: catalog in {dest} ({how})")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m env_servers.data", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument("--only", choices=["alfworld", "webshop"], default=None)
    args = parser.parse_args(argv)
    status = 0
    for name, step in (("alfworld", prepare_alfworld), ("webshop", prepare_webshop)):
        if args.only not in (None, name):
            continue
        try:
            step()
        except (FileNotFoundError, webshop_data.DownloadError) as exc:
            # One line per data set that could not be had; the other is still prepared.
            print(f"{parser.prog}: {exc}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
