"""A stand-in for the 2-second record's cifar10_speedrun.py (hiverge/cifar10-speedrun) on the CPU, for a harness
that imports it and drives its main(run, model): CifarLoader reading ./cifar10/{train,test}.pt, CifarNet (its
compile() only noted), evaluate(model, loader, tta_level) and main(run, model) -> (val_acc, tta_val_acc, seconds),
its clock CUDA events from its whitening to the end of its TTA evaluation, as the real one's. It trains little.
It reads its own source through sys.argv[0] as it loads, as the real one does."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

with open(sys.argv[0]) as f:
    code = f.read()
MEAN, STD = torch.tensor((0.49, 0.48, 0.45)).view(1, 3, 1, 1), torch.tensor((0.25, 0.24, 0.26)).view(1, 3, 1, 1)


class CifarLoader:
    def __init__(self, path, train=True, batch_size=64):
        data = torch.load(f"{path}/{'train' if train else 'test'}.pt", weights_only=True)
        self.images = (data["images"].float() / 255).permute(0, 3, 1, 2).cuda()
        self.labels = data["labels"].cuda()
        self.batch_size = batch_size

    def normalize(self, x):
        return (x - MEAN.to(x.device)) / STD.to(x.device)


class CifarNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3 * 4 * 4, 10)
        self.compiled_mode = None

    def compile(self, mode=None):
        self.compiled_mode = mode

    def reset(self):
        self.head.reset_parameters()

    def forward(self, x, whiten_bias_grad=True):
        return self.head(F.adaptive_avg_pool2d(x, 4).flatten(1))


def evaluate(model, loader, tta_level=0):
    with torch.no_grad():
        x = loader.normalize(loader.images)
        logits = model(x) + (model(x.flip(-1)) if tta_level else 0)
    return (logits.argmax(1) == loader.labels).float().mean().item()


def main(run, model):
    test_loader, train_loader = CifarLoader("cifar10", train=False), CifarLoader("cifar10", train=True)
    if run == "warmup":
        train_loader.images = torch.randn_like(train_loader.images)
    model.reset()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    starter, ender = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    starter.record()
    images = train_loader.normalize(train_loader.images)
    for i in torch.randperm(len(images), device=images.device).split(train_loader.batch_size):
        F.cross_entropy(model(images[i]), train_loader.labels[i]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tta_val_acc = evaluate(model, test_loader, tta_level=2)
    ender.record()
    torch.cuda.synchronize()
    val_acc = evaluate(model, test_loader, tta_level=0)
    return val_acc, tta_val_acc, 1e-3 * starter.elapsed_time(ender)
