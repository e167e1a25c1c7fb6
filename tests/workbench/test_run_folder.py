"""The run folder (workbench/run_folder.py): JSON written whole or not at all, read back under its key."""

import json
import os

import pytest

from workbench import run_folder
from workbench.run_folder import RunFolder, read_json, resume_key, write_json


def test_a_json_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "deep" / "file.json"
    write_json(path, {"a": [1, 2]}, indent=1)  # its folder made
    assert json.loads(path.read_text()) == {"a": [1, 2]} and path.read_text().endswith("\n")

    def dies_midway(obj, f, **kw):
        f.write('{"a": [1,')
        raise KeyboardInterrupt  # as a time limit ends a run mid-write

    monkeypatch.setattr(run_folder.json, "dump", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"a": [3]})
    monkeypatch.undo()
    assert read_json(path) == {"a": [1, 2]}  # the file it had
    assert os.listdir(path.parent) == ["file.json"]  # and nothing half-written beside it
    write_json(path, {"when": object()})  # what JSON cannot hold is written as its text
    assert "object" in read_json(path)["when"]


def test_a_missing_or_broken_file_reads_as_none(tmp_path):
    assert read_json(tmp_path / "absent.json") is None
    (tmp_path / "broken.json").write_text('{"a": ')
    assert read_json(tmp_path / "broken.json") is None


def test_a_saved_file_is_reused_only_under_its_key(tmp_path):
    folder = RunFolder(str(tmp_path))
    key = resume_key({"shape": (1, 2), "step": "abc"})
    assert key == {"shape": [1, 2], "step": "abc"}  # as it reads back from the file
    folder.write(folder.PROFILE, {"key": key, "points": ["boundary"]})
    assert folder.saved(folder.PROFILE, key) == {"key": key, "points": ["boundary"]}
    assert folder.saved(folder.PROFILE, key, lambda saved: saved["points"]) == ["boundary"]
    assert folder.saved(folder.PROFILE, {**key, "step": "def"}) is None  # made for another key
    assert folder.saved(folder.PROFILE, key, lambda saved: saved["missing"]) is None  # not what the reader needs
    assert folder.saved(folder.END_TO_END, key) is None  # not made yet


def test_a_run_folders_files_have_one_place_each(tmp_path):
    folder = RunFolder(str(tmp_path))
    assert folder.path(folder.LOCK) == os.path.join(str(tmp_path), "lock.yaml")
    assert folder.search_result("experts") == os.path.join(str(tmp_path), "search", "experts.json")
    assert folder.inflight("experts") == os.path.join(str(tmp_path), "search", "experts.inflight")
