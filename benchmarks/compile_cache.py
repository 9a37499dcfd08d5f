"""What a shared compile cache saves: the compiled warm-up of a recipe (cifar10_fast.build with --compile: every
graph a timed run meets, compiled before its clock) timed in a fresh process with an empty inductor cache (cold) and
again in a fresh process reading the cache the first one left (warm), as the suite's pieces now share one
(benchmarks/suite.py, compile_cache; benchmarks/compare.py --cache-dir). Pairs of (cold, warm), each pair with a
cache folder of its own.

    python benchmarks/compile_cache.py --out results/<machine>/compile_cache.json
    python benchmarks/compile_cache.py --recipe fast94_next --device cuda --mode max-autotune --pairs 1
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import cache_environment  # noqa: E402
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from progress import Table  # noqa: E402
from run_statistics import summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# One fresh process: the recipe's compiled warm-up on synthetic data of the real shapes, timed; prints seconds.
CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
import cifar10_fast as cf
import distributed as D
from conftest_free import arrays
r = cf.recipe({recipe!r}, width={width})
start = time.perf_counter()
data = arrays({n}, {seed})
cf.build(r, data, cf.Options(compile={mode!r}), ctx=D.Context(device={device!r}),
         stats=cf.channel_stats(data["train_images"]))
print(json.dumps({{"seconds": time.perf_counter() - start}}))
"""
ARRAYS = """
import numpy as np
def arrays(n, seed):
    rng = np.random.default_rng(seed)
    return {"train_images": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
            "train_labels": rng.integers(0, 10, n), "test_images": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
            "test_labels": rng.integers(0, 10, n)}
"""


def warm_up_seconds(cache, *, recipe, device, mode, width, n, seed=0):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "conftest_free.py").write_text(ARRAYS)
        code = CHILD.format(root=str(ROOT), recipe=recipe, device=device, mode=mode, width=width, n=n, seed=seed)
        env = {**os.environ, "PYTHONPATH": tmp, **cache_environment(cache)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"error: the warm-up failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="fast94")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default="default", help="torch.compile mode (default: default)")
    p.add_argument("--width", type=float, default=1.0, help="the network's width multiplier (default 1: as trained)")
    p.add_argument("--images", type=int, default=2048, help="synthetic images of the real shapes (default 2048)")
    p.add_argument("--pairs", type=int, default=2, help="(cold, warm) pairs (default 2)")
    p.add_argument("--warm-seed", type=int, default=0,
                   help="the warm process's images drawn with this seed (default 0: the cold one's); another seed "
                        "asks whether a cache filled on one set of images serves another (compare.py --build-only "
                        "compiles on random images, the comparison then trains on CIFAR-10)")
    p.add_argument("--out", default=None, help="write the result as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.images < 1 or args.width <= 0:
        p.error("--pairs, --images and --width must be positive")
    cold, warm = [], []
    for i in range(args.pairs):
        with tempfile.TemporaryDirectory() as cache:
            kw = dict(recipe=args.recipe, device=args.device, mode=args.mode, width=args.width, n=args.images)
            cold.append(warm_up_seconds(cache, **kw))
            warm.append(warm_up_seconds(cache, **kw, seed=args.warm_seed))
        print(f"pair {i + 1}: cold {cold[-1]:.1f} s, warm {warm[-1]:.1f} s", file=sys.stderr)
    table = Table(["cache", "n", "mean s", "min s", "max s"], width=10, formats={k: ".1f" for k in ("mean s", "min s",
                                                                                                   "max s")})
    rows = []
    for name, xs in (("cold", cold), ("warm", warm)):
        st = summarize(xs)
        rows.append({"cache": name, "n": st["n"], "mean s": st["mean"], "min s": st["min"], "max s": st["max"],
                     "seconds": xs})
        table.append(rows[-1])
    if args.out:
        import machine
        import torch
        write_json(args.out, {"piece": "compile_cache", "command": "python benchmarks/compile_cache.py " + " ".join(
            sys.argv[1:] if argv is None else argv), "recipe": args.recipe, "device": args.device, "mode": args.mode,
            "warm_seed": args.warm_seed, "width": args.width,
            "fingerprint": machine.fingerprint(torch.device(args.device), True), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
