"""The device memory a run needs, as imagenet_models counts it before anything loads: the weights and optimiser
state, the saved activations, the input buffers (the GPU decoder's: whole decoded images, padded), and validation's;
a batch that would not fit is refused in one line with these figures."""
import re

import pytest
import torch

import devices
import imagenet_fast as inf
import imagenet_models as im
from core import UsageError
from cuda_standin import StandIn


def test_the_gpu_decoders_buffers_are_its_images_decoded_padded_and_cropped():
    """512 images of up to 500 x 500 at 160 px in bf16: the batch cropped and the next decoded (uint8), the first padded
    in float16, its rows' product (160 x 500 in float16) and the crops (float32 twice, bf16 twice)."""
    n, side, res = 512, 500, 160
    assert im.input_bytes(n, res ** 2, side=side, gpu_decoder=True, dtype=torch.bfloat16) == (
        2 * 3 * n * side ** 2 + 2 * 3 * n * side ** 2 + 2 * 3 * n * res * side + (4 + 4 + 2 + 2) * 3 * n * res ** 2)
    assert im.input_bytes(n, res ** 2, side=side, gpu_decoder=True, dtype=torch.bfloat16) / 2 ** 30 == pytest.approx(
        2.099, abs=1e-3)
    assert im.input_bytes(n, res ** 2, side=side, gpu_decoder=False, dtype=torch.float32) == (
        2 * 3 * n * res ** 2 + (4 + 4 + 4 + 4) * 3 * n * res ** 2)      # the CPU's crops arrive as uint8


def test_an_evaluation_holds_more_than_its_input_and_less_than_training_saves():
    r = inf.recipe("rn50_16ep")
    held = im.eval_bytes_per_image(r, 1000, 224, torch.bfloat16)
    assert 2 * 3 * 224 ** 2 < held < im.saved_bytes_per_image(r, 1000, 224, torch.bfloat16) / 5


def test_the_need_is_the_fixed_part_and_the_worse_of_training_and_validation():
    r = inf.recipe("rn50_16ep")
    parts = im.memory_parts(r, 1000, torch.bfloat16)
    cpu, gpu = (im.memory_need(r, 1000, world=1, dtype=torch.bfloat16, parts=parts, side=500, gpu_decoder=g)
                for g in (False, True))
    res = max(p.res for p in inf.epoch_plans(r, 1))
    assert gpu.fixed == cpu.fixed == parts[0] and gpu.activations == cpu.activations == 512 * parts[1][res]
    assert gpu.inputs - cpu.inputs == (im.input_bytes(512, res ** 2, side=500, gpu_decoder=True, dtype=torch.bfloat16)
                                       - im.input_bytes(512, res ** 2, side=500, gpu_decoder=False,
                                                        dtype=torch.bfloat16))
    for need in (cpu, gpu):
        assert need.total == need.fixed + max(need.activations + need.inputs, need.validation)
    assert gpu.validation > cpu.validation > im.VAL_BATCH * im.eval_bytes_per_image(r, 1000, 256, torch.bfloat16)


def test_a_batch_whose_decoder_buffers_would_not_fit_is_refused_in_one_line_with_the_figures():
    """A GPU with room for rn50_16ep's training and the CPU decoder's inputs but not the GPU decoder's buffers."""
    r, dtype = inf.recipe("rn50_16ep"), torch.bfloat16
    cpu, gpu = (im.memory_need(r, 1000, world=1, dtype=dtype, side=500, gpu_decoder=g) for g in (False, True))
    memory = int((cpu.total + gpu.total) / 2 / devices.USABLE)
    with StandIn(memory=memory):
        assert im.check_memory(r, 1000, device="cuda:0", world=1, dtype=dtype, side=500, gpu_decoder=False) == cpu.total
        with pytest.raises(UsageError) as e:
            im.check_memory(r, 1000, device="cuda:0", world=1, dtype=dtype, side=500, gpu_decoder=True)
    size = devices.size_text
    line = str(e.value)
    assert line.startswith(
        f"training resnet50 at 512 images per process needs about {size(gpu.total)} on cuda:0 ({size(gpu.fixed)} of "
        f"weights and optimiser state, {size(gpu.activations)} of activations, {size(gpu.inputs)} of input buffers, "
        f"{size(gpu.validation)} for validation) but it has {size(memory)} free; "), line
    k = int(re.search(r"add --accumulate (\d+) ", line)[1])           # fewer activations at once: it fits
    assert im.training_bytes(inf.recipe("rn50_16ep", accumulate=k), 1000, world=1, dtype=dtype, side=500,
                             gpu_decoder=True) <= devices.USABLE * memory and "\n" not in line
