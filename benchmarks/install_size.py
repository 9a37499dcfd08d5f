"""What a fresh environment downloads and installs for PyTorch, from each build: torch and torchvision at the versions
installed here, the default build from PyPI (CUDA's) and the CPU build from PyTorch's CPU index (as README's Set up
says to install it on a machine without a GPU), their dependencies included. Downloaded: the wheels' bytes;
installed: the new environment's site-packages less an empty one's.

    python benchmarks/install_size.py --out results/<machine>/install_size.json
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def folder_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and not f.is_symlink())


def site_packages(env):
    return next(Path(env).glob("lib/python*/site-packages"))


def measure(tmp, build, packages):
    """{"build", "downloaded bytes", "installed bytes", "wheels"} of one build in a new environment under tmp."""
    env, wheels = Path(tmp) / f"env-{build}", Path(tmp) / f"wheels-{build}"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    empty = folder_bytes(site_packages(env))
    pip = [str(env / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    index = ["--index-url", CPU_INDEX] if build == "cpu" else []
    subprocess.run([*pip, "download", *packages, *index, "-d", str(wheels)], check=True)
    subprocess.run([*pip, "install", "--no-index", "--find-links", str(wheels), *packages], check=True)
    return {"build": build, "downloaded bytes": folder_bytes(wheels),
            "installed bytes": folder_bytes(site_packages(env)) - empty,
            "wheels": sorted(f.name for f in wheels.iterdir())}


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the result as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    import torch
    import torchvision
    version = lambda v: v.split("+")[0]
    packages = [f"torch=={version(torch.__version__)}", f"torchvision=={version(torchvision.__version__)}"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for build in ("default", "cpu"):
            try:
                rows.append(measure(tmp, build, packages))
            except subprocess.CalledProcessError as e:        # an index out of reach: said, not guessed
                rows.append({"build": build, "error": f"{e.cmd[5]} of {', '.join(packages)} failed (exit status "
                                                      f"{e.returncode})"})
    for r in rows:
        print(f"{r['build']:8s} " + (r["error"] if "error" in r
                                     else f"downloaded {r['downloaded bytes'] / 1e9:.2f} GB, "
                                          f"installed {r['installed bytes'] / 1e9:.2f} GB ({len(r['wheels'])} wheels)"))
    if args.out:
        import machine
        write_json(args.out, {"piece": "install_size", "packages": packages, "rows": rows,
                              "command": "python benchmarks/install_size.py",
                              "fingerprint": machine.fingerprint(torch.device("cpu"), True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
