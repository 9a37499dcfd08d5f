"""The first ImageNet run on a GPU, as one script: does the input pipeline feed a ResNet-50 and a ResNet-18? In order,
each check's figures written to --out (JSON, rewritten after every check) as soon as it ends, so a cut-off run keeps
them, and a check not begun by --budget-s recorded as skipped:

  images    a synthetic ImageFolder of ImageNet's sizes written in parallel: --images photos (25,000) of 100 classes (10
            validation images a class), longer side drawn from 340 to 500 px, 4:3 three times in five, 3:4 and square
            once each (expected mean 399 x 357 px; ImageNet's: about 400 x 350), JPEG quality 90, every fourth
            progressive
  prepare   imagenet_fast.py's JPEG store of it (imagenet_store.prepare), timed
  decoder   each decoder alone (nvJPEG through torchvision, nvImageCodec, the CPU's processes) at batch 512,
            at 160 and 224 px: images/s of imagenet_data.train_batches, as training reads them
  step      each network's step alone on batches already on the device (rn50_16ep's ResNet-50 and rn18_16ep's
            ResNet-18: BlurPool, bf16, channels_last, FFCV's batch of 512 and 1,024), images/s and its peak memory
            beside imagenet_models' estimate of it
  together  each GPU decoder feeding each step, images/s, and its share of the step alone (the goal: >= 0.95), its
            peak memory beside the estimate (the decoder's buffers counted: imagenet_models.input_bytes)
  race      the same seed's batches decoded quiet and under load (each batch feeding the step, with more work
            queued on the training stream): the batches' checksums must be equal (nvJPEG's stream bug, issues in
            docs/imagenet.md)
  sync      torch.cuda.set_sync_debug_mode("warn") over 20 steps of decoder and step together: the host waits
  train     (last: the longest) imagenet_fast.py train --recipe rn50_16ep for about 300 steps with a
            checkpoint, killed (SIGKILL) in its second epoch and relaunched with --resume: both commands' exit status
            and seconds

Beside each decoder's figures, its decode counts over that row's batches (the decoded counts of an
imagenet_data.RankData): nvJPEG's "hardware" and "software" paths (idec.nvjpeg_paths; "unknown" where nvJPEG's
library cannot be asked), or the decoder's own name ("cpu", "nvimgcodec").

Device time on one H100 or H200, estimated (not measured): a minute of start-up and writing 25,000 images on 16
cores, about 30 s to prepare, 1.5 min for the decoders, steps and together (10 rows of 13 batches at each size), 20 s
for the race and sync checks, 2 min for the 300 training steps twice started (cuDNN's warm-up in each): about 5.5 min.

What it needs beyond torch: simplejpeg, and nvImageCodec and nvJPEG's wheels for the GPU decoders (27.9 MiB for
Python 3.12 on Linux, CUDA 13):
  nvidia_nvimgcodec_cu13-0.9.0.20-py3-none-manylinux_2_28_x86_64.whl                      25,044,224 bytes
  nvidia_nvjpeg-13.3.2.43-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl          3,847,265 bytes
  simplejpeg-1.9.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl  407,547 bytes
on a machine without a network, downloaded elsewhere by
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels \\
      nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43 simplejpeg==1.9.0
and installed by `python3 -m pip install --no-index --no-deps wheels/*.whl`. A decoder whose package is missing is
recorded as such; the other checks go on.

    python benchmarks/imagenet_gpu_check.py --out check.json          # on the GPU (or the suite's tier 4)
    python benchmarks/imagenet_gpu_check.py --out check.json --budget-s 360   # no check begun after 6 minutes
    python benchmarks/imagenet_gpu_check.py --smoke --out check.json  # tiny, on the CPU under the CUDA stand-in
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import devices  # noqa: E402
import imagenet_data as idt  # noqa: E402
import imagenet_decoders as idec  # noqa: E402
import imagenet_fast as inf  # noqa: E402
import imagenet_models  # noqa: E402
import imagenet_store as ims  # noqa: E402
from core import Parser  # noqa: E402
from outputs import write_json  # noqa: E402
from imagenet_throughput import forever, rate, step  # noqa: E402

# nets: the steps' recipes, each at its own batch (FFCV's: 512, 1,024) where step_batch is None
FULL = dict(images=25000, classes=100, sides=(340, 500), batch_size=512, sizes=(160, 224), steps=10, warmup=3,
            train_steps=300, sync_steps=20, recipe="rn50_16ep", nets=("rn50_16ep", "rn18_16ep"), step_batch=None,
            changes={}, model_flags=[])
# the smoke pass: every check, tiny, under the stand-in (both ResNets replaced by the tiny network)
SMOKE = dict(images=48, classes=4, sides=(36, 48), batch_size=8, sizes=(24, 32), steps=2, warmup=1, train_steps=12,
             sync_steps=3, recipe="tiny", nets=("rn50_16ep", "rn18_16ep"), step_batch=8,
             changes={"model": "resnet_tiny", "width": 8}, model_flags=["--width", "8"])
DECODERS = ("gpu", "nvimgcodec", "cpu")
VAL_PER_CLASS = 10
SHAPES = ((4, 3), (4, 3), (4, 3), (3, 4), (1, 1))      # width : height, landscape the most, as in ImageNet


# ---------------------------------------------------------------------------------------------------- the images

def write_photos(root, split, start, stop, *, classes, sides, seed=0):
    """Writes photos start ... stop - 1 of split into root/split/c<k>/: class k = i % classes, a colour and stripes
    of its own plus noise; shape SHAPES[i % 5], its longer side drawn uniformly from sides (low, high); JPEG quality
    90, progressive every fourth. Returns [(width, height)] of the photos."""
    rng = np.random.default_rng([seed, start, split == "val"])
    palette = np.random.default_rng(seed).integers(30, 226, (classes, 3))
    shapes = []
    for i in range(start, stop):
        k, (a, b), side = i % classes, SHAPES[i % len(SHAPES)], int(rng.integers(sides[0], sides[1] + 1))
        w, h = (side, side * b // a) if a >= b else (side * a // b, side)
        shapes.append((w, h))
        stripes = (np.arange(w) // (2 + k % 5) % 2 * 40 - 20)[None, :, None]
        x = palette[k] + stripes + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
        folder = Path(root) / split / f"c{k:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(x.clip(0, 255).astype(np.uint8)).save(folder / f"{i:06d}.JPEG", quality=90,
                                                              progressive=i % 4 == 3)
    return shapes


def write_images(root, *, images, classes, sides, workers):
    """The synthetic ImageFolder at root, written by `workers` processes: (its path, the training photos' mean width
    and height)."""
    parts = [("train", a, min(a + 500, images)) for a in range(0, images, 500)]
    parts += [("val", a, min(a + 500, classes * VAL_PER_CLASS)) for a in range(0, classes * VAL_PER_CLASS, 500)]
    with ProcessPoolExecutor(workers) as pool:
        futures = [(split, pool.submit(write_photos, root, split, a, z, classes=classes, sides=sides))
                   for split, a, z in parts]
        train = np.array([wh for split, f in futures for wh in f.result() if split == "train"])
    return Path(root), tuple(float(m) for m in train.mean(axis=0))


# ---------------------------------------------------------------------------------------------------- the checks

def decode_counts(data, before):
    """The images data decoded since its counts were `before` (a copy of data.decoded), by path: {path: images}."""
    return {path: n - before.get(path, 0) for path, n in data.decoded.items() if n > before.get(path, 0)}


def batches(data, r, *, res, batch_size, device, dtype, seed=0):
    """Endless training batches of the store, from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return forever(lambda: idt.train_batches(data, r.augment, idt.draw_epoch(data, r.augment, gen), res=res,
                                             batch_size=batch_size, device=device, dtype=dtype))


def placed(store, device, decoder, workers):
    """The store placed for a decoder, or the one line saying why that decoder cannot run here."""
    try:
        return idt.rank_data(store, device, decoder=idec.jpeg_decoder(device, decoder), workers=workers), None
    except (ValueError, ImportError) as e:
        return None, str(e)


def model(r, classes, device):
    net = inf.imagenet_network(r, classes).to(device, memory_format=devices.memory_format(device))
    return net, inf.imagenet_optimizer(net, r)


def peak_memory(device, smoke):
    """The most memory torch's allocator held on the GPU since the last reset, in bytes (None under the stand-in)."""
    return None if smoke else torch.cuda.max_memory_allocated(device)


def check_decoders(store, r, cfg, *, device, dtype, workers):
    """Each decoder alone at each size: a row each (images/s, or why it did not run)."""
    rows = []
    timing = dict(device=device, warmup=cfg["warmup"], steps=cfg["steps"], batch_size=cfg["batch_size"])
    for decoder in DECODERS:
        data, why = placed(store, device, decoder, workers)
        for res in cfg["sizes"]:
            row = {"check": "decoder", "decoder": decoder, "res": res, "batch": cfg["batch_size"]}
            if data is None:
                row["error"] = why
            else:
                before = dict(data.decoded)
                row["images_per_s"] = rate(batches(data, r, res=res, batch_size=cfg["batch_size"], device=device,
                                                   dtype=dtype), lambda x, y: None, **timing)
                row["decode_counts"] = decode_counts(data, before)
            rows.append(row)
    return rows


def check_step_and_together(store, nets, cfg, *, device, dtype, workers, classes, smoke):
    """Each network's step alone on device tensors at each size (its images/s and peak memory), then each GPU decoder
    feeding it: a row each."""
    rows = []
    timing = dict(device=device, warmup=cfg["warmup"], steps=cfg["steps"])
    fmt, alone = devices.memory_format(device), {}
    for r in nets:
        bs = cfg["step_batch"] or r.batch_size
        for res in cfg["sizes"]:
            net, opt = model(r, classes, device)
            if not smoke:
                torch.cuda.reset_peak_memory_stats(device)
            x = torch.randn(bs, 3, res, res, device=device).to(dtype).contiguous(memory_format=fmt)
            y = torch.randint(0, classes, (bs,), device=device)
            alone[r.name, res] = rate(forever(lambda: [(x, y)]), lambda a, b: step(net, opt, a, b, device=device,
                                                                                  dtype=dtype), batch_size=bs, **timing)
            rows.append({"check": "step", "recipe": r.name, "model": r.network.model, "res": res, "batch": bs,
                         "images_per_s": alone[r.name, res], "peak_memory_bytes": peak_memory(device, smoke),
                         "estimated_bytes": estimated_memory(r, classes, bs, res, dtype=dtype, side=None)})
    for decoder in ("gpu", "nvimgcodec"):
        data, why = placed(store, device, decoder, workers)
        for r in nets:
            bs = cfg["step_batch"] or r.batch_size
            for res in cfg["sizes"]:
                row = {"check": "together", "decoder": decoder, "recipe": r.name, "model": r.network.model,
                       "res": res, "batch": bs}
                if data is None:
                    rows.append({**row, "error": why})
                    continue
                net, opt = model(r, classes, device)
                if not smoke:
                    torch.cuda.reset_peak_memory_stats(device)
                before = dict(data.decoded)
                row["images_per_s"] = rate(batches(data, r, res=res, batch_size=bs, device=device, dtype=dtype),
                                           lambda a, b: step(net, opt, a, b, device=device, dtype=dtype),
                                           batch_size=bs, **timing)
                row["of_step_alone"] = row["images_per_s"] / alone[r.name, res]
                row["decode_counts"] = decode_counts(data, before)
                row["peak_memory_bytes"] = peak_memory(device, smoke)
                row["estimated_bytes"] = estimated_memory(r, classes, bs, res, dtype=dtype, side=cfg["sides"][1])
                rows.append(row)
    return rows


def estimated_memory(r, classes, batch, res, *, dtype, side):
    """imagenet_models' estimate of a step's device memory at batch and res: the weights and optimiser state, the saved
    activations, and the input: the GPU decoder's buffers for images up to side x side (input_bytes), or (side None)
    the batch already on the device."""
    fixed, _ = imagenet_models.memory_parts(r, classes, dtype)
    saved = imagenet_models.saved_bytes_per_image(r, classes, res, dtype)
    inputs = (batch * 3 * res ** 2 * torch.empty(0, dtype=dtype).element_size() if side is None else
              imagenet_models.input_bytes(batch, res ** 2, side=side, gpu_decoder=True, dtype=dtype))
    return int(fixed + batch * saved + inputs)


def checksums(data, r, *, res, batch_size, n, device, dtype, load=None):
    """The float64 sums of the first n batches of seed 0 (read once, at the end); with load (net, opt, matrix): each
    batch then feeds a step and more work is queued on the training stream before the next is read."""
    sums = []
    for i, (x, y) in enumerate(batches(data, r, res=res, batch_size=batch_size, device=device, dtype=dtype)):
        sums.append(x.double().sum())
        if load is not None:
            net, opt, m = load
            step(net, opt, x, y, device=device, dtype=dtype)
            for _ in range(4):
                m = m @ m / m.norm()
        if i + 1 == n:
            break
    return [float(s) for s in torch.stack(sums).tolist()]


def check_race(store, r, cfg, *, device, dtype, workers, classes, smoke):
    """The same seed decoded quiet and under load, for each GPU decoder: a row each, whether the batches are equal."""
    rows = []
    res, bs, n = cfg["sizes"][0], cfg["batch_size"], cfg["steps"]
    for decoder in ("gpu", "nvimgcodec"):
        data, why = placed(store, device, decoder, workers)
        row = {"check": "race", "decoder": decoder, "res": res, "batch": bs, "batches": n}
        if data is None:
            row["error"] = why
        else:
            quiet = checksums(data, r, res=res, batch_size=bs, n=n, device=device, dtype=dtype)
            net, opt = model(r, classes, device)
            matrix = torch.randn(*(64 if smoke else 8192,) * 2, device=device, dtype=dtype)
            loaded = checksums(data, r, res=res, batch_size=bs, n=n, device=device, dtype=dtype,
                               load=(net, opt, matrix))
            row.update(equal=quiet == loaded, differing=sum(a != b for a, b in zip(quiet, loaded)))
        rows.append(row)
    return rows


def check_sync(store, r, cfg, *, device, dtype, workers, classes, standin):
    """Decoder and step together for `steps` steps with torch's sync debug mode at "warn" (under the stand-in: its
    count of the training thread's host waits): a row of how many times the host waited."""
    data, why = placed(store, device, "gpu", workers)
    steps = cfg["sync_steps"]
    row = {"check": "sync", "decoder": "gpu", "res": cfg["sizes"][0], "steps": steps}
    if data is None:
        return [{**row, "error": why}]
    net, opt = model(r, classes, device)
    feed = batches(data, r, res=cfg["sizes"][0], batch_size=cfg["batch_size"], device=device, dtype=dtype)
    step(net, opt, *next(feed), device=device, dtype=dtype)          # the first: buffers and streams set up
    before = len(standin.calls) if standin else 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if not standin:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _, (x, y) in zip(range(steps), feed):
                step(net, opt, x, y, device=device, dtype=dtype)
        finally:
            if not standin:
                torch.cuda.set_sync_debug_mode(0)
    if standin:         # the training thread's waits (the reader thread's drain and decode wait by design)
        main = threading.current_thread().name
        waits = [str(c[1]) for c, t in zip(standin.calls[before:], standin.threads[before:])
                 if c[0] == "host_wait" and t == main]
    else:
        waits = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]
    return [{**row, "host_waits": len(waits), "first_waits": waits[:5]}]


def train_args(store, cfg, epochs, *, smoke):
    """imagenet_fast.py train's arguments for the check."""
    sizes = ["--min-res", str(cfg["sizes"][0]), "--max-res", str(cfg["sizes"][-1]), "--val-res", str(cfg["sizes"][0])]
    return ["train", "--store", str(store), "--recipe", cfg["recipe"], "--epochs", str(epochs), "--batch-size",
            str(cfg["batch_size"]), *cfg["model_flags"], *(sizes if smoke else []), "--eval-every", "0",
            "--checkpoint", "ckpt.pt", "--out", "run.json"]


def killed_and_resumed(args, folder, timeout, *, smoke=False):
    """(first, resumed): `python imagenet_fast.py ARGS` (smoke: under the CUDA stand-in, tests/standin_main.py) killed
    by SIGKILL once its first checkpoint is written, then relaunched with --resume, in folder: each {"returncode",
    "seconds", "output"} (its last lines)."""
    script = [str(ROOT / "tests" / "standin_main.py")] * smoke + [str(ROOT / "imagenet_fast.py")]
    cmd, t0 = [sys.executable, *script, *args], time.time()
    with open(folder / "first.log", "w") as log:       # a file, not a pipe that a long run could fill
        proc = subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None and not (folder / "ckpt.pt").exists() and time.time() - t0 < timeout:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        returncode = proc.wait()
    first = {"returncode": returncode, "seconds": time.time() - t0,
             "output": (folder / "first.log").read_text()[-1500:]}
    t1 = time.time()
    again = subprocess.run([*cmd, "--resume"], cwd=folder, capture_output=True, text=True, timeout=2 * timeout)
    return first, {"returncode": again.returncode, "seconds": time.time() - t1,
                   "output": (again.stdout + again.stderr)[-1500:]}


def check_train(store, n_train, cfg, *, folder, smoke, timeout=240):
    """imagenet_fast.py train for about cfg["train_steps"] steps, killed by SIGKILL once the first epoch's checkpoint
    is written, then the same command with --resume: a row of each command's exit status and seconds."""
    epochs = max(2, round(cfg["train_steps"] / (n_train // cfg["batch_size"])))
    folder.mkdir(parents=True, exist_ok=True)
    args = train_args(store, cfg, epochs, smoke=smoke)
    first, resumed = killed_and_resumed(args, folder, timeout, smoke=smoke)
    resumed["resumed_line"] = next((line for line in resumed["output"].splitlines()
                                    if line.startswith("resumed from")), None)
    return [{"check": "train", "recipe": cfg["recipe"], "epochs": epochs,
             "steps": epochs * (n_train // cfg["batch_size"]), "first": first, "resumed": resumed}]


def summary(row):
    """One line of a check's row (a training check: its commands' exit status and the resumed line)."""
    shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items() if k not in ("first", "resumed")}
    if row["check"] == "train" and "first" in row:
        shown.update(first_rc=row["first"]["returncode"], resumed_rc=row["resumed"]["returncode"],
                     resumed=row["resumed"]["resumed_line"])
    return " ".join(f"{k}={v}" for k, v in shown.items())


# ---------------------------------------------------------------------------------------------------- the command

def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="every check tiny, on the CPU under the CUDA stand-in")
    p.add_argument("--images", type=int, default=None, help="training photos to write (default 25,000)")
    p.add_argument("--workers", type=int, default=None, help="processes writing, preparing and decoding on the CPU "
                                                             "(default: CPU count)")
    p.add_argument("--dir", default=None, help="where to write photos and store (default: a temporary folder)")
    p.add_argument("--out", default=None, help="the JSON result, rewritten after every check")
    p.add_argument("--budget-s", type=float, default=None, help="seconds after which no check begins (the one in "
                   "flight ends); those left are recorded as skipped (default: none)")
    args = p.parse_args(argv)
    if args.budget_s is not None and not args.budget_s > 0:
        p.error(f"--budget-s {args.budget_s:g}: must be positive")
    for flag in ("images", "workers"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    cfg["images"] = args.images or cfg["images"]
    if args.smoke:
        sys.path.insert(0, str(ROOT / "tests"))
        from cuda_standin import StandIn
        standin = StandIn()
    else:
        standin = None
        if not torch.cuda.is_available():
            print("error: the GPU check needs a CUDA GPU; use --smoke for the tiny pass on the CPU", file=sys.stderr)
            return 2
    workers = args.workers or os.cpu_count() or 1
    with standin or nullcontext(), tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        return run(args, cfg, tmp=Path(tmp), workers=workers, standin=standin, argv=argv)


def run(args, cfg, *, tmp, workers, standin, argv):
    """The checks in order, the result written after each; the exit status."""
    import machine
    from cli import environment
    started = time.time()
    device = torch.device("cuda")
    smoke, dtype = standin is not None, devices.compute_dtype(device)
    rows = []
    result = {"piece": "imagenet_gpu_check", "smoke": smoke, "command": " ".join(
        ["python benchmarks/imagenet_gpu_check.py", *(a for a in (argv or sys.argv[1:]) if a != args.out
                                                      and a != "--out")]),
        "environment": environment(device), "config": {k: v for k, v in cfg.items() if k != "model_flags"},
        "rows": rows}
    if not smoke:
        result["fingerprint"] = machine.fingerprint(device, False)
        devices.autotune(device)
    t = time.time()
    src, (width, height) = write_images(tmp / "src", images=cfg["images"], classes=cfg["classes"], sides=cfg["sides"],
                                        workers=workers)
    rows.append({"check": "images", "images": cfg["images"], "classes": cfg["classes"], "mean_width": width,
                 "mean_height": height, "seconds": time.time() - t})
    t = time.time()
    ims.prepare(src, tmp / "store", workers=workers, log=lambda s: None)
    store = ims.open_store(tmp / "store")
    rows.append({"check": "prepare", "seconds": time.time() - t, "bytes": int(store.index["train"]["bytes"])})
    save(args.out, result)
    r, classes = inf.recipe(cfg["recipe"], **({"width": 8} if smoke else {})), len(store.index["classes"])
    nets = [inf.recipe(name, **cfg["changes"]) for name in cfg["nets"]]
    common = dict(device=device, dtype=dtype, workers=workers)
    checks = (("decoder", lambda: check_decoders(store, r, cfg, **common)),
              ("step", lambda: check_step_and_together(store, nets, cfg, classes=classes, smoke=smoke, **common)),
              ("race", lambda: check_race(store, r, cfg, classes=classes, smoke=smoke, **common)),
              ("sync", lambda: check_sync(store, r, cfg, classes=classes, standin=standin, **common)),
              ("train", lambda: check_train(tmp / "store", len(store.train), cfg, folder=tmp / "train", smoke=smoke)))
    for name, check in checks:
        spent = time.time() - started
        if args.budget_s is not None and spent >= args.budget_s:
            rows.append({"check": name, "skipped": f"not begun: {spent:.0f} s spent of --budget-s {args.budget_s:g}"})
        else:
            rows += check()
        save(args.out, result)                      # after each check, so a cut-off run keeps what finished
    for row in rows:
        print(summary(row))
    return 0


def save(out, result):
    """Writes the result to out (if given), whole, replacing what an earlier check wrote."""
    if out:
        write_json(out, result)


if __name__ == "__main__":
    sys.exit(main())
