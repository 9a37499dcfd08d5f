"""torch.compile never compiles inside a timed run: the warm-up meets every shape and mode the runs meet, and each
run's record counts the graphs compiled during it and the frames left to eager. The default tests do this on the
GPU's path with aot_eager (tests/test_standin.py: dynamo's guards, graph breaks and recompiles are the same whatever
backend compiles the graphs); the slow test here compiles with inductor on the CPU, as the recipes do."""
import json

import pytest
import torch

import cifar10_fast as cf
from conftest import synthetic_npz

TINY = ["--device", "cpu", "--width", "0.0625", "--batch-size", "64", "--epochs", "3"]


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    return synthetic_npz(tmp_path_factory, 256, 96)


def recompiles(npz, out, recipe, *flags):
    torch._dynamo.reset()
    assert cf.main(["--recipe", recipe, "--compile", "default", "--runs", "2", "--data-dir", str(npz), *TINY,
                    *flags, "--out", str(out)]) == 0
    return [run["recompiles"] for run in json.loads(out.read_text())["runs"]]


@pytest.mark.slow
def test_with_inductor_the_low_resolution_recipe_compiles_nothing_inside_a_timed_run(npz, tmp_path):
    assert recompiles(npz, tmp_path / "r.json", "fast94_next_lowres") == [0, 0]
