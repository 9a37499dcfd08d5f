"""A GPU's run of a recipe with Muon holds its network's convolution and linear weights in bf16, their float32 masters
in the optimiser (optim.MasterWeights, cifar10_fast.held_weights): every number is the one a network held in float32
computes, autocast casting its weights at every step. Checked under the CUDA stand-in (tests/cuda_standin.py, whose
autocast runs in bf16 as a GPU's does) against that path, kept here as the reference (held_weights answering None)."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cifar10_fast as cf
import optim
import torch_backend as tb
import training as T
from conftest import synthetic_arrays
from cuda_standin import StandIn


@pytest.fixture
def aot_eager(monkeypatch):
    """torch.compile through dynamo's graphs with no code generation (the compiled optimiser step in seconds)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda model=None, mode=None, **kw: real(model, **{**kw, "backend": "aot_eager"}))


class Casts(TorchDispatchMode):
    """The parameters (of `params`) that operations run inside cast to bf16."""

    def __init__(self, params):
        super().__init__()
        self.params, self.cast = {p.data_ptr(): p for p in params}, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            if args[0].data_ptr() in self.params:
                self.cast.add(args[0].data_ptr())
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", ["fast94_next", "myrtle24", "baseline_resnet18"])
def test_autocast_casts_exactly_the_weights_a_gpu_run_holds_in_bf16(name, one_thread):
    """A float32 network's forward and backward under the stand-in's bf16 autocast casts every convolution's and
    linear layer's weight and bias (tb.autocast_weights) and nothing else: batch norm's scales and biases run in
    float32. (CUDA's lists agree: convolutions and linear layers among the ops autocast lowers, batch norm in
    neither list.)"""
    r = cf.recipe(name, width=1 / 16)
    net = tb.build_model(r, "cpu").train()
    with StandIn():
        net = net.to("cuda")
        x = torch.randn(4, 3, 32, 32, device="cuda")
        with Casts(net.parameters()) as casts, torch.autocast("cuda", dtype=torch.bfloat16):
            net(x).float().sum().backward()
    held = {p.data_ptr() for p in tb.autocast_weights(net)}
    assert casts.cast == held and len(held) < len(list(net.parameters()))


def run(recipe, *, held=True, runs=1, **changes):
    """train() of recipe under the stand-in, its default precision (bf16): (Result, [each step's sums, from
    training.loss_and_sums], the network's parameters' dtypes and addresses at each reset)."""
    sums, resets = [], []
    real_sums, real_reset = T.loss_and_sums, cf.Network.reset

    def reset(network, seed):
        resets.append([(p.dtype, p.data_ptr()) for p in network.module.parameters()])
        return real_reset(network, seed)
    r = cf.recipe(recipe, **{"width": 1 / 16, "batch_size": 32, "epochs": 2, **changes})
    with pytest.MonkeyPatch.context() as patch, StandIn():
        patch.setattr(T, "loss_and_sums", lambda *a, **k: sums.append(real_sums(*a, **k)) or sums[-1])
        patch.setattr(cf.Network, "reset", reset)
        if not held:
            patch.setattr(cf, "held_weights", lambda *args: None)
        result = cf.train(r, synthetic_arrays(n_train=128, n_test=64),
                          options=cf.Options(device="cuda", runs=runs, seed=5))
    return result, [s.cpu() for _, s in sums], resets


def scores_on_the_gpu(result):
    data = synthetic_arrays(n_train=128, n_test=64)
    with StandIn():
        return cf.scores(result.model.to("cuda"), data["test_images"], data["test_labels"], tta=result.recipe.tta,
                         stats=result.stats)


@pytest.mark.parametrize("recipe, changes", [
    ("fast94_next", {}),
    ("fast94_curriculum", dict(resolution_schedule=(24,), lookahead_tail_every=1, epochs=3)),
    ("fast94_next", dict(ema_momentum=0.9, ema_every=2))])
def test_weights_held_in_bf16_train_every_number_as_float32_weights_cast_by_autocast(recipe, changes, aot_eager,
                                                                                       one_thread):
    """fast94_next, its lookahead tail (fast94_curriculum) and an EMA, two runs after the warm-up's: each step's summed
    loss and correct predictions, every row and the returned network's every value equal the reference's, bit for bit;
    the network holds its convolutions and head in bf16 and batch norm in float32, each parameter at one address from
    run to run; the returned network (the masters, or their average) is float32 and scores as the reference's."""
    held, held_sums, resets = run(recipe, runs=2, **changes)
    reference, reference_sums, _ = run(recipe, held=False, runs=2, **changes)
    assert len(held_sums) == len(reference_sums) > 0
    assert all(torch.equal(a, b) for a, b in zip(held_sums, reference_sums))
    drop_times = lambda rows: [{k: v for k, v in row.items() if "time" not in k} for row in rows]
    assert all(drop_times(a["rows"]) == drop_times(b["rows"]) for a, b in zip(held.runs, reference.runs))
    ours, theirs = held.model.state_dict(), reference.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert {p.dtype for p in held.model.parameters()} == {torch.float32}
    dtypes = [d for d, _ in resets[0]]
    assert dtypes.count(torch.bfloat16) == len(tb.autocast_weights(held.model)) and torch.float32 in dtypes
    assert len(resets) == 3 and resets[1] == resets[2] == resets[0]     # the warm-up's run and two timed runs
    assert scores_on_the_gpu(held) == scores_on_the_gpu(reference)


def test_a_reset_keeps_the_parameters_and_hands_over_the_float32_initialisation(one_thread):
    """Network.reset: the held parameters keep their storage and take the fresh initialisation rounded to bf16; their
    masters are that initialisation in float32, never rounded; the whitening fit writes its filters into the master
    and their bf16 rounding into the weight; a network held in float32 has no masters."""
    r = cf.recipe("fast94_next", width=1 / 16)
    net = cf.build_network(r, torch.device("cpu"), dtype=torch.bfloat16)
    addresses = [p.data_ptr() for p in net.module.parameters()]
    masters = net.reset(3)
    torch.manual_seed(3)
    fresh = tb.build_model(r, "cpu")
    assert [p.data_ptr() for p in net.module.parameters()] == addresses
    assert len(masters) == len(tb.autocast_weights(net.module)) == 9       # the head, 7 convolutions, a bias
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())       # not rounded
    by_id = dict(zip(map(id, net.module.parameters()), fresh.parameters()))
    for held, master in masters.items():
        assert held.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(master, by_id[id(held)].detach()) and torch.equal(held, master.bfloat16())
    images = torch.randn(64, 3, 32, 32)
    tb.fit_whitening(net.module, images, 32, masters)
    white = net.module[0]
    tb.fit_whitening(fresh, images, 32)
    assert torch.equal(masters.weights([white.weight])[0], fresh[0].weight)
    assert torch.equal(white.weight, fresh[0].weight.bfloat16())
    assert not cf.build_network(r, torch.device("cpu")).reset(3)
    assert cf.held_weights(r, torch.bfloat16, distributed=True) is None        # DDP would all-reduce bf16 gradients
    assert cf.held_weights(cf.recipe("fast94"), torch.bfloat16) is None         # torch.optim.SGD keeps no masters


def test_the_optimiser_steps_the_masters_and_writes_their_bf16_copies(one_thread):
    """SGDAndMuon with masters: two steps move the masters exactly as a float32 network's parameters move with the same
    gradients (bf16 values, upcast), and leave each copy its master rounded; without Muon, make_optimizers refuses
    masters in one line."""
    r = cf.recipe("fast94_next", width=1 / 16)
    torch.manual_seed(0)
    reference = tb.build_model(r, "cpu")
    held = tb.hold_weights(copy.deepcopy(reference), torch.bfloat16)
    masters = optim.MasterWeights.of_fresh(held, copy.deepcopy(reference))
    opts = {n: optim.make_optimizers(m, r, own_rates=[tb.whitening_bias(m)], masters=w)
            for n, m, w in (("held", held, masters), ("reference", reference, None))}
    torch.manual_seed(1)
    for _ in range(2):
        for a, b in zip(held.parameters(), reference.parameters()):
            a.grad = torch.randn_like(a) if a.requires_grad else None
            b.grad = None if a.grad is None else a.grad.float()
        for opt in opts.values():
            optim.set_lr(opt, max(r.lr.values))
            opt[0].step()
            opt[0].zero_grad(set_to_none=True)
    for p, q in zip(masters.weights(list(held.parameters())), reference.parameters()):
        assert torch.equal(p, q)
    assert all(torch.equal(c, m.bfloat16()) for c, m in masters.items())
    with pytest.raises(ValueError, match=r"^make_optimizers: fast94's optimiser \(SGD\) steps its parameters "
                                         r"themselves; it keeps no float32 masters \(steps_masters\)$"):
        net = tb.build_model(cf.recipe("fast94", width=1 / 16), "cpu")
        optim.make_optimizers(net, cf.recipe("fast94"), own_rates=[tb.whitening_bias(net)], masters=masters)
