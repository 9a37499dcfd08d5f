"""What a timed CIFAR-10 run does besides training: its GPU clock marks epochs without waiting and is read once; it
stops on a loss that is not finite, in one line naming the epoch, keeping the runs before; and its untimed warm-up,
a whole run, calls every compiled path the run meets, and no other, as often as CUDA-graph trees need to record it,
so that the first timed run meets nothing new."""
import json
from collections import Counter

import pytest
import torch

import cifar10_fast as cf
import cifar_data as cd
import devices
import distributed as D
import progress
import settings
import torch_backend as tb
import training as T
from conftest import fake_cuda_events, synthetic_arrays, synthetic_npz, train_once
from core import DataError

TINY = ["--width", "0.0625", "--batch-size", "32", "--epochs", "3"]


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    return synthetic_npz(tmp_path_factory, 128, 64)


def test_a_loss_that_is_not_finite_is_a_data_error_naming_the_epoch_and_the_likely_setting():
    T.check_finite_loss(2.3, epoch=1, hint="unused")
    for loss in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(DataError, match=rf"^epoch 4: the training loss is {loss}; lower --lr$"):
            T.check_finite_loss(loss, epoch=4, hint="lower --lr")


def test_a_diverging_run_exits_1_in_one_line_and_the_runs_before_it_are_kept(npz, tmp_path, monkeypatch, capsys,
                                                                             one_thread):
    real = cf.train_run

    def second_diverges(r, built, o, *, seed, **kwargs):
        return real(settings.changed(r, lr_values=(0, 1e30, 0)) if seed == 1 else r, built, o, seed=seed, **kwargs)
    monkeypatch.setattr(cf, "train_run", second_diverges)
    out = tmp_path / "r.json"
    assert cf.main(["--recipe", "fast94", "--data-dir", str(npz), *TINY, "--runs", "2", "--out", str(out)]) == 1
    error = capsys.readouterr().err.splitlines()[-1]
    assert error in (f"error: epoch 1: the training loss is {loss}; the learning rate is the likely cause "
                     "(--lr-values peaks at 1e+30)" for loss in ("nan", "inf"))
    saved = json.loads(out.read_text())
    assert [run["seed"] for run in saved["runs"]] == [0] and saved["complete"] is False


class Paths(torch.nn.Module):
    """The network, counting its calls by path: (input shape, training or not, the whitening bias trained or not)."""

    def __init__(self, net):
        super().__init__()
        self.net, self.calls = net, Counter()

    def forward(self, x):
        self.calls[tuple(x.shape), torch.is_grad_enabled(), tb.whitening_bias(self.net).param.requires_grad] += 1
        return self.net(x)


def test_the_epoch_clock_stops_before_each_evaluation_and_reads_its_rows_only_where_an_evaluation_waited(monkeypatch):
    """Epoch 1 unread (no evaluation: the GPU's clock reads later), epochs 1-2 read at epoch 2's evaluation, the
    host's printing then off the clock; the training time leaves out every evaluation, the final one is the run's
    final_eval_time, the time to target is the first evaluated epoch's total at or above it."""
    made = fake_cuda_events(monkeypatch, [0.0, 10.0, 25.0, 30.0, 40.0, 50.0, 57.0, 60.0])      # ms on the GPU
    clock = progress.EpochClock(devices.timer("cuda:0"), T.RunOptions(target=0.5, eval_every=2), accuracy="acc",
                                columns=["epoch", "train_loss", "train_acc", "acc", "epoch_time", "total_time"])
    read = []
    for epoch, acc in enumerate((None, 0.4, 0.6)):
        clock.stop(torch.tensor([6.0, 2.0 + epoch]), 4, epoch=epoch + 1)
        if clock.evaluates(epoch, last=epoch == 2):
            clock.evaluated(acc=acc)
        read.append([row["epoch"] for row in clock.rows_read()])
        clock.resume()
    assert read == [[], [1, 2], [3]] and [e.waited for e in made] == [False] * 3 + [True] + [False] * 2 + [True, False]
    assert [(row["train_loss"], row["train_acc"], row["acc"]) for row in clock.rows] == [
        (1.5, 0.5, None), (1.5, 0.75, 0.4), (1.5, 1.0, 0.6)]
    assert [row["epoch_time"] for row in clock.rows] == pytest.approx([10e-3, 15e-3, 10e-3])
    assert clock.times() == pytest.approx({"train_time": 35e-3, "final_eval_time": 7e-3, "time": 42e-3,
                                           "time_to_target": 35e-3})


def test_a_network_reset_by_a_run_trains_as_one_built_afresh(one_thread):
    """A run on the Network an earlier run trained (its whitening bias detached by then) computes what a run on a
    network built for it computes."""
    r = cf.recipe("fast94_next", width=1 / 16, batch_size=32, epochs=2, whiten_bias_epochs=1)
    data = cd.dataset_on_device(synthetic_arrays(n_train=128, n_test=64), torch.device("cpu"), dtype=torch.float32,
                        pad=r.augment.crop_pad)
    net = cf.build_network(r, torch.device("cpu"))
    train_once(r, data, net=net, seed=1)
    again, fresh = train_once(r, data, net=net, seed=2), train_once(r, data, seed=2)
    assert [row["train_loss"] for row in again["rows"]] == [row["train_loss"] for row in fresh["rows"]]
    assert again["final_acc"] == fresh["final_acc"]


def test_the_warm_up_calls_each_path_three_times_where_torch_compile_captures_cuda_graphs_else_once():
    assert [T.warmup_calls(mode) for mode in (None, "default", "reduce-overhead", "max-autotune")] == [1, 1, 3, 3]


def warm_and_timed_paths(r, arrays, calls, **options):
    """(Counter of the paths the warm-up calls, Counter of those a timed run then calls) of recipe r on the CPU,
    through Paths."""
    ctx, device = D.Context(device="cpu"), torch.device("cpu")
    data = cd.dataset_on_device(arrays, device, dtype=torch.float32, pad=r.augment.crop_pad,
                                stats=cd.channel_stats(arrays["train_images"]))
    torch.manual_seed(0)
    net = tb.build_model(r, device)
    forward = Paths(net)
    built = cf.Built(data=data, network=cf.Network(module=net, train_forward=forward, eval_forward=forward, recipe=r))
    cf.warmup(r, built, cf.Options(**options), ctx=ctx, calls=calls)
    warm, forward.calls = forward.calls, Counter()
    cf.train_run(r, built, cf.Options(**options), ctx=ctx, seed=0)
    return warm, forward.calls


def test_the_warm_up_calls_every_path_a_timed_run_meets_and_no_other_as_often_as_cuda_graph_trees_need(one_thread):
    """Each resolution and state of the whitening bias in training, each evaluation batch (plain, selective views):
    every one met in the warm-up reduce-overhead's 3 times or more, and nothing the run does not meet (the warm-up
    trained every side with the bias on and off: here a 16 px path with the bias off, which no run takes)."""
    r = cf.recipe("fast94_next_lowres", width=1 / 16, batch_size=32, epochs=3, resolution_schedule=(16,),
                  whiten_bias_epochs=1.5)
    calls = T.warmup_calls("reduce-overhead")
    warm, met = warm_and_timed_paths(r, synthetic_arrays(n_train=128, n_test=64), calls, eval_every=1)
    training = {path for path in met if path[1]}
    assert {(path[0][-1], path[2]) for path in training} == {(16, True), (32, True), (32, False)}
    assert set(warm) == set(met) and min(warm[path] for path in met) >= calls


def test_the_curriculums_warm_up_trains_the_four_paths_its_runs_train_not_six(one_thread):
    """fast94_curriculum's whitening bias trains in its first 0.19 epochs, all at 24 px: its runs train at 24 px with
    the bias on and off and at 28 and 32 px with it off. The warm-up that called each side with the bias on and off
    compiled 6 training graphs (forward and backward each), 2 of them never used."""
    r = cf.recipe("fast94_curriculum", width=1 / 16, batch_size=32)
    warm, met = warm_and_timed_paths(r, synthetic_arrays(n_train=128, n_test=64), 1, eval_every=0)
    training = {(path[0][-1], path[2]) for path in warm if path[1]}
    assert training == {(24, True), (24, False), (28, False), (32, False)} and set(warm) == set(met)


def test_the_gpu_clock_marks_without_waiting_and_reads_every_mark_waiting_for_the_last_alone(monkeypatch):
    """mark() records an event and returns; read() waits for the last event only, and gives each mark's seconds
    since the one before and the total then (an excluded mark adds nothing to it)."""
    made = fake_cuda_events(monkeypatch, [0.0, 1.0, 3.0, 3.5, 7.5])       # milliseconds on the GPU
    clock = devices.timer("cuda:0")
    keys = [clock.mark(), clock.mark(), clock.mark(include=False)]
    assert not any(e.waited for e in made) and clock.reads_later
    readings = clock.read()
    assert [e.waited for e in made] == [False, False, False, True]
    assert readings == {keys[0]: (1e-3, 1e-3), keys[1]: (2e-3, 3e-3), keys[2]: (0.5e-3, 3e-3)}
    assert clock() == pytest.approx(4e-3) and clock.total == pytest.approx(7e-3) and clock.read() == {}
    assert not devices.timer("cpu").reads_later
