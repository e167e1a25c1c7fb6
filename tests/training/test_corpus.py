"""workbench.training.corpus: which stdlib files make the corpus, and the fixed held-out split."""

import hashlib

from workbench.training.corpus import HELD_OUT_PERCENT, corpus_files, is_held_out, split, stdlib_root


def make_tree(root, n=200):
    """A fake stdlib: n library files, plus what the corpus leaves out."""
    for i in range(n):
        path = root / f"pkg{i % 7}" / f"mod_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE_{i} = {i}\n")
    for skipped in ("site-packages/extra/mod.py", "test/test_x.py", "pkg0/tests/test_y.py",
                    "idlelib/idle_test/test_z.py", "dist-packages/d.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("SKIPPED = 1\n")
    (root / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\nX = '\xe9'\n")
    (root / "test.py").write_text("KEPT = 1\n")  # a module named test, not in a test folder
    (root / "notes.txt").write_text("not python\n")


def test_held_out_rule_is_the_documented_hash():
    for rel in ("os.py", "json/decoder.py", "asyncio/threads.py", "collections/abc.py", "mod_ü.py"):
        digest = hashlib.sha256(rel.encode("utf-8")).digest()
        assert is_held_out(rel) == (int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT)
    # Pinned: changing the rule would silently move files between training and evaluation.
    assert HELD_OUT_PERCENT == 5
    assert is_held_out("asyncio/threads.py") and is_held_out("collections/abc.py")
    assert not is_held_out("os.py") and not is_held_out("json/decoder.py")


def test_corpus_files_leave_out_packages_tests_and_non_utf8(tmp_path):
    make_tree(tmp_path)
    rels = [f.relpath for f in corpus_files(tmp_path)]
    assert rels == sorted(rels)
    assert len(rels) == 201 and "test.py" in rels
    assert not any(r.startswith(("site-packages/", "dist-packages/", "test/", "idlelib/")) or "/tests/" in r
                   for r in rels)
    assert "latin1.py" not in rels


def test_split_is_deterministic_disjoint_and_complete(tmp_path):
    make_tree(tmp_path)
    files = corpus_files(tmp_path)
    train, held = split(files)
    assert (train, held) == split(corpus_files(tmp_path))
    assert {f.relpath for f in train}.isdisjoint(f.relpath for f in held)
    assert sorted(train + held, key=lambda f: f.relpath) == files
    assert held and all(is_held_out(f.relpath) for f in held)
    assert not any(is_held_out(f.relpath) for f in train)
    # The split depends on a file's own path only: dropping other files moves nothing.
    assert split(files[::3])[1] == [f for f in held if f in files[::3]]


def test_the_real_stdlib_corpus():
    files = corpus_files()
    train, held = split(files)
    root = stdlib_root()
    assert len(files) > 100 and all(f.path.is_relative_to(root) for f in files)
    assert not any("site-packages" in f.relpath or f.relpath.startswith("test/") for f in files)
    assert 0.01 < len(held) / len(files) < 0.15
