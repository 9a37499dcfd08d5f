"""What a peer's build does, counted on the CPU: E1's setup() (Fulcrum Research's champion file, in peers/) run under
the CUDA stand-in (tests/cuda_standin.py) at small shapes, since what is counted depends on the kinds of its inputs
(their dtypes, layouts and the values its compiled functions specialise on), not on their sizes:

  compiles   each graph torch.compile makes of each of its compiled functions (on a GPU, each one compiled by
             inductor, max-autotune where the file asks for it), with the layout (strides) of the graph's first input:
             a backend that compiles nothing counts them, as dynamo makes them
  captures   each CUDA graph it captures (a capture runs its region once, as on a GPU; a replay runs nothing here)
  sleeps     the sleeps it asks for (skipped)

    python benchmarks/build_counts.py --out results/<machine>/build_counts.json

Its batch is cut to --batch and its data to --images random images of CIFAR-10's format, so that a step is quick on
the CPU; fp16 on the CPU is slow all the same (minutes).
"""
import argparse
import contextlib
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
import compare  # noqa: E402
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402


class Counted:
    """torch.compile with a backend that counts each graph dynamo makes and compiles nothing; CUDA graphs whose
    capture runs its region once and whose replay runs nothing, each counted."""

    def __init__(self):
        self.started, self.compiles, self.captures, self.replays = time.perf_counter(), [], 0, 0

    def backend(self, name):
        def count(gm, example_inputs):
            first = next((t for t in example_inputs if hasattr(t, "stride")), None)
            self.compiles.append({"function": name, "at_s": round(time.perf_counter() - self.started, 1),
                                  "first_input": None if first is None else {
                                      "shape": list(first.shape), "stride": list(first.stride()),
                                      "dtype": str(first.dtype)[6:]}})
            print(f"compile {len(self.compiles)}: {name} {self.compiles[-1]['first_input']}", file=sys.stderr,
                  flush=True)
            return gm.forward
        return count

    @contextlib.contextmanager
    def patched(self, torch):
        """torch.compile, torch.cuda.CUDAGraph, torch.cuda.graph and torch.load (its map_location="cuda" onto the
        stand-in) as counted here, while inside (under the stand-in)."""
        counted, real = self, {"compile": torch.compile, "load": torch.load}

        class Graph:
            def __init__(self, *args, **kwargs):
                pass

            def replay(self):
                counted.replays += 1

            def pool(self):
                return None

        @contextlib.contextmanager
        def graph(g, pool=None, **kwargs):
            counted.captures += 1
            yield

        def compile_(model=None, **options):
            if model is None:
                return lambda m: compile_(m, **options)
            kept = {k: v for k, v in options.items() if k not in ("mode", "backend")}
            return real["compile"](model, backend=self.backend(getattr(model, "__name__", type(model).__name__)),
                                   **kept)

        def load(*args, map_location=None, **kwargs):
            loaded = real["load"](*args, map_location="cpu", **kwargs)
            return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()}
        saved = {name: getattr(torch.cuda, name) for name in ("CUDAGraph", "graph")}
        torch.compile, torch.load, torch.cuda.CUDAGraph, torch.cuda.graph = compile_, load, Graph, graph
        try:
            yield
        finally:
            torch.compile, torch.load = real["compile"], real["load"]
            for name, value in saved.items():
                setattr(torch.cuda, name, value)


def e1_build(path, *, images, batch):
    """E1's first setup() counted: {"compiles", "compiles_by_function", "captures", "replays", "sleeps",
    "sleeps_s", "wall_s"}."""
    import torch
    from cuda_standin import StandIn
    counted, sleeps = Counted(), compare.Sleeps()
    with tempfile.TemporaryDirectory() as folder, StandIn():
        compare.write_airbench_layout(compare.synthetic_arrays(images, images), folder)
        with counted.patched(torch), sleeps.skipped():
            e1 = compare.import_file(path, "e1_counted")
            e1.DATA_PATH = str(Path(folder) / "cifar10")
            e1.hyp["batch_size"] = batch
            e1.setup()
    return {"compiles": counted.compiles,
            "compiles_by_function": dict(Counter(c["function"] for c in counted.compiles)),
            "captures": counted.captures, "replays": counted.replays, "sleeps": sleeps.count,
            "sleeps_s": sleeps.seconds, "wall_s": time.perf_counter() - counted.started}


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=32, help="random training (and test) images (default 32)")
    p.add_argument("--batch", type=int, default=8, help="E1's batch, cut from its 1,536 (default 8)")
    p.add_argument("--out", default=None, help="write the counts as JSON (a results/ file for benchmarks/report.py)")
    args = p.parse_args(argv)
    missing = compare.peer_missing("e1")
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    import devices
    import machine
    counts = e1_build(compare.PEERS["e1"].path, images=args.images, batch=args.batch)
    by = ", ".join(f"{name} {n}" for name, n in counts["compiles_by_function"].items())
    print(f"E1's build: {len(counts['compiles'])} graphs compiled ({by}), {counts['captures']} CUDA graphs captured, "
          f"{counts['sleeps']} sleeps of {counts['sleeps_s']:.0f} s asked for")
    if args.out:
        command = " ".join(["python benchmarks/build_counts.py", *(argv if argv is not None else sys.argv[1:])])
        write_json(args.out, {"piece": "build_counts", "side": "e1", "command": command.replace(
            f" --out {args.out}", ""), "images": args.images, "batch": args.batch,
            "fingerprint": machine.fingerprint(devices.resolve("cpu"), True), **counts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
