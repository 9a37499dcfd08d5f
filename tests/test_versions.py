"""The code's version in every record (versions.code_version): git's commit, or the file a copy carries."""
import json

import versions
from outputs import write_json


def test_a_result_records_the_commit_and_whether_the_tree_differs_from_it(tmp_path):
    import subprocess
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True)
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD").stdout.strip()
    assert versions.code_version(str(tmp_path)) == {"commit": head, "dirty": False}
    (tmp_path / "new.txt").write_text("untracked files leave the tree clean\n")
    assert versions.code_version(str(tmp_path))["dirty"] is False
    (tmp_path / "f.py").write_text("a = 2\n")
    assert versions.code_version(str(tmp_path)) == {"commit": head, "dirty": True}


def test_a_copied_tree_without_git_reads_the_version_written_where_it_was_copied_from(tmp_path):
    assert versions.code_version(str(tmp_path))["commit"] is None
    (tmp_path / versions.CODE_VERSION_FILE).write_text(json.dumps({"commit": "abc", "dirty": True}))
    assert versions.code_version(str(tmp_path)) == {"commit": "abc", "dirty": True, "from": versions.CODE_VERSION_FILE}
    write_json(tmp_path / "r.json", {"a": 1})
    assert json.loads((tmp_path / "r.json").read_text())["code"]["commit"] == versions.code_version()["commit"]
