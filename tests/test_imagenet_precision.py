"""ImageNet's ghost batch norm under bf16 autocast takes its groups' statistics in float32."""
import torch

import devices
import torch_backend as tb


def test_ghost_batch_norms_group_statistics_are_float32_under_bf16_autocast():
    torch.manual_seed(0)
    x = (torch.randn(8, 4, 6, 6) * 3 + 100).bfloat16()       # a large mean: bf16's 8 bits would round the variance
    bn = tb.GhostBatchNorm(4, momentum=1.0)                   # the running statistics: the last groups' average
    bn.group = 4
    with devices.autocast("cpu", torch.bfloat16):
        bn(x)
    groups = x.float().unflatten(0, (2, 4))
    var, mean = torch.var_mean(groups, (1, 3, 4), correction=0)
    count = 4 * 6 * 6
    torch.testing.assert_close(bn.running_mean, mean.mean(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(bn.running_var, var.mean(0) * count / (count - 1), rtol=1e-5, atol=0)
