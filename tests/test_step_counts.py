"""What a CIFAR-10 training step launches on a GPU, counted on the CPU (benchmarks/step_counts.py), against the
2-second record's own script counted the same way at the same batch and shapes (its figures below, measured here with
its file in the ignored peers/ by `python benchmarks/step_counts.py`, torch 2.14.1 and 2.11.0; re-measured by the
last test where peers/ holds it). Counts, not times: what each cannot see is in step_counts.py's docstring."""
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import step_counts  # noqa: E402

# The record's kernels a step outside its network's graphs: a step without Muon's renormalisation, and one with it
# (every 2 to 17 steps: 37 of its 243, step_counts.record_renormalising_steps)
RECORD_LAUNCHES = {"plain": 34, "renormalising": 61}
# Inductor's kernels (generated and extern) in the compiled forward and backward, by torch version (2.14 decomposes
# max-pooling's backward into a scatter-add, 2.11 lowers it whole): the record's, and fast94_next's as its compiled
# step runs (its weights held in bf16, its loss and step sums the graph's outputs), at or under the record's but on
# torch 2.11 in its backward, by amax's tie count.
TORCH = torch.__version__[:4]
RECORD_KERNELS = {"2.14": {"forward": 34, "backward": 39}, "2.11": {"forward": 34, "backward": 31}}
FAST94_NEXT_KERNELS = {"2.14": {"forward": 34, "backward": 39}, "2.11": {"forward": 33, "backward": 32}}
CIFAR_NETWORKS = ["myrtle24", "myrtle10", "baseline_resnet18", "fast94", "fast96", "fast94_muon", "fast94_next"]


def record_launches_a_step():
    """The record's launches a step over its run (the mean of its plain and renormalising steps)."""
    renorm = step_counts.record_renormalising_steps()
    total = step_counts.RECORD_RUN_STEPS
    return (RECORD_LAUNCHES["plain"] * (total - renorm) + RECORD_LAUNCHES["renormalising"] * renorm) / total


# fast94_next's steps 17-21 (Muon renormalising at 16 and 19): set_lr's fill of the rate, and of the flag that says
# whether a step renormalises where it changes, the epoch's sums, and the compiled optimiser step's kernels (its
# updates of the float32 masters and their bf16 copies fused in them)
OUTSIDE_THE_GRAPH = [3, 2, 3, 3, 2]
OPTIMISER_GRAPH_KERNELS = 32


def test_fast94_next_launches_no_more_kernels_a_step_outside_its_network_than_the_record(one_thread):
    """(a) From set_lr to the epoch's sums, fast94_next's step as CUDA would launch it (ATen's foreach fast paths, its
    one compiled optimiser step's Inductor kernels): outside that graph a rate filled each step, a flag where it
    changes (74 of 243 steps) and one addition to the epoch's sums; in all the record's 34 of a plain step at most,
    whether Muon renormalises or not, and one more where the flag changes (34.3 a step over the run, the record's
    38.1)."""
    steps = step_counts.recipe_steps("fast94_next", steps=21)
    assert [s.launches for s in steps[16:]] == [n + OPTIMISER_GRAPH_KERNELS for n in OUTSIDE_THE_GRAPH]
    assert all(s.by_op == {"fill_": s.launches - OPTIMISER_GRAPH_KERNELS - 1, "compiled graph": OPTIMISER_GRAPH_KERNELS,
                           "add": 1} for s in steps[16:])
    assert steps[-1].launches <= RECORD_LAUNCHES["plain"] and 34 + 74 / 243 < record_launches_a_step()


@pytest.mark.skipif(TORCH not in RECORD_KERNELS, reason=f"no counts on record for torch {TORCH}")
def test_fast94_next_compiles_all_but_convolution_backward_and_its_weights_in_bf16(one_thread):
    """(b), (c) fast94_next's compiled step at its shapes (width 1/16: the counts are width 1's), forward and
    backward: no Inductor fallback but the convolutions' backward; its kernels (torch 2.14: 34 + 39 against the
    record's 34 + 39; 2.11: 33 + 32 against 34 + 31), none of them a cast of its weights."""
    graphs = step_counts.training_graphs(*step_counts.recipe_network("fast94_next", width=1 / 16))
    assert set(graphs["forward"]["fallbacks"] + graphs["backward"]["fallbacks"]) == {"convolution_backward"}
    ours, record = {k: g["kernels"] for k, g in graphs.items()}, RECORD_KERNELS[TORCH]
    assert ours == FAST94_NEXT_KERNELS[TORCH] and ours["forward"] <= record["forward"]
    assert ours["backward"] <= record["backward"] + (TORCH == "2.11")


@pytest.mark.slow
@pytest.mark.parametrize("name", CIFAR_NETWORKS)
def test_no_cifar10_network_leaves_anything_but_convolution_backward_to_aten(name, one_thread):
    """(b) Every CIFAR-10 network (one recipe of each: ResNet-9 with and without ghost batch norm and whitening,
    ResNet-18, the three-block net of two and of three convolutions, with Muon's settings): Inductor lowers all of
    its forward and backward but the convolutions' backward."""
    graphs = step_counts.training_graphs(*step_counts.recipe_network(name, width=1 / 16, batch=16))
    assert set(graphs["forward"]["fallbacks"] + graphs["backward"]["fallbacks"]) == {"convolution_backward"}


def test_foreach_launches_follow_atens_fast_path_rules():
    """One multi-tensor kernel where dtypes, strides and a 0-d scalar's dtype match; one kernel a tensor where they
    do not; fused SGD one a group; a launch more for every 320 chunks of 65,536 elements."""
    import torch
    a = [torch.zeros(8, 4, 3, 3).to(memory_format=torch.channels_last) for _ in range(3)]
    same, contiguous = [torch.zeros_like(t) for t in a], [torch.zeros(8, 4, 3, 3) for _ in range(3)]
    half = [torch.zeros(8, 4, 3, 3, dtype=torch.float16) for _ in range(3)]
    big = [torch.zeros(320 * 65536 + 1, dtype=torch.float16) for _ in range(2)]
    with step_counts.CudaLaunches() as count:
        torch._foreach_add_(a, same, alpha=0.5)                 # 1
        torch._foreach_add_(a, contiguous)                      # 3: strides differ
        torch._foreach_add_(contiguous, half)                   # 3: dtypes differ
        torch._foreach_mul_(half, torch.tensor(0.5))            # 3: a float32 scalar on fp16 tensors
        torch._foreach_mul_(half, torch.tensor(0.5, dtype=torch.float16))       # 1
        torch._foreach_norm(same)                               # 3: zeros, the norms, their clean-up
        torch._foreach_add_(big[:1], big[1:])                   # 2
    assert count.by_op == {"_foreach_add_": 1 + 3 + 3 + 2, "_foreach_mul_": 4, "_foreach_norm": 3}


@pytest.mark.slow
@pytest.mark.skipif(not step_counts.RECORD.is_file(), reason=f"its file is missing: {step_counts.RECORD_CLONE}")
@pytest.mark.skipif(TORCH not in RECORD_KERNELS, reason=f"no counts on record for torch {TORCH}")
def test_the_records_figures_are_its_own_files(one_thread):
    """RECORD_LAUNCHES and RECORD_KERNELS, counted again from peers/cifar10-speedrun/cifar10_speedrun.py."""
    steps = step_counts.record_steps()
    assert {k: s.launches for k, s in steps.items()} == RECORD_LAUNCHES
    graphs = step_counts.training_graphs(*step_counts.record_network())
    assert {k: g["kernels"] for k, g in graphs.items()} == RECORD_KERNELS[TORCH]
    assert set(graphs["forward"]["fallbacks"] + graphs["backward"]["fallbacks"]) == {"convolution_backward"}
