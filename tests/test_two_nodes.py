"""Two nodes on one machine: two torchrun agents (--nnodes=2 --nproc-per-node=1) meeting in a c10d rendezvous on
127.0.0.1, gloo ranks, each node in a folder of its own with its own copy of the data (no shared disk). They must
train tiny ImageNet and CIFAR-10 recipes to exactly the parameters of one node running the same two ranks (the same
world and global batch), an ImageNet run even when node 1's agent is killed by SIGKILL in mid-run and the job
relaunched with --resume with the nodes in the other order, so that rank 0 sits on the node whose copy of the
checkpoint is older.

Why one node of two ranks and not one process: each rank draws its own order and crops (training.run_seeds), so
a run's parameters depend on the number of ranks by design; what must not matter is how the ranks are spread over
nodes. Every process this file starts carries a marker in its environment, and whatever is left of them at the
end is killed."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

import imagenet_store as ims
from conftest import ROOT, free_port, synthetic_npz
from imagefolders import synthetic_imagefolder
from test_distributed import killed_write

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="finds the workers in /proc")

MARK = "TWO_NODES_JOB"         # environment variable naming the job a process belongs to
TIMEOUT = 240                  # seconds a job may take, start-up included, before the test fails
EPOCHS = 12                    # the kill lands after the second checkpoint: ten epochs' margin on a loaded machine
TIMING = ("epoch_time", "total_time")
# tiny and quick: 96 images of 4 classes at 16 px, a global batch of 16: 6 steps an epoch
TINY = ["--recipe", "tiny", "--device", "cpu", "--width=4", "--batch-size=16", "--min-res=16", "--max-res=16",
        "--val-res=16", "--warmup-epochs=0.5"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("in")
    synthetic_imagefolder(root / "src", 4, 24, 8, sizes=(16, 28))
    ims.prepare(root / "src", root / "store", workers=1, log=lambda s: None)      # the JPEG store
    return root / "store"


def environment(job):
    # gloo on the loopback interface, not the one the host name resolves to
    return {**os.environ, "OMP_NUM_THREADS": "1", MARK: job, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}


def two_agents(folders, script, args, *, job):
    """One torchrun agent per folder (node), started in that order, meeting at a c10d rendezvous on loopback:
    the running agents. The rendezvous numbers the nodes by (host, agent's pid), so on one machine the first
    started is node 0, whose worker is rank 0."""
    port, agents = free_port(), []
    for n, folder in enumerate(folders):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
               f"--rdzv-conf=is_host={int(n == 0)}", "--max-restarts=0", "--monitor-interval=0.2",
               str(ROOT / script), *args]
        agents.append(subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=environment(job)))
    return agents


def one_agent(folder, script, args, *, job):
    """The same two ranks from one agent on one node (--standalone): the reference."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           str(ROOT / script), *args]
    return [subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=environment(job))]


def finished(agents, timeout=TIMEOUT):
    """[(exit status, stdout, stderr)] of each agent, waited for up to `timeout` seconds in all."""
    deadline, results = time.monotonic() + timeout, []
    for a in agents:
        out, err = a.communicate(timeout=max(1.0, deadline - time.monotonic()))
        results.append((a.returncode, out, err))
    return results


def marked(job):
    """The pids of the live processes whose environment names this job (agents and their workers)."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"{MARK}={job}".encode() in env:
            pids.append((int(p), dict(v.decode().split("=", 1) for v in env if b"=" in v)))
    return pids


@pytest.fixture
def jobs():
    """The names of the jobs a test starts (new_job adds one); every process of them still alive at the end is
    killed."""
    names = []
    yield names
    for job in names:
        for pid, _ in marked(job):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def new_job(jobs):
    """A new job's name, kept in jobs."""
    jobs.append(uuid.uuid4().hex[:12])
    return jobs[-1]


def nodes(root, data):
    """Two node folders under root, each with its own copy of data (a store folder or a file) under the same name."""
    folders = [root / "node0", root / "node1"]
    for f in folders:
        f.mkdir(parents=True)
        (shutil.copytree if data.is_dir() else shutil.copy)(data, f / data.name)
    return folders


def rows(path):
    """The rows of a run's JSON record, without their times."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in json.loads(path.read_text())["runs"][0]["rows"]]


def check_ok(results):
    for rc, out, err in results:
        assert rc == 0, err[-3000:]


def parameters(path):
    return torch.load(path, weights_only=False)["model"]


def same_parameters(a, b):
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def epoch_of(ckpt):
    return torch.load(ckpt, weights_only=False)["progress"]["epoch"]


def kill_node_1_after_two_checkpoints(agents, ckpt, stale):
    """Copies node 0's first checkpoint at ckpt to stale, then kills node 1's agent (SIGKILL) once a later one has
    replaced it, as the next epoch starts: whether it was killed before the job ended."""
    deadline, first = time.monotonic() + TIMEOUT, None
    while time.monotonic() < deadline and all(a.poll() is None for a in agents):
        if first is None and ckpt.exists():
            shutil.copy(ckpt, stale)            # an atomic write replaces the file: the copy is whole
            first = epoch_of(stale)
        elif first is not None and epoch_of(ckpt) > first:
            agents[1].kill()
            return True
        time.sleep(0.02)
    return False


def test_two_nodes_killed_and_resumed_with_rank_0_on_the_other_node_train_imagenet_as_one_node(store, tmp_path, jobs):
    """Two nodes, each keeping its own copy of the checkpoint; node 1's agent killed by SIGKILL after the second
    checkpoint (its worker ends with it); node 1's copy then an epoch behind, and a write killed midway left on node
    0; the job relaunched with --resume, node 1's agent first, so that rank 0 sits on node 1. The resumed run must
    start from node 0's newer copy, train exactly the epochs and steps left, remove the unfinished write, and end
    with every row and parameter of one node running the same two ranks uninterrupted, both copies current. (Every
    epoch of the pair ran on two nodes, so this holds both claims: two nodes train as one, and a resumed run as an
    uninterrupted one; a resume from node 1's older copy, or afresh, would give the same rows: the counts catch it.)"""
    args = ["train", "--store", "store", *TINY, "--epochs", str(EPOCHS), "--checkpoint", "ckpt.pt", "--out",
            "run.json", "--dist-timeout", "2"]
    two, one = nodes(tmp_path / "two", store), nodes(tmp_path / "one", store)[:1]
    reference, job = one_agent(one[0], "imagenet_fast.py", args, job=new_job(jobs)), new_job(jobs)
    doomed = two_agents(two, "imagenet_fast.py", args, job=job)
    stale = tmp_path / "stale.pt"
    assert kill_node_1_after_two_checkpoints(doomed, two[0] / "ckpt.pt", stale), \
        "the run ended before node 1 could be killed"
    try:        # node 1's worker ends with its agent, so node 0's loses its peer at once and its agent ends
        ends = finished(doomed, timeout=90)
    except subprocess.TimeoutExpired:
        last = epoch_of(two[0] / "ckpt.pt")
        pytest.fail(f"node 0's agent still runs 90 s after node 1's was killed; the checkpoint is at epoch {last} of "
                    f"{EPOCHS}: " + ("the run had ended before the kill took effect (a machine too loaded for the test)"
                                     if last == EPOCHS else "node 1's worker trained on without its agent"))
    check_ok(finished(reference))
    assert all(rc != 0 for rc, _, _ in ends), "the job went on without node 1"
    epoch, behind = epoch_of(two[0] / "ckpt.pt"), epoch_of(stale)
    assert 1 <= behind < epoch < EPOCHS, (behind, epoch)
    shutil.copy(stale, two[1] / "ckpt.pt")                  # node 1 missed the last checkpoint
    killed_write(two[0] / "ckpt.pt")
    (unfinished,) = (f for f in os.listdir(two[0]) if f.endswith(".tmp"))

    # relaunched with --resume, node 1's agent first: rank 0 on node 1, whose copy is older than node 0's
    results = finished(two_agents(two[::-1], "imagenet_fast.py", [*args, "--resume"], job=new_job(jobs)))
    check_ok(results)
    (_, out_0, _), (_, _, err_1) = results                 # rank 0's output (node 1), rank 1's errors (node 0)
    assert "2 ranks of 8 images per step" in out_0
    assert f"resumed from epoch {epoch} of ckpt.pt, rank 1's copy" in out_0, out_0[-2000:]
    assert f"removed what 1 unfinished write of ckpt.pt left on rank 1: {unfinished}" in err_1, err_1[-2000:]
    assert not any(f.endswith(".tmp") for n in two for f in os.listdir(n))
    assert not (two[0] / "run.json").exists()                                    # rank 0 wrote it, on node 1
    plain, resumed = (json.loads(p.read_text())["runs"][0] for p in (one[0] / "run.json", two[1] / "run.json"))
    assert (plain["resumed_from"], plain["trained_epochs"], plain["trained_steps"]) == (0, EPOCHS, EPOCHS * 6)
    # 6 steps an epoch (96 images, 16 a step): a resume an epoch early or late, or afresh, fails here
    assert (resumed["resumed_from"], resumed["trained_epochs"], resumed["trained_steps"]) == \
        (epoch, EPOCHS - epoch, (EPOCHS - epoch) * 6)
    assert rows(two[1] / "run.json") == rows(one[0] / "run.json")
    for node in two:                                         # each node's copy is current
        assert epoch_of(node / "ckpt.pt") == EPOCHS
        assert same_parameters(parameters(node / "ckpt.pt"), parameters(one[0] / "ckpt.pt"))


@pytest.fixture(scope="module")
def synth_npz(tmp_path_factory):
    return synthetic_npz(tmp_path_factory, 256, 64)


def test_two_nodes_train_cifar10_as_one_node(synth_npz, tmp_path, jobs):
    args = ["--data-dir", synth_npz.name, "--device", "cpu", "--epochs", "2", "--width", "0.125", "--batch-size",
            "64", "--out", "run.json"]
    two, one = nodes(tmp_path / "two", synth_npz), nodes(tmp_path / "one", synth_npz)[:1]
    results = finished(two_agents(two, "cifar10_fast.py", args, job=new_job(jobs)) +
                       one_agent(one[0], "cifar10_fast.py", args, job=new_job(jobs)))
    check_ok(results)
    assert "2 ranks of 32 images per step" in results[0][1]
    assert not (two[1] / "run.json").exists()
    assert rows(two[0] / "run.json") == rows(one[0] / "run.json")
