"""Provenance (workbench/provenance.py): the machine, libraries and code a result was measured with."""


def test_git_tree_names_the_files_on_disk(tmp_path):
    """`git_tree` is the commit's tree for a clean checkout, and follows an edit the commit does not
    have (the GPU host's copy of the tree, whose .git is older than its files); ignored files do not
    count. The index of the checkout is left as it was."""
    import subprocess

    from workbench.provenance import environment, git_tree

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("*.trace.json\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    clean = git("rev-parse", "HEAD^{tree}")
    assert git_tree(tmp_path) == clean
    (tmp_path / "big.trace.json").write_text("{}")
    assert git_tree(tmp_path) == clean
    (tmp_path / "a.py").write_text("x = 2\n")
    edited = git_tree(tmp_path)
    assert edited not in (None, clean) and git("status", "--porcelain", "--untracked-files=no") == "M a.py"
    git("commit", "-qam", "two")
    assert git_tree(tmp_path) == edited == git("rev-parse", "HEAD^{tree}")
    assert git_tree(tmp_path / "missing") is None
    assert len(environment()["git_tree"] or "") in (0, 40)  # None outside a git checkout
