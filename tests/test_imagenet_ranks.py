"""imagenet_fast.py on 2 and 4 gloo ranks (CPU processes on loopback), each rank a node of its own: it works in
a folder of its own, so a checkpoint that rank 0 writes is on rank 0's disk alone, as on a cluster without a
shared filesystem. Each rank records which images it trained on (known by their bytes), what it holds in
memory, and what it evaluated."""
import contextlib
import datetime
import gc
import io
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed as D
import imagenet_checkpoints
import imagenet_data as idt
import imagenet_fast as inf
import imagenet_store as ims
import schedules
from conftest import ROOT, free_ports
from imagefolders import synthetic_imagefolder
from test_distributed import disk_full
from settings import changed

SIZE, CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 16, 4, 24, 8
# tiny and quick: 96 images, global batch 16, so every rank steps on 96 / world images an epoch, all of them
HP = dict(width=4, batch_size=16, min_res=SIZE, max_res=SIZE, val_res=SIZE, warmup_epochs=0.5)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("in")
    synthetic_imagefolder(root / "src", CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, sizes=(16, 28))
    ims.prepare(root / "src", root / "store", workers=1, log=lambda s: None)      # the JPEG store
    return root / "store"


def cli_args(store, epochs, *extra):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in HP.items()]
    return ["train", "--store", str(store), "--recipe", "tiny", "--device", "cpu", "--epochs", str(epochs), *flags,
            *map(str, extra)]


def worker(rank, world, ports, store, out, phases, moves, full_disk):
    """Runs each phase's command line as this rank, in node<rank + the phase's move>/ (modulo world), rank 0's disk
    full in the phases numbered in full_disk, and saves what it saw to out/rank<rank>.pt."""
    torch.set_num_threads(1)
    for r in range(world):
        os.makedirs(os.path.join(out, f"node{r}"), exist_ok=True)
    record = {"epochs": [], "placed": [], "evaluated": [], "read": {"train": set(), "val": set()}}

    real_batches, real_place, real_evaluate, real_decoded = (inf.train_batches, inf.rank_data, inf.loss_top1_top5,
                                                             idt.cpu_batches)

    def batches(data, augment, draws, **kwargs):  # one call an epoch: the store rows of the images this rank steps on
        steps = len(draws.perm) // kwargs["batch_size"]
        record["epochs"].append(data.train_rows[draws.perm[:steps * kwargs["batch_size"]]].tolist())
        yield from real_batches(data, augment, draws, **kwargs)

    def place(*args, **kwargs):              # which images this rank holds
        data = real_place(*args, **kwargs)
        record["placed"].append({"train": data.train_rows.tolist(), "val": data.val_rows.tolist()})
        return data

    def decoded(data, split, jobs, **kwargs):    # every record this rank's decoding workers read from the store
        jobs = list(jobs)
        record["read"][split].update(int(r) for job in jobs for r in job[0])
        return real_decoded(data, split, jobs, **kwargs)

    def evaluate(model, *args, **kwargs):    # how many images this rank pushes through the model, and the result
        count = [0]
        handle = model.register_forward_pre_hook(lambda m, inputs: count.__setitem__(0, count[0] + len(inputs[0])))
        result = real_evaluate(model, *args, **kwargs)
        handle.remove()
        bn = [t.clone() for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)
              for t in (m.running_mean, m.running_var)]
        record["evaluated"].append({"images": count[0], "result": result, "bn": bn,
                                    "state": {k: v.clone() for k, v in model.state_dict().items()}})
        return result

    inf.train_batches, inf.rank_data, inf.loss_top1_top5, idt.cpu_batches = batches, place, evaluate, decoded
    real_torus, record["torus"] = D.torus_allreduce_hook, []

    def torus(state, bucket):               # how many buckets each phase sent over the 2D torus
        record["torus"][-1] += 1
        return real_torus(state, bucket)
    D.torus_allreduce_hook = torus
    record["phases"] = []
    real_save = torch.save
    for k, (port, args, move) in enumerate(zip(ports, phases, moves)):
        os.chdir(os.path.join(out, f"node{(rank + move) % world}"))
        torch.save = disk_full if rank == 0 and k in full_disk else real_save
        record["torus"].append(0)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        # a group with a short timeout, so that ranks that disagree fail in a minute instead of hanging
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                rc = inf.main(args)
            except SystemExit as e:
                rc = e.code
        D.leave(D.Context(distributed=True))         # whatever main left of the group
        record["phases"].append({"rc": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()})
    torch.save = real_save
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))


def spawn(world, store, out, phases, moves=None, full_disk=()):
    mp.spawn(worker, args=(world, free_ports(len(phases)), str(store), str(out), phases, moves or [0] * len(phases),
                           full_disk), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def check_every_rank_sees_every_class(ranks, labels):
    """Each epoch: the ranks' images together are the whole training set, each once; each rank's label
    histogram is the whole set's; and each rank's order differs from one epoch to the next."""
    whole = np.bincount(labels, minlength=CLASSES) / len(labels)
    epochs = len(ranks[0]["epochs"])
    for e in range(epochs):
        seen = sorted(i for r in ranks for i in r["epochs"][e])
        assert seen == list(range(len(labels))), f"epoch {e + 1}: the ranks did not see each image once"
        for r, rec in enumerate(ranks):
            hist = np.bincount(labels[rec["epochs"][e]], minlength=CLASSES) / len(rec["epochs"][e])
            assert np.abs(hist - whole).max() <= 0.03, f"rank {r}, epoch {e + 1}: classes {hist} vs {whole}"
    for r, rec in enumerate(ranks):
        assert rec["epochs"][0] != rec["epochs"][1], f"rank {r}: the same order in two epochs"


@pytest.fixture(scope="module")
def two_ranks(store, tmp_path_factory):
    args = cli_args(store, 2, "--ema-momentum", "0.9", "--bn-stats", "last_batch")
    return spawn(2, store, tmp_path_factory.mktemp("two"), [args])


def test_two_ranks_see_every_class_in_a_new_order_each_epoch(two_ranks, store):
    assert all(r["phases"][0]["rc"] == 0 for r in two_ranks), two_ranks[0]["phases"][0]["stderr"][-2000:]
    check_every_rank_sees_every_class(two_ranks, ims.open_store(store).train.labels)


def test_a_rank_reads_only_its_share_of_the_store(two_ranks, store):
    """Each rank holds a disjoint half of the validation images and reads all of it, nothing more; of the training
    images of the memory-mapped JPEG store it reads only its shares of the epochs."""
    s = ims.open_store(store)
    (a,), (b,) = (rec["placed"] for rec in two_ranks)
    assert not set(a["val"]) & set(b["val"]) and len(a["val"]) + len(b["val"]) == len(s.val)
    for r, rec in enumerate(two_ranks):
        assert rec["read"]["val"] == set(rec["placed"][0]["val"])
        assert rec["read"]["train"] == set().union(*rec["epochs"]), r


def test_each_epoch_deals_the_ranks_new_shares_of_a_jpeg_store(two_ranks, store):
    """Every epoch the ranks' shares are new (each rank trains on other images than the epoch before) and together
    hold every training image once (check_every_rank_sees_every_class)."""
    for r, rec in enumerate(two_ranks):
        assert len(rec["epochs"]) == 2 and set(rec["epochs"][0]) != set(rec["epochs"][1]), r
    for e in range(2):
        assert not set(two_ranks[0]["epochs"][e]) & set(two_ranks[1]["epochs"][e])
    check_every_rank_sees_every_class(two_ranks, ims.open_store(store).train.labels)


def test_each_rank_evaluates_its_part_and_the_counts_add_up(two_ranks, store):
    val = len(ims.open_store(store).val)
    last = [rec["evaluated"][-1] for rec in two_ranks]
    assert sum(e["images"] for e in last) == val, [e["images"] for e in last]
    # every rank reports the whole set's figures: those of one process evaluating the same (EMA) model
    r = inf.recipe("tiny", **HP)
    model = inf.imagenet_network(r, CLASSES)
    model.load_state_dict(last[0]["state"])
    data = inf.rank_data(ims.open_store(store), torch.device("cpu"))
    single = inf.loss_top1_top5(model, data, r.validation, tta=r.validation.tta, device=torch.device("cpu"),
                          dtype=torch.float32)
    for e in last:
        loss, top1, top5 = e["result"]
        assert (top1, top5) == single[1:] and loss == pytest.approx(single[0], rel=1e-5)


def test_the_ema_model_evaluates_with_the_ranks_common_batch_norm_statistics(two_ranks):
    # --bn-stats last_batch with EMA: the averaged model's statistics are synchronised too
    for a, b in zip(*(rec["evaluated"][-1]["bn"] for rec in two_ranks)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_four_ranks_killed_and_resumed_with_the_checkpoint_on_another_ranks_disk_end_exactly_as_uninterrupted(
        store, tmp_path):
    """The uninterrupted run; the same run stopped after epoch 1 (exit 75, as a preempted job); its relaunch with
    --resume, each rank moved to the next rank's folder, so that only rank 3 finds the checkpoint, as after a requeue
    that gave rank 0 to another node: rank 3 reads it and the others receive it, and the resumed run trains exactly
    the two epochs and twelve steps left (a fresh start would give the same rows: the counts catch it)."""
    phases = [cli_args(store, 3, "--checkpoint", "a.pt", "--out", "a.json"),
              cli_args(store, 3, "--checkpoint", "b.pt", "--resume", "--interrupt-after-epoch", "1"),
              cli_args(store, 3, "--checkpoint", "b.pt", "--resume", "--out", "b.json")]
    ranks = spawn(4, store, tmp_path, phases, moves=[0, 0, 1])
    assert [[p["rc"] for p in r["phases"]] for r in ranks] == [[0, imagenet_checkpoints.INTERRUPTED, 0]] * 4, \
        [p["stderr"][-1500:] for r in ranks for p in r["phases"]]
    # the first rank of each node writes its copy: rank 0 alone here (each rank's LOCAL_RANK is its rank)
    assert [sorted(p.name for p in (tmp_path / f"node{r}").glob("*.pt")) for r in range(4)] == \
        [["a.pt", "b.pt"], ["b.pt"], [], []]
    fresh, resumed = (ranks[0]["phases"][k]["stdout"] for k in (1, 2))
    assert fresh.count("no checkpoint at b.pt on any rank: training from the start") == 1, fresh
    assert resumed.count("resumed from epoch 1 of b.pt, rank 3's copy") == 1, resumed
    a, b, stale = (torch.load(tmp_path / f"node{n}" / f"{name}.pt", weights_only=False)
                   for n, name in ((0, "a"), (1, "b"), (0, "b")))
    assert a["progress"]["epoch"] == b["progress"]["epoch"] == 3 and stale["progress"]["epoch"] == 1
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    ra, rb = (json.loads((tmp_path / f"node{n}" / f"{name}.json").read_text())["runs"][0] for n, name in ((0, "a"),
                                                                                                        (1, "b")))
    assert [(x["train_loss"], x["top1"]) for x in ra["rows"]] == [(x["train_loss"], x["top1"]) for x in rb["rows"]]
    # 6 steps an epoch (96 images, 16 a step), counted as the loop takes them; and each rank's epochs of batches
    assert [(r["resumed_from"], r["trained_epochs"], r["trained_steps"]) for r in (ra, rb)] == [(0, 3, 18), (1, 2, 12)]
    assert [len(r["epochs"]) for r in ranks] == [3 + 1 + 2] * 4
    # the uninterrupted run's three epochs: every rank saw every class, in a new order each epoch
    check_every_rank_sees_every_class([{"epochs": r["epochs"][:3]} for r in ranks],
                                      ims.open_store(store).train.labels)


def test_a_checkpoint_rank_0_cannot_write_stops_both_ranks_after_that_epoch_with_one_line(store, tmp_path):
    """Rank 0's disk is full when the first epoch's checkpoint is written: both ranks stop there (the next epoch is
    never drawn), exit status 1, rank 0 printing the one line that names the path and the error and rank 1 nothing
    (no lost peer, no timeout); nothing is left on the disk."""
    ranks = spawn(2, store, tmp_path, [cli_args(store, 3, "--checkpoint", "c.pt", "--out", "c.json")], full_disk=[0])
    (zero,), (one,) = (r["phases"] for r in ranks)
    assert (zero["rc"], one["rc"]) == (1, 1), (zero["stderr"][-1500:], one["stderr"][-1500:])
    assert zero["stderr"].strip().splitlines()[-1] == \
        "error: cannot write the checkpoint c.pt on rank 0: No space left on device (ENOSPC)", zero["stderr"]
    assert one["stderr"].strip() == "", one["stderr"]
    assert [len(r["epochs"]) for r in ranks] == [1, 1]
    assert [sorted(os.listdir(tmp_path / f"node{r}")) for r in range(2)] == [[], []]


def rank_of(pid):
    """torchrun's RANK of one of this test's imagenet_fast.py workers, from its environment (None for any other
    process, or one that is gone)."""
    try:
        if str(ROOT / "imagenet_fast.py") not in open(f"/proc/{pid}/cmdline").read():
            return None
        env = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
        return int(env["RANK"]) if "RANK" in env else None
    except (OSError, ValueError):
        return None


def torchrun(folder, store, *extra, restarts=0):
    """imagenet_fast.py train on 2 gloo ranks under torchrun, in folder; the running process."""
    folder.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", str(ROOT / "imagenet_fast.py"), *cli_args(store, 10, *extra)]
    return subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow     # the default tests kill and resume ranks in test_two_nodes and the four-rank test above
@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="finds the workers in /proc")
def test_torchrun_restarts_a_killed_worker_which_resumes_and_ends_as_if_uninterrupted(store, tmp_path, capsys):
    """README's restart: torchrun --max-restarts, one worker killed with SIGKILL after the first checkpoint; the
    new workers resume from it and end with exactly the uninterrupted run's parameters."""
    plain = torchrun(tmp_path / "a", store, "--checkpoint", "ckpt.pt")
    out, err = plain.communicate(timeout=300)
    assert plain.returncode == 0, err[-3000:]
    run = torchrun(tmp_path / "b", store, "--checkpoint", "ckpt.pt", "--resume", restarts=1)
    ckpt = tmp_path / "b" / "ckpt.pt"
    while run.poll() is None and not ckpt.exists():          # the first epoch's checkpoint
        time.sleep(0.05)
    victim = None
    while run.poll() is None and victim is None:
        victim = next((int(p) for p in os.listdir("/proc") if p.isdigit() and rank_of(int(p)) == 1), None)
    assert victim is not None, "the run ended before a worker could be killed"
    os.kill(victim, signal.SIGKILL)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert re.search(r"resumed from epoch [1-9] of ckpt.pt", out), out
    assert "Traceback" not in err, err[-3000:]               # the surviving rank said what happened in one line
    a, b = (torch.load(tmp_path / n / "ckpt.pt", weights_only=False) for n in "ab")
    assert a["progress"]["epoch"] == b["progress"]["epoch"] == 10
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # the checkpoint of 2 ranks, resumed by 1 process: refused, naming both
    os.chdir(tmp_path / "b")
    try:
        rc = inf.main(cli_args(store, 10, "--checkpoint", "ckpt.pt", "--resume"))
    finally:
        os.chdir(ROOT)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1] == "error: ckpt.pt: written by 2 ranks, resumed by 1; cannot resume", err


# --- the cluster papers' recipes, at tiny size on 2 gloo ranks ------------------------------------------------------

# the recipe as it is, shrunk to this store: the tiny network at 16 px, batch norm over groups of global batch / 4
# (2 groups a rank), and its own schedule's numbers scaled to the run: (epochs, flags)
CLASSIC = {"goyal_8k": (4, ["--batch-size", "32", "--warmup-epochs", "2", "--step-epochs", "3"]),
           "akiba_32k": (4, ["--batch-size", "32", "--rmsprop-beta-center", "1", "--rmsprop-beta-period", "2"]),
           "yamazaki_81k": (2, ["--batch-size", "32", "--warmup-epochs", "1"])}
PHASED = {"mikami_68k": (4, []), "mikami_122s": (2, ["--accumulate", "2"]), "fastai_1x8": (2, []),
          "fastai_4x8": (2, []), "fastai_8x8": (2, []), "fastai_16x8": (2, ["--accumulate", "2"])}


def shrunk_phases(name, epochs):
    """The recipe's phase table shrunk to this store: its first phase for the first half of the epochs and its last
    for the rest, at 16 and 24 px on global batches of 16 and 32, the rates scaled to those batches (Goyal et al.'s
    rule), the phases' own crops and validation (at 16 px)."""
    first, last = (schedules.phases(inf.RECIPES[name].schedule.phases)[k] for k in (0, -1))
    rows = [(a, b, res, batch, ph.lr_start * batch / ph.batch, ph.lr_end * batch / ph.batch, ph.crop_min,
             SIZE if ph.val_res else 0, int(ph.rect_val))
            for ph, (a, b, res, batch) in ((first, (0, epochs // 2, SIZE, 16)),
                                           (last, (epochs // 2, epochs, SIZE + 8, 32)))]
    return ",".join(f"{v:g}" for row in rows for v in row)


def preset_args(store, name):
    common = ["train", "--store", str(store), "--recipe", name, "--device", "cpu", "--model", "resnet_tiny", "--width",
              "4", "--bn-workers", "4", "--out", f"{name}.json"]
    if name in CLASSIC:
        epochs, flags = CLASSIC[name]
        return [*common, "--epochs", str(epochs), "--min-res", str(SIZE), "--max-res", str(SIZE), "--res-step", "8",
                "--val-res", str(SIZE), *flags]
    epochs, flags = PHASED[name]
    return [*common, "--phases", shrunk_phases(name, epochs), *flags]


NAMES = [*CLASSIC, *PHASED]


@pytest.fixture(scope="module")
def presets(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("presets")
    ranks = spawn(2, store, out, [preset_args(store, name) for name in NAMES])
    return ranks, {name: json.loads((out / "node0" / f"{name}.json").read_text()) for name in NAMES}


def test_the_cluster_recipes_train_on_two_ranks(presets):
    ranks, results = presets
    assert [[p["rc"] for p in r["phases"]] for r in ranks] == [[0] * len(NAMES)] * 2, \
        [p["stderr"][-1500:] for r in ranks for p in r["phases"]]
    for name, res in results.items():
        assert res["settings"]["model"] == "resnet_tiny" and res["environment"]["world_size"] == 2, name
        rows = res["runs"][0]["rows"]
        assert len(rows) == {**CLASSIC, **PHASED}[name][0] and all(np.isfinite(r["train_loss"]) for r in rows), name
        if len(rows) == 4:
            assert rows[-1]["train_loss"] < rows[0]["train_loss"], name


def recipe_of(res):
    """The recipe a run's JSON record ran, rebuilt from its settings (by flag name; JSON's lists back to tuples)."""
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in res["settings"].items()}
    return changed(inf.RECIPES[res["recipe"]], **settings)


def last_step_rates(res):
    """Each epoch's last rate, as the loop computes it (a row's batch: the global batch, 2 ranks'), and as the run
    recorded it."""
    r, rows = recipe_of(res), res["runs"][0]["rows"]
    return [schedules.step_lr(r, e + (s - 1) / s, row["batch"])
            for e, row in enumerate(rows) for s in [48 // (row["batch"] // 2)]], [row["lr"] for row in rows]


def test_goyal_warms_up_from_the_small_batch_rate_and_steps_down(presets):
    _, results = presets
    res = results["goyal_8k"]
    assert res["settings"]["warmup_start"] == 1 / 32 and res["settings"]["zero_init"]
    want, got = last_step_rates(res)
    assert got == pytest.approx(want)
    assert got[3] == pytest.approx(0.1 * 0.1 * 32 / 256)            # after the step at epoch 3: a tenth of the peak
    assert schedules.lr_at(recipe_of(res), 0) == pytest.approx(0.1 / 32)              # the first step: 1/32 of 0.1


def test_akiba_hands_rmsprop_over_to_sgd_on_a_slow_start_with_the_last_batchs_statistics(presets):
    ranks, results = presets
    res = results["akiba_32k"]
    s = res["settings"]
    assert (s["rmsprop"], s["lars"], s["schedule"], s["bn_stats"], s["comm_hook"]) == (True, False, "slow_start",
                                                                                       "last_batch", "fp16")
    want, got = last_step_rates(res)
    assert got == pytest.approx(want) and got[0] == pytest.approx(0.5 * 0.1 * 32 / 256)
    first, second = (rec["evaluated"][4]["bn"] for rec in ranks)       # the second phase's last evaluation
    for a, b in zip(first, second):                                    # every rank: the global batch's statistics
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_mikami_grows_the_batch_and_reduces_over_a_torus(presets):
    ranks, results = presets
    res = results["mikami_68k"]
    rows = res["runs"][0]["rows"]
    assert [r["batch"] for r in rows] == [16, 16, 32, 32]              # the global batch (each rank: 8, then 16)
    want, got = last_step_rates(res)
    assert got == pytest.approx(want)
    phase = NAMES.index("mikami_68k")
    assert all(rec["torus"][phase] > 0 for rec in ranks)               # its buckets went over the torus
    assert res["settings"]["label_smoothing"] == 0 and results["mikami_122s"]["settings"]["label_smoothing"] == 0.1


def test_micro_batches_all_reduce_once_a_step(presets):
    """mikami_122s in 2 micro-batches a step: 6 steps of 2 x 4 images, then 3 of 2 x 8, on each rank's 48 images;
    its one bucket goes over the torus once a step, after the second micro-batch (DDP's no_sync before)."""
    ranks, results = presets
    phase = NAMES.index("mikami_122s")
    assert [r["batch"] for r in results["mikami_122s"]["runs"][0]["rows"]] == [16, 32]       # global
    assert [rec["torus"][phase] for rec in ranks] == [6 + 3] * 2


def test_yamazaki_trains_with_lars_label_smoothing_and_fp16_gradients(presets):
    _, results = presets
    s = results["yamazaki_81k"]["settings"]
    assert (s["lars"], s["lars_trust"], s["label_smoothing"], s["comm_hook"], s["bn_workers"]) == (
        True, 0.001, 0.1, "fp16", 4)
    want, got = last_step_rates(results["yamazaki_81k"])
    assert got == pytest.approx(want)


@pytest.mark.parametrize("name", [n for n in PHASED if n.startswith("fastai")])
def test_fastai_tables_change_size_batch_crops_and_validation_by_phase(presets, name):
    """The shrunk table's two phases: 16 px on 8 images a rank, validated on centre crops; then 24 px on 16, crops of
    at least half the image, validated on whole images; the clock stops at top-5 93%. The table's batch is global."""
    ranks, results = presets
    res = results[name]
    rows = res["runs"][0]["rows"]
    assert [(r["res"], r["batch"]) for r in rows] == [(SIZE, 8 * len(ranks)), (SIZE + 8, 16 * len(ranks))]
    want, got = last_step_rates(res)
    assert got == pytest.approx(want)
    assert res["target"] == 0.93 and res["settings"]["target_top5"] == 0.93 and res["settings"]["zero_init"]
    assert "time to 93.00% top-5" in ranks[0]["phases"][NAMES.index(name)]["stdout"]


# --- validation at any number of ranks --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def raw_store(store):
    """The raw store of the same tree as the JPEG store."""
    ims.prepare(store.parent / "src", store.parent / "raw", ims.StoreSettings(format="raw", size=SIZE), workers=1,
                log=lambda s: None)
    return store.parent / "raw"


def validation_worker(rank, world, ports, stores, out):
    """`imagenet_fast.py train` of one epoch on each store in turn as this rank, recording what its last evaluation
    held (its validation rows), read (the records its decoding workers were given) and pushed through the model, the
    figures it returned and the weights it evaluated; saved to out/rank<rank>.pt."""
    torch.set_num_threads(1)
    gc.freeze()     # forked: what the fork server imported is not scanned by each collection (distributed.leave's two)
    seen, real_decoded, real_evaluate = [], idt.cpu_batches, inf.loss_top1_top5

    def decoded(data, split, jobs, **kwargs):
        jobs = list(jobs)
        if split == "val":
            seen[-1]["read"] += [int(r) for job in jobs for r in job[0]]
        return real_decoded(data, split, jobs, **kwargs)

    def evaluate(model, data, *args, **kwargs):
        count = [0]
        hook = model.register_forward_pre_hook(lambda m, inputs: count.__setitem__(0, count[0] + len(inputs[0])))
        seen[-1]["read"] = []
        result = real_evaluate(model, data, *args, **kwargs)
        hook.remove()
        seen[-1].update(rows=data.val_rows.tolist(), images=count[0], result=result,
                        state={k: v.clone() for k, v in model.state_dict().items()})
        return result

    idt.cpu_batches, inf.loss_top1_top5 = decoded, evaluate
    for port, store in zip(ports, stores):
        seen.append({"read": []})
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            seen[-1]["rc"] = inf.main(cli_args(store, 1, "--batch-size", 42, "--loader-workers", 1))
        seen[-1]["stderr"] = stderr.getvalue()
        D.leave(D.Context(distributed=True))
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.usefixtures("one_thread")     # conftest's: the reference evaluation's tiny network, on a shared machine
@pytest.mark.parametrize("world", [3, 6, 7])
def test_validation_counts_every_image_once_at_any_number_of_ranks(store, raw_store, tmp_path, world):
    """An epoch of training on `world` gloo ranks (a global batch of 42, which 3, 6 and 7 divide), then the final
    evaluation, of the JPEG store and of the raw one: 32 validation images, which none of 3, 6 and 7 divides. The
    ranks hold disjoint parts that cover the validation set, each reads its own part's records once and pushes each
    image through the model once (twice with the flip), and every rank returns the figures of one process evaluating
    the same weights on the whole set. The ranks are forked from a server that imported torch once: 16 spawned
    interpreters would each import it, and a fork of this process, which runs threads, could deadlock."""
    stores = [store, raw_store]
    multiprocessing.set_forkserver_preload(["imagenet_fast", "test_imagenet_ranks"])
    mp.start_processes(validation_worker, args=(world, free_ports(2), [str(s) for s in stores], str(tmp_path)),
                       nprocs=world, join=True, start_method="forkserver")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    r = inf.recipe("tiny", **HP)
    for k, path in enumerate(stores):
        runs = [rank[k] for rank in ranks]
        assert [run["rc"] for run in runs] == [0] * world, [run["stderr"][-1500:] for run in runs]
        s = ims.open_store(path)
        assert len(s.val) == 32 and len(s.val) % world
        rows = [run["rows"] for run in runs]
        assert sorted(i for part in rows for i in part) == list(range(len(s.val))), rows      # each once, all
        assert all(sorted(run["read"]) == run["rows"] for run in runs), [run["read"] for run in runs]
        views = 2 if r.validation.tta == "flip" else 1
        assert sum(run["images"] for run in runs) == views * len(s.val)
        model = inf.imagenet_network(r, CLASSES)
        model.load_state_dict(runs[0]["state"])
        data = inf.rank_data(s, torch.device("cpu"), workers=1)
        loss, top1, top5 = inf.loss_top1_top5(model, data, r.validation, tta=r.validation.tta,
                                              device=torch.device("cpu"), dtype=torch.float32)
        data.pool.shutdown()
        for run in runs:
            assert run["result"][1:] == (top1, top5) and run["result"][0] == pytest.approx(loss, rel=1e-5), path
