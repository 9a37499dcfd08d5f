"""benchmarks/fusion_bytes.py: what Inductor's partition keeps for fast94_next's backward, counted on the CPU."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import fusion_bytes  # noqa: E402


def test_the_backward_keeps_each_max_pools_one_byte_offsets_and_the_activations_before_it_where_torch_needs_them():
    width, batch = 1 / 16, 13                         # 4 and 16 channels; 13 divides none of the network's sizes
    saved = fusion_bytes.saved_tensors(batch, fusion_bytes.GPU_THRESHOLDS, width=width)
    offsets = [(shape, dtype) for _, what, dtype, shape, _ in saved if what.endswith("_with_offsets[1]")]
    # the global pool is an amax, which keeps no offsets
    assert offsets == [((batch, 4, 15, 15), "int8"), ((batch, 16, 7, 7), "int8"), ((batch, 16, 3, 3), "int8")]
    before_pools = [(batch, 4, 31, 31), (batch, 16, 15, 15)]         # the first two blocks' convolutions' outputs
    kept = [shape for _, what, _, shape, _ in saved if what == "convolution" and shape in before_pools]
    assert kept == (before_pools if fusion_bytes.pool_gradient_takes_its_input() else [])
    assert all(nbytes % batch == 0 for *_, shape, nbytes in saved if shape and shape[0] == batch)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "16"], "error: --batch 16: a prime from 11 up, not 31 (13, 17, 19, ...)"),
    (["--batch", "31"], "error: --batch 31: a prime from 11 up, not 31 (13, 17, 19, ...)"),
    (["--setting", "inductor.x"], "error: --setting 'inductor.x': not functorch.NAME=VALUE or inductor.NAME=VALUE")])
def test_a_bad_flag_is_one_line(capsys, argv, message):
    assert fusion_bytes.main(argv) == 2
    assert capsys.readouterr().err.strip() == message


def test_settings_are_read_as_their_types():
    assert fusion_bytes.settings_of(["inductor.realize_reads_threshold=64", "functorch.activation_memory_budget=0.5",
                                     "inductor.aggressive_fusion=True"]) == {
        ("inductor", "realize_reads_threshold"): 64, ("functorch", "activation_memory_budget"): 0.5,
        ("inductor", "aggressive_fusion"): True}
