"""Which versions a run runs on: the code's, recorded in every result (code_version: git's commit, or the file a copy
without .git carries), and the installed torch and torchvision's, which must match (torchvision_mismatch). Nothing
here imports torch.
"""
import json
import os


CODE_VERSION_FILE = "code-version.json"     # beside this file, in a copy of the tree that has no .git (a GPU machine)


def code_version(root=os.path.dirname(os.path.abspath(__file__))):
    """{"commit", "dirty"} of the code at root: git's HEAD and whether tracked files differ from it; in a copy without
    .git, the CODE_VERSION_FILE written where it was copied from; {"commit": None, ...} where neither tells."""
    import subprocess
    git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode == 0:
            dirty = git("status", "--porcelain", "--untracked-files=no")
            return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(root, CODE_VERSION_FILE)) as f:
            return {**json.load(f), "from": CODE_VERSION_FILE}
    except (OSError, ValueError):
        return {"commit": None, "dirty": None, "why": "neither a git checkout nor a " + CODE_VERSION_FILE}


def torchvision_mismatch():
    """One line when the installed torchvision was built for another torch than the installed one (it then fails on
    import, "operator torchvision::nms does not exist"), from the packages' metadata alone (the torch it requires);
    None when they match, or when either is missing."""
    import re
    from importlib import metadata
    try:
        torch_version, vision_version = metadata.version("torch"), metadata.version("torchvision")
        wanted = [re.sub(r"[\s()]", "", r)[len("torch"):] for r in metadata.requires("torchvision") or ()
                  if re.fullmatch(r"torch\s*\(?\s*[=<>!~].*", r)]
    except metadata.PackageNotFoundError:
        return None
    given = lambda v: tuple(int(n) for n in re.findall(r"\d+", v.split("+")[0])[:3])
    release = lambda v: given(v) + (0,) * (3 - len(given(v)))          # 2.5 is 2.5.0
    have = release(torch_version)
    broken = {"==": lambda v: have[:len(given(v))] != given(v), ">=": lambda v: have < release(v),     # ==2.11.* too
              "<=": lambda v: have > release(v), ">": lambda v: have <= release(v), "<": lambda v: have >= release(v)}
    requirement = ",".join(wanted)
    for condition in requirement.split(",") if wanted else ():
        op = next((op for op in broken if condition.startswith(op)), None)
        if op and broken[op](condition[len(op):]):
            return (f"torchvision {vision_version} requires torch{requirement}, but torch {torch_version} is "
                    "installed: the two do not work together (importing torchvision fails); install a matching pair: "
                    "pip uninstall -y torchvision && pip install -r requirements.txt")
    return None
