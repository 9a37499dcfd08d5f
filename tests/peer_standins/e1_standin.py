"""A stand-in for E1's champion file (fulcrumresearch/cifar-10-speedrun) on the CPU: the hooks its harness drives and
nothing it trains well. setup() builds once (and sleeps 60 s after, as the real one does) and, called again, resets
the model to untrained and draws its epochs' batches; train(model, extra, ctx) steps through them and calls
ctx.validate; Model.eval_forward gives logits. Data from CIFAR_DATA/{train,test}.pt, as the real one reads it.
For the tests of a harness: E1_STANDIN_EVAL_CHANGES_WEIGHTS=1 makes eval_forward change a weight (as an evaluation
that trains would), E1_STANDIN_RUNS_BEFORE_A_HANG=N makes every run after the first N hang in train() for 10 minutes."""
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

DATA_PATH = os.environ.get("CIFAR_DATA", "cifar10")
MEAN, STD = torch.tensor((0.49, 0.48, 0.45)).view(1, 3, 1, 1), torch.tensor((0.25, 0.24, 0.26)).view(1, 3, 1, 1)
_CACHE = {}


class CifarLoader:
    def __init__(self, path, train=True, batch_size=64):
        data = torch.load(os.path.join(path, "train.pt" if train else "test.pt"), weights_only=True)
        self.images = (data["images"].float() / 255).permute(0, 3, 1, 2).cuda()
        self.labels = data["labels"].cuda()
        self.batch_size, self.epoch = batch_size, 0

    def normalize(self, x):
        return (x - MEAN.to(x.device)) / STD.to(x.device)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3 * 4 * 4, 10)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(x, 4).flatten(1))

    def eval_forward(self, x):
        if os.environ.get("E1_STANDIN_EVAL_CHANGES_WEIGHTS"):
            with torch.no_grad():
                self.head.bias.add_(1e-3)
        return self.forward(x)


def epochs_of_batches(loader, epochs=2):
    images = loader.normalize(loader.images)
    order = torch.cat([torch.randperm(len(images), device=images.device) for _ in range(epochs)])
    return [(images[i], loader.labels[i]) for i in order.split(loader.batch_size)]


def setup():
    if not _CACHE:
        _CACHE["model"] = Model().cuda()
        _CACHE["train_loader"] = CifarLoader(DATA_PATH, train=True)
    model = _CACHE["model"]
    for layer in model.modules():
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    extra = {"batches": epochs_of_batches(_CACHE["train_loader"]), "total_train_steps": 0}
    time.sleep(60)
    return model, extra


def train(model, extra, ctx):
    _CACHE["runs"] = _CACHE.get("runs", 0) + 1
    if _CACHE["runs"] > int(os.environ.get("E1_STANDIN_RUNS_BEFORE_A_HANG", 1 << 30)):
        time.sleep(600)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in extra["batches"]:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ctx.validate(model, step=len(extra["batches"]))
