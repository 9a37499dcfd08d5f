"""A stand-in for the airbench package (KellerJordan/cifar10-airbench) on the CPU, for a harness that imports it: its
CifarLoader reading ./cifar10/{train,test}.pt, lib_airbench94/95/96 (hyp, make_netNN), trainNN(loader, make_net=,
verbose=) building its model and its own test loader (utils.CifarLoader) inside, and evaluate(model, loader,
tta_level). It trains little."""
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

MEAN, STD = torch.tensor((0.49, 0.48, 0.45)).view(1, 3, 1, 1), torch.tensor((0.25, 0.24, 0.26)).view(1, 3, 1, 1)


class CifarLoader:
    def __init__(self, path, train=True, batch_size=500, aug=None, altflip=False):
        data = torch.load(f"{path}/{'train' if train else 'test'}.pt", weights_only=True)
        self.images = (data["images"].float() / 255).permute(0, 3, 1, 2).cuda()
        self.labels = data["labels"].cuda()
        self.batch_size = min(batch_size, len(self.labels))

    def normalize(self, x):
        return (x - MEAN.to(x.device)) / STD.to(x.device)


def make_net():
    return nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.BatchNorm1d(48), nn.Linear(48, 10)).cuda()


def _train(loader, make_net=make_net, verbose=True):
    test_loader = utils.CifarLoader("cifar10", train=False, batch_size=2000)        # as airbench's train() loads it
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    images = loader.normalize(loader.images)
    for i in torch.randperm(len(images), device=images.device).split(loader.batch_size):
        F.cross_entropy(model(images[i]), loader.labels[i]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del test_loader
    return model


def evaluate(model, loader, tta_level=0):
    model.eval()
    with torch.no_grad():
        x = loader.normalize(loader.images)
        logits = model(x) + (model(x.flip(-1)) if tta_level else 0)
    return (logits.argmax(1) == loader.labels).float().mean().item()


utils = SimpleNamespace(CifarLoader=CifarLoader)
for _n in (94, 95, 96):
    globals()[f"lib_airbench{_n}"] = SimpleNamespace(
        hyp={"opt": {"batch_size": 1024}, "aug": {"flip": True, "translate": 2}, "net": {"tta_level": 2}},
        **{f"make_net{_n}": make_net})
    globals()[f"train{_n}"] = _train
