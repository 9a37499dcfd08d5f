"""The alpha-beta model of how a data-parallel training step scales with the GPU count, with the 2D torus's grid it
assumes (square_grid, which distributed.py's torus all-reduce uses too), and its comparison with the published
many-GPU ImageNet runs. Pure Python arithmetic: no torch, nothing is run on a GPU.

    python scaling.py --gpus 8,64,512,2048 --step-time 0.1 --model-mb 51.2 --link-gbps 50
    python scaling.py --published                 # our model against the published figures

The model and its assumptions are written out in docs/scaling.md.
"""
import argparse
import math
import sys
from dataclasses import dataclass

from core import Parser


def square_grid(world):
    """rows x cols = world with rows <= cols as close as possible (32 x 32 for 1,024): the 2D torus's grid."""
    rows = max(r for r in range(1, math.isqrt(world) + 1) if world % r == 0)
    return rows, world // rows


def allreduce_time(nbytes, gpus, algorithm, *, link_gbps, latency_us):
    """Seconds to all-reduce nbytes over gpus, alpha-beta model (alpha = latency per step, beta = s/byte).

        ring:  2 (p - 1) alpha + 2 (p - 1) / p * n beta               (Patarasuk & Yuan 2009)
        tree:  2 ceil(log2 p) alpha + 2 n beta                          (pipelined double binary tree, as NCCL)
        torus: 2 (r + c - 2) alpha + 2 (p - 1) / p * n beta             (r x c = square_grid(p): reduce-scatter
               in rows, (c-1) alpha + (c-1)/c n beta, twice with the all-gather; ring all-reduce of n / c in
               columns, 2 (r-1) alpha + 2 (r-1)/r (n/c) beta; the bandwidth terms add up to the ring's)
    """
    if gpus == 1:
        return 0.0
    alpha, beta = latency_us * 1e-6, 8 / (link_gbps * 1e9)
    if algorithm == "ring":
        return 2 * (gpus - 1) * alpha + 2 * (gpus - 1) / gpus * nbytes * beta
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(gpus)) * alpha + 2 * nbytes * beta
    if algorithm == "torus":
        r, c = square_grid(gpus)
        return 2 * (r + c - 2) * alpha + 2 * (gpus - 1) / gpus * nbytes * beta
    raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose from ring, tree, torus")


@dataclass(frozen=True)
class Links:
    """The network between the GPUs: the slowest link's Gbit/s and latency (a node's network), and inside a node of
    gpus_per_node GPUs, intra_gbps and intra_latency_us (NVLink; None: as between nodes)."""
    link_gbps: float
    latency_us: float
    gpus_per_node: int = 1
    intra_gbps: float = None
    intra_latency_us: float = None


def simulate(gpus, links, *, step_time_s, model_bytes, algorithm="ring", buckets=4, batch_per_gpu=32,
             backward_fraction=2 / 3):
    """Projected step time, images/s and scaling efficiency (step_time_s / step) of weak-scaling data-parallel training
    on each GPU count, the gradient all-reduced in `buckets` equal buckets in turn as backward frees them, at intra_gbps
    within a node, else link_gbps (a node's network bandwidth); optimizer, stragglers, congestion and I/O ignored.
        step = F + max(B + c, B / k + k c)    (F, B: forward, backward; k buckets of c = allreduce_time each)
    """
    rows = []
    n = links
    for p in gpus:
        inside = p <= n.gpus_per_node and n.intra_gbps
        bw = n.intra_gbps if inside else n.link_gbps
        lat = (n.intra_latency_us if n.intra_latency_us is not None else n.latency_us) if inside else n.latency_us
        c = allreduce_time(model_bytes / buckets, p, algorithm, link_gbps=bw, latency_us=lat)
        backward = backward_fraction * step_time_s
        step = step_time_s - backward + max(backward + c, backward / buckets + buckets * c)
        rows.append(dict(gpus=p, algorithm=algorithm, step_s=step, comm_s=buckets * c,
                         images_per_s=p * batch_per_gpu / step, efficiency=step_time_s / step))
    return rows


# The published figures and the setup we assume for each. Step times are not measured here: they are derived
# from published throughput or assumed, and say so.
# ABCI (both V100 runs): 4 V100 per node on NVLink, 2 x 100 Gbit/s EDR InfiniBand per node
ABCI = dict(link_gbps=200.0, latency_us=10.0, gpus_per_node=4, intra_gbps=400.0, intra_latency_us=5.0, buckets=4)
PUBLISHED = [
    dict(name="Goyal et al. 2017: 8 -> 256 P100 (Caffe2, 8 per server, 50 Gbit/s Ethernet)",
         published="~90% efficiency 8 -> 256 GPUs", metric="relative_efficiency", target=0.90, base_gpus=8,
         gpus=256, step_time_s=0.232, model_bytes=25.6e6 * 4, link_gbps=50.0, latency_us=50.0,
         algorithm="tree", buckets=4, batch_per_gpu=32, gpus_per_node=8, intra_gbps=160.0, intra_latency_us=5.0,
         note="step 0.232 s = 32 images / (1.28M x 90 epochs / 29 h / 8 GPUs), derived from their 29 h on "
              "8 P100s; fp32 gradients; one 50 Gbit/s Ethernet NIC per server; tree ~ their recursive "
              "halving/doubling"),
    dict(name="Mikami et al. 2018 (Sony): 1,024 V100 on ABCI, 2D-torus",
         published="84.75% scaling efficiency", metric="efficiency", target=0.8475, gpus=1024,
         step_time_s=32 / 1000, model_bytes=25.6e6 * 2, algorithm="torus", batch_per_gpu=32, **ABCI,
         note="assumed: 1,000 images/s per V100 in fp16 (batch 32 -> 32 ms); fp16 gradients; 2 x 100 Gbit/s "
              "EDR InfiniBand per 4-GPU node"),
    dict(name="Yamazaki et al. 2019 (Fujitsu): 2,048 V100 on ABCI",
         published="1.73M images/s", metric="images_per_s", target=1.73e6, gpus=2048,
         step_time_s=40 / 1000, model_bytes=25.6e6 * 2, algorithm="tree", batch_per_gpu=40, **ABCI,
         note="assumed: 1,000 images/s per V100 in fp16 (batch 40 -> 40 ms); fp16 gradients; same network; "
              "tree all-reduce assumed (their exact algorithm not modelled)"),
]

# The recipes whose published time the model can check (imagenet_fast.RECIPES): each phase of their schedule on the
# paper's GPUs as (epochs, resolution, images per GPU), a GPU's images/s at 224 px (derived or assumed, as the rows
# above say; a step's compute in proportion to the pixels) and its network. tests/test_scaling.py holds the phases to
# the recipes'.
P100_GOYAL = dict(per_gpu_224=32 / 0.232, link_gbps=50.0, latency_us=50.0, gpus_per_node=8, intra_gbps=160.0,
                  intra_latency_us=5.0, model_bytes=25.6e6 * 4, algorithm="tree", buckets=4)
P100_AKIBA = {**P100_GOYAL, "link_gbps": 56.0, "latency_us": 10.0, "algorithm": "ring"}
V100_ABCI = dict(per_gpu_224=1000.0, model_bytes=25.6e6 * 2, algorithm="torus", **ABCI)
V100_AWS = dict(per_gpu_224=1000.0, link_gbps=25.0, latency_us=25.0, gpus_per_node=8, intra_gbps=400.0,
                intra_latency_us=5.0, model_bytes=25.6e6 * 2, algorithm="ring", buckets=4)
RECIPE_RUNS = [
    dict(recipe="goyal_8k", gpus=256, kind="P100", published="1 h", published_s=3600.0, phases=((90, 224, 32),),
         **P100_GOYAL),
    dict(recipe="akiba_32k", gpus=1024, kind="P100", published="15 min", published_s=900.0, phases=((90, 224, 32),),
         **P100_AKIBA),
    dict(recipe="mikami_68k", gpus=2176, kind="V100", published="224 s", published_s=224.0,
         phases=((5, 224, 16), (85, 224, 32)), **V100_ABCI),
    dict(recipe="mikami_122s", gpus=3456, kind="V100", published="122 s", published_s=122.0,
         phases=((5, 224, 8), (85, 224, 16)), **V100_ABCI),
    dict(recipe="yamazaki_81k", gpus=2048, kind="V100", published="74.7 s", published_s=74.7,
         phases=((90, 224, 40),), **{**V100_ABCI, "algorithm": "tree"}),
    dict(recipe="fastai_1x8", gpus=8, kind="V100", published="109:12 to 93% top-5", published_s=6552.0,
         phases=((14, 128, 512), (18, 224, 224), (3, 288, 128)), **V100_AWS),
    dict(recipe="fastai_4x8", gpus=32, kind="V100", published="29:44 to 93% top-5", published_s=1784.0,
         phases=((6, 128, 256), (7, 128, 512), (15, 224, 224), (2, 288, 128)), **V100_AWS),
    dict(recipe="fastai_8x8", gpus=64, kind="V100", published="19:04 to 93% top-5", published_s=1144.0,
         phases=((6, 128, 128), (8, 128, 256), (3, 224, 128), (12, 224, 224), (6, 288, 128)), **V100_AWS),
    dict(recipe="fastai_16x8", gpus=128, kind="V100", published="16:08 to 93% top-5", published_s=968.0,
         phases=((6, 128, 64), (10, 128, 128), (3, 224, 64), (18, 224, 192), (13, 288, 128)), **V100_AWS),
]

_SIM_ARGS = ("step_time_s", "model_bytes", "algorithm", "buckets", "batch_per_gpu")
_LINKS = ("link_gbps", "latency_us", "gpus_per_node", "intra_gbps", "intra_latency_us")


def published_metric(case, **override):
    """Our model's value of the case's published metric (efficiency, relative efficiency or images/s)."""
    case = {**case, **override}
    links = Links(**{k: case[k] for k in _LINKS if k in case})
    kw = {k: case[k] for k in _SIM_ARGS}
    row = simulate([case["gpus"]], links, **kw)[0]
    if case["metric"] == "relative_efficiency":
        return row["efficiency"] / simulate([case["base_gpus"]], links, **kw)[0]["efficiency"]
    return row[case["metric"]]


def fitted_link_gbps(case, lo=0.01, hi=1e4):
    """The link bandwidth at which the model meets the published figure (bisection on a log scale):
    how far our network assumption is from what the published number implies. None if out of range."""
    f = lambda bw: published_metric(case, link_gbps=bw) - case["target"]
    if f(lo) > 0 or f(hi) < 0:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def published_table():
    """Markdown table: published figure, our model's output with the assumed setup, and the fitted bandwidth."""
    lines = ["| run | published | model (assumed setup) | model / published "
             "| link Gbit/s: assumed, fitted to the published figure |",
             "|---|---|---|---|---|"]
    for case in PUBLISHED:
        got = published_metric(case)
        fit = fitted_link_gbps(case)
        show = ((lambda v: f"{v / 1e6:.2f}M images/s") if case["metric"] == "images_per_s"
                else (lambda v: f"{100 * v:.1f}%"))
        lines.append(f"| {case['name']} | {case['published']} | {show(got)} | {got / case['target']:.3f} | "
                     f"{case['link_gbps']:g}, {'n/a' if fit is None else f'{fit:.2f}'} |")
    return "\n".join(lines)


def recipe_time(run, images=1_281_167):
    """Seconds the model gives a recipe's whole schedule on its paper's GPUs (a RECIPE_RUNS row): the sum over its
    phases of epochs x images / simulate()'s images/s, a GPU's step taking batch / per_gpu_224 x (res / 224)^2."""
    links = Links(**{k: run[k] for k in _LINKS if k in run})
    total = 0.0
    for epochs, res, batch in run["phases"]:
        step = batch / run["per_gpu_224"] * (res / 224) ** 2
        row = simulate([run["gpus"]], links, step_time_s=step, model_bytes=run["model_bytes"],
                       algorithm=run["algorithm"], buckets=run["buckets"], batch_per_gpu=batch)[0]
        total += epochs * images / row["images_per_s"]
    return total


def recipe_table():
    """Markdown table: each recipe's published time beside the model's for its whole schedule (recipe_time)."""
    lines = ["| recipe | GPUs | published | model: the whole schedule | model / published |", "|---|---|---|---|---|"]
    for run in RECIPE_RUNS:
        t = recipe_time(run)
        lines.append(f"| `{run['recipe']}` | {run['gpus']:,} {run['kind']} | {run['published']} | {t:,.1f} s | "
                     f"{t / run['published_s']:.2f} |")
    return "\n".join(lines)


def gpu_counts(s):
    """--gpus: positive whole numbers separated by commas."""
    counts = [int(g) if g.strip().isdigit() else 0 for g in s.split(",")]
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected GPU counts of 1 or more separated by commas, e.g. 8,64")
    return counts


def within(convert, ok, why):
    """A converter for a flag whose value must pass ok, refused with `why`."""
    def check(s):
        value = convert(s)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{s!r}: {why}")
        return value
    check.__name__ = convert.__name__       # argparse names it in "invalid float value"
    return check


def positive(convert):
    """A converter for a flag that must be above 0."""
    return within(convert, lambda v: v > 0, "must be positive")


def main_simulate(argv=None):
    """The command line: print the projected scaling per GPU count, and its assumptions."""
    ap = Parser(prog="scaling.py", description=simulate.__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=gpu_counts, default="1,8,64,512,2048", help="comma-separated GPU counts")
    ap.add_argument("--step-time", type=positive(float), default=0.1,
                    help="one GPU's step time in seconds (measured or given)")
    ap.add_argument("--model-mb", type=positive(float), default=102.4,
                    help="gradient MB all-reduced per step (ResNet-50: 102.4 fp32, 51.2 fp16)")
    ap.add_argument("--link-gbps", type=positive(float), default=25.0,
                    help="Gbit/s of the slowest link (a node's network bandwidth)")
    ap.add_argument("--latency-us", type=within(float, lambda v: v >= 0, "must not be negative"), default=10.0,
                    help="latency per communication step, microseconds")
    ap.add_argument("--algorithm", default="all", choices=["ring", "tree", "torus", "all"])
    ap.add_argument("--buckets", type=positive(int), default=4)
    ap.add_argument("--batch-per-gpu", type=positive(int), default=32)
    ap.add_argument("--backward-fraction", type=within(float, lambda v: 0 <= v <= 1, "must be between 0 and 1"),
                    default=2 / 3, help="the share of a step that is backward, which communication can overlap")
    ap.add_argument("--gpus-per-node", type=positive(int), default=1)
    ap.add_argument("--intra-gbps", type=positive(float), default=None, help="Gbit/s per GPU inside a node (NVLink)")
    ap.add_argument("--epochs", type=positive(float), default=None,
                    help="also print the time to train this many epochs at the projected images/s")
    ap.add_argument("--images-per-epoch", type=positive(int), default=1_281_167,
                    help="default: ImageNet-1k's training set")
    ap.add_argument("--published", action="store_true", help="compare the model with the published figures")
    ap.add_argument("--recipes", action="store_true",
                    help="the model's time for each cluster recipe's whole schedule beside its published time")
    a = ap.parse_args(argv)
    if a.recipes:
        print(recipe_table())
        return 0
    if a.published:
        for case in PUBLISHED:
            print(f"- {case['name']}: {case['note']}; latency {case['latency_us']} us, {case['algorithm']}, "
                  f"{case['buckets']} buckets")
        print(published_table())
        return 0
    print(f"assumptions: weak scaling, {a.batch_per_gpu} images per GPU, one-GPU step {a.step_time:g} s "
          f"({100 * a.backward_fraction:.0f}% backward), {a.model_mb:g} MB of gradients in {a.buckets} buckets "
          f"overlapped with backward, {a.link_gbps:g} Gbit/s and {a.latency_us:g} us per step between GPUs"
          + (f", {a.intra_gbps:g} Gbit/s inside {a.gpus_per_node}-GPU nodes" if a.intra_gbps else "")
          + "; no optimizer, I/O, straggler or congestion cost. A model, not a measurement.")
    epochs = f"{a.epochs:g} epochs" if a.epochs else ""
    print(f"{'gpus':>6} {'algorithm':>9} {'step ms':>9} {'comm ms':>9} {'images/s':>12} {'efficiency':>10}"
          + (f" {epochs:>12}" if epochs else ""))
    for alg in (["ring", "tree", "torus"] if a.algorithm == "all" else [a.algorithm]):
        links = Links(link_gbps=a.link_gbps, latency_us=a.latency_us, gpus_per_node=a.gpus_per_node,
                      intra_gbps=a.intra_gbps)
        for r in simulate(a.gpus, links, step_time_s=a.step_time, model_bytes=a.model_mb * 1e6, algorithm=alg,
                          buckets=a.buckets, batch_per_gpu=a.batch_per_gpu, backward_fraction=a.backward_fraction):
            print(f"{r['gpus']:>6} {alg:>9} {1e3 * r['step_s']:>9.2f} {1e3 * r['comm_s']:>9.2f} "
                  f"{r['images_per_s']:>12,.0f} {100 * r['efficiency']:>9.1f}%"
                  + (f" {a.epochs * a.images_per_epoch / r['images_per_s']:>10,.1f} s" if epochs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main_simulate())
