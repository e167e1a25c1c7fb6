"""A lock's keys cover the code a variant runs: its module and the project modules it imports,
transitively. Where files live, what they say to readers and files the variant does not import are
not part of the key; any edit to code it imports is."""

import os
import textwrap

import pytest

from workbench import lock


def _write(root, path, source):
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(textwrap.dedent(source))
    return full


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A project tree: point package `p` with variant `v` that runs kernel module `k`."""
    root = str(tmp_path)
    monkeypatch.setattr(lock, "ROOT", root)
    files = {
        "init": _write(root, "workbench/variants/p/__init__.py", '"""Point p."""\nLIMIT = 4\n'),
        "variant": _write(root, "workbench/variants/p/v.py", '''\
            """Variant v."""
            from workbench.registry import register
            from workbench.variants.kernels import k

            V_CONFIGS = [dict(BLOCK=64)]


            def run(x):
                return k.scale(x)
            '''),
        "kernels": _write(root, "workbench/variants/kernels/__init__.py", '"""Kernels."""\n'),
        "kernel": _write(root, "workbench/variants/kernels/k.py", "def scale(x):\n    return 2 * x\n"),
        "other": _write(root, "workbench/variants/kernels/other.py", "def unused():\n    return 0\n"),
    }
    return files


def test_a_variant_covers_the_modules_it_imports_and_no_other(tree):
    covered = lock._project_imports(tree["variant"])
    assert covered == [tree["kernel"]]  # not the harness (registry), the kernels package, nor other.py


def test_a_name_taken_from_a_package_covers_its_init(tree):
    variant = _write(lock.ROOT, "workbench/variants/p/w.py", "from workbench.variants.p import LIMIT\n")
    assert lock._project_imports(variant) == [tree["init"]]


def test_moved_or_commented_code_keys_the_same_and_edited_code_does_not(tree):
    files = [tree["variant"], tree["kernel"]]
    key = lock._hash_files(files)
    moved = _write(lock.ROOT, "workbench/variants/kernels/renamed.py", open(tree["kernel"]).read())
    assert lock._hash_files([tree["variant"], moved]) == key
    _write(lock.ROOT, "workbench/variants/kernels/k.py", '"""Doubles."""\n\n\ndef scale(x):  # why\n    return 2 * x\n')
    assert lock._hash_files(files) == key
    _write(lock.ROOT, "workbench/variants/kernels/k.py", "def scale(x):\n    return 3 * x\n")
    assert lock._hash_files(files) != key


def test_config_lists_count_in_the_source_hash_not_in_the_code_key(tree):
    files = [tree["variant"]]
    full, code = lock._hash_files(files), lock._hash_files(files, configs=False)
    source = open(tree["variant"]).read().replace("[dict(BLOCK=64)]", "[dict(BLOCK=64), dict(BLOCK=128)]")
    _write(lock.ROOT, "workbench/variants/p/v.py", source)
    assert lock._hash_files(files) != full
    assert lock._hash_files(files, configs=False) == code


def test_a_lock_of_the_older_key_form_is_read_but_never_verified(tmp_path):
    import yaml

    from workbench.lock import Lock, verify
    from workbench.registry import POINTS

    path = tmp_path / "lock.yaml"
    Lock(model={"preset": "beam-tiny"}, target="decode-b1", environment={},
         points={p: Lock.entry(p, "torch") for p in POINTS}, schema=1).save(str(path))
    loaded, problems = Lock.load(str(path))
    assert loaded.schema == 1 and problems == []
    found = verify(str(path), run_gates=False).problems
    assert any("lock schema 1" in p for p in found)
    doc = yaml.safe_load(path.read_text())
    doc["schema"] = 0
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(lock.LockError, match="lock schema 0"):
        Lock.load(str(path))
