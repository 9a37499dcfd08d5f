"""The kernels one epoch's augmentation launches on a GPU and the passes it makes over the epoch's images: ours (any
recipe, any epoch) and the 2-second record's loader (its own cifar10_speedrun.py in the git-ignored peers/), counted
on the CPU as CUDA runs them (under tests/cuda_standin.py; aten operations that are not views, as op_counts.Count
counts them), over 32 batches as at 50,000 images and batch 1,536 (the counts do not depend on the images' number).
"passes": the bytes the operations write, in epochs of 32 px crops in 16 bits (each pass reads about as much
as it writes; the record's 32 gathers of a batch are one pass). The record's torch.compile'd functions are counted
as graph calls (their bodies run eagerly, uncounted); --inductor compiles them on this CPU and counts the kernels
Inductor makes of each.

    python benchmarks/augment_launches.py
    python benchmarks/augment_launches.py --inductor --out results/cpu-2-cores-amd-epyc/augment_launches.json
"""
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
import cifar10_fast as cf  # noqa: E402
import cifar_data as cd  # noqa: E402
import devices  # noqa: E402
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from cuda_standin import StandIn  # noqa: E402

BATCHES = 32                    # an epoch's steps at 50,000 images and batch 1,536
BATCH = 8                       # images a batch here
RECORD = ROOT / "peers" / "cifar10-speedrun" / "cifar10_speedrun.py"
RECORD_GRAPHS = ("batch_crop", "batch_color_jitter", "batch_flip_lr")      # its torch.compile'd functions


class EpochCount(TorchDispatchMode):
    """Counts the operations that launch a kernel (not views), by name, and the bytes they write; graph(name, output)
    counts a compiled graph's call and its output's bytes. `epoch_bytes`: the bytes of one pass over the images."""

    def __init__(self, epoch_bytes):
        super().__init__()
        self.epoch_bytes, self.ops, self.graphs, self.written = epoch_bytes, Counter(), Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or "record_function" in func.__name__):
            self.ops[func.overloadpacket.__name__] += 1
            self.written += out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
        return out

    def graph(self, name, out):
        self.graphs[name] += 1
        self.written += out.numel() * out.element_size()

    def summary(self):
        return {"launches": sum(self.ops.values()), "graph_calls": sum(self.graphs.values()),
                "passes": round(self.written / self.epoch_bytes, 2), "ops": dict(self.ops), "graphs": dict(self.graphs)}


def compiled_kernels(step):
    """{"graph_calls", "kernels", "library_calls", "outside", "outside_launches", "guard_reads"}: what one call of step
    runs, seen by torch.profiler with Inductor's CPU kernels recorded (compile first, inside kernel_profile()): the
    torch.compile'd graphs called, the kernels they run (Inductor's own; library calls: matmuls and fallbacks), the
    aten operations run outside them (of which launches: not views) and those of dynamo's guards (reads of 0-d float64
    CPU tensors, which it treats as numbers; a CUDA tensor it does not read)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = dict.fromkeys(("graph_calls", "kernels", "library_calls", "outside", "outside_launches", "guard_reads"), 0)
    for e in prof.events():
        parents = []
        parent = e.cpu_parent
        while parent is not None:
            parents.append(parent.name)
            parent = parent.cpu_parent
        in_graph = parents and parents[0].startswith("## Call CompiledFxGraph")
        if e.name.startswith("## Call CompiledFxGraph"):
            counts["graph_calls"] += 1
        elif in_graph:
            counts["kernels" if "cpp_fused" in e.name else "library_calls"] += 1
        elif e.name.startswith("aten::") and not any(n.startswith(("aten::", "## Call")) for n in parents):
            guard = "TorchDynamo Cache Lookup" in parents
            counts["guard_reads" if guard else "outside"] += 1
            op = getattr(torch.ops.aten, e.name[6:])
            counts["outside_launches"] += not guard and not any(getattr(op, o).is_view for o in op.overloads())
    return counts


def kernel_profile():
    """Inductor's generated CPU kernels recorded by torch.profiler (set while a graph compiles)."""
    import torch._inductor.config
    return torch._inductor.config.patch({"cpp.enable_kernel_profile": True})


def ours(recipe, epoch, n=BATCHES * BATCH):
    """EpochCount.summary() of cifar_data.epoch_batches's epoch `epoch` of recipe (a name), consumed whole, as CUDA
    runs it (its compute dtype and channels_last)."""
    r = cf.recipe(recipe)
    with StandIn():
        device = torch.device("cuda")
        arrays = {"train_images": torch.zeros(n, 32, 32, 3, dtype=torch.uint8).numpy(),
                  "train_labels": (torch.arange(n) % 10).to(torch.uint8).numpy(),
                  "test_images": torch.zeros(1, 32, 32, 3, dtype=torch.uint8).numpy(),
                  "test_labels": torch.zeros(1, dtype=torch.uint8).numpy()}
        data = cd.dataset_on_device(arrays, device, dtype=devices.compute_dtype(device), pad=r.augment.crop_pad,
                                    stats=((0.0,) * 3, (1.0,) * 3))
        g = devices.generator(device, 0)
        base = cd.flip_bits(n, g) if r.augment.flip == "alternate" else None
        with EpochCount(n * 3 * 32 * 32 * 2) as count:
            batches = list(cd.epoch_batches(data, r.augment, g, batch_size=n // BATCHES, epoch=epoch, flip_base=base))
    assert len(batches) == BATCHES
    return count.summary()


def record_module():
    """The record's file imported (step_counts.record_module), its compiled functions' eager bodies kept as
    `eager_<name>`."""
    import step_counts
    record = step_counts.record_module()
    for name in RECORD_GRAPHS:
        setattr(record, f"eager_{name}", getattr(record, name)._torchdynamo_orig_callable)
    return record


def record(epochs=3, n=BATCHES * BATCH):
    """[EpochCount.summary() of each of the record's loader's first `epochs` epochs] (its first: each run's, which
    normalises, flips and pads the images first), as CUDA runs them."""
    rec, counts = record_module(), []

    def as_graph(name):
        def call(*args, **kwargs):
            with _pop_mode_temporarily():
                out = getattr(rec, f"eager_{name}")(*args, **kwargs)
            counts[-1].graph(name, out)
            return out
        return call
    for name in RECORD_GRAPHS:
        setattr(rec, name, as_graph(name))
    with StandIn():
        loader = object.__new__(rec.CifarLoader)          # its __init__ reads its own files from disk
        images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8).to("cuda")
        loader.images = (images.half() / 255).permute(0, 3, 1, 2).to(memory_format=torch.channels_last)
        loader.labels = (torch.arange(n) % 10).to("cuda")
        import torchvision.transforms as T
        loader.normalize = T.Normalize(rec.CIFAR_MEAN, rec.CIFAR_STD)
        loader.proc_images, loader.epoch, loader.batch_size, loader.drop_last, loader.shuffle = {}, 0, n // BATCHES, \
            True, True
        loader.aug = {"flip": True, "translate": 2,          # its main()'s
                      "color_jitter": {"enabled": True, "brightness_range": 0.1399, "contrast_range": 0.1308}}
        loader._indices = torch.empty(n, dtype=torch.long, device="cuda")
        for _ in range(epochs):
            counts.append(EpochCount(n * 3 * 32 * 32 * 2))
            with counts[-1]:
                assert len(list(loader)) == BATCHES
    return [c.summary() for c in counts]


def record_graph_kernels():
    """{name: compiled_kernels of one call} of the record's two per-epoch compiled functions, compiled by
    Inductor on this CPU (its fused kernels, and its library calls: the random seeds)."""
    rec = record_module()
    x = torch.randn(BATCHES * BATCH, 3, 36, 36).half().to(memory_format=torch.channels_last)
    calls = {"batch_crop": lambda: rec.batch_crop(x, 32),
             "batch_color_jitter": lambda: rec.batch_color_jitter(x[..., :32, :32], 0.1399, 0.1308)}
    counted = {}
    with kernel_profile():
        for name, call in calls.items():
            call()
            counted[name] = compiled_kernels(call)
    return counted


def measure(inductor=False):
    rows = [{"side": recipe, "epoch": epoch, "side_px": cf.recipe(recipe).augment.resolution(epoch, 32),
             **ours(recipe, epoch)} for recipe, epoch in (("fast94_next", 0), ("fast94_next", 1),
                                                           ("fast94_curriculum", 0), ("fast94_curriculum", 3),
                                                           ("myrtle24", 0))]
    rows += [{"side": "record", "epoch": epoch, "side_px": 32, **c} for epoch, c in enumerate(record())]
    return {"rows": rows, "record_graph_kernels": record_graph_kernels() if inductor else None}


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inductor", action="store_true", help="also compile the record's functions and count their "
                                                           "kernels (about a minute)")
    p.add_argument("--out", default=None, help="write the counts as JSON")
    args = p.parse_args(argv)
    result = measure(args.inductor)
    print("one epoch's augmentation as CUDA runs it: kernel launches outside compiled graphs, compiled-graph calls, "
          "passes over the images")
    for row in result["rows"]:
        print(f"{row['side']:18s} epoch {row['epoch']} ({row['side_px']} px): {row['launches']:3d} launches, "
              f"{row['graph_calls']} graph calls, {row['passes']} passes  {row['ops']}")
    for name, counts in (result["record_graph_kernels"] or {}).items():
        print(f"record's {name}, compiled by Inductor on this CPU: {counts['kernels']} fused kernel(s), "
              f"{counts['library_calls']} library call(s) a call")
    if args.out:
        import machine
        write_json(args.out, {"piece": "augment_launches", **result,
                              "command": "python benchmarks/augment_launches.py" + " --inductor" * args.inductor,
                              "fingerprint": machine.fingerprint(torch.device("cpu"), True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
