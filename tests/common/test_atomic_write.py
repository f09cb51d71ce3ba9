"""common/atomic_write.py: a file is replaced whole or not at all, with the umask's mode, and a durable write
fsyncs the data before the rename and the directory after it. A power cut cannot be caused here: which
descriptors were fsynced, and in what order, is recorded (tests/conftest.py's `fsynced`)."""
from __future__ import annotations

import os
import stat

import pytest

from common.atomic_write import fsync_tree, replaced_atomically, write_atomically


def test_a_file_is_replaced_whole_with_the_umasks_mode(tmp_path):
    path = tmp_path / "sub" / "state.json"
    write_atomically(path, '{"a": 1}')
    write_atomically(path, b'{"a": 2}')
    assert path.read_text() == '{"a": 2}' and os.listdir(path.parent) == ["state.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), replaced_atomically(path) as tmp:
        tmp.write_text("half of the ne")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_a_durable_write_fsyncs_the_data_before_the_rename_and_the_directory_after(tmp_path, fsynced):
    path = tmp_path / "latest"
    write_atomically(path, "update_0000008", durable=True)
    data, directory = fsynced
    assert os.path.dirname(data) == str(tmp_path) and data.endswith(".tmp")      # the data, under its temp name
    assert directory == str(tmp_path)
    fsynced.clear()
    write_atomically(path, "update_0000009")
    assert fsynced == [] and path.read_text() == "update_0000009"


def test_fsync_tree_reaches_every_file_and_directory(tmp_path, fsynced):
    root = tmp_path / "update_0000008"
    (root / "zero_pp_rank_0").mkdir(parents=True)
    (root / "mp_rank_00_model_states.pt").write_bytes(b"m")
    (root / "zero_pp_rank_0" / "optim_states.pt").write_bytes(b"o")
    fsync_tree(root)
    assert set(fsynced) == {str(root / "mp_rank_00_model_states.pt"), str(root / "zero_pp_rank_0" / "optim_states.pt"),
                            str(root / "zero_pp_rank_0"), str(root), str(tmp_path)}
