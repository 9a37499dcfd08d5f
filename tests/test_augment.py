import pytest
import torch

import cifar_data as cd


def padded_index_images(n, size=32, pad=4):
    """Images whose pixel value encodes its own (row, col) in the padded frame, so crops can be read back."""
    s = size + 2 * pad
    rows = torch.arange(s).view(1, 1, s, 1).expand(n, 3, s, s)
    cols = torch.arange(s).view(1, 1, 1, s).expand(n, 3, s, s)
    return (rows * 100 + cols).float()


def test_crop_offsets_cover_the_range_uniformly_and_crop_exactly():
    n, pad, size = 20000, 4, 32
    g = torch.Generator().manual_seed(0)
    r = cd.draw_augmentation(n, size, cd.AugmentSettings(crop_pad=pad, flip="none", cutout=0), generator=g)
    x = cd.augment_images(padded_index_images(n, size, pad), r, size, cutout=0)
    dy, dx = (x[:, 0, 0, 0] // 100).long(), (x[:, 0, 0, 0] % 100).long()
    assert torch.equal(dy, r["dy"]) and torch.equal(dx, r["dx"])
    # every crop is a contiguous size×size window starting at its offset
    expected = padded_index_images(1, size, pad)[0, 0]
    for i in range(0, n, 997):
        assert torch.equal(x[i, 1], expected[dy[i]:dy[i] + size, dx[i]:dx[i] + size])
    counts = torch.bincount(dy * (2 * pad + 1) + dx, minlength=81).float()
    assert counts.min() > 0
    # chi-square against uniform over 81 cells: 80 d.o.f., p < 1e-4 above ~135
    chi2 = ((counts - n / 81) ** 2 / (n / 81)).sum().item()
    assert chi2 < 135


def test_about_half_flipped_and_flips_mirror():
    n = 10000
    g = torch.Generator().manual_seed(1)
    r = cd.draw_augmentation(n, 32, cd.AugmentSettings(crop_pad=0, flip="random", cutout=0), generator=g)
    x = torch.arange(32.0).view(1, 1, 1, 32).expand(n, 3, 32, 32)
    out = cd.augment_images(x, r, 32, cutout=0)
    flipped = out[:, 0, 0, 0] == 31
    assert torch.equal(flipped, r["flip"])
    assert torch.equal(out[flipped][0, 0, 0], torch.arange(31.0, -1, -1))
    assert abs(flipped.float().mean().item() - 0.5) < 0.02       # ~4 sigma for n=10000


@pytest.mark.parametrize("patch", [5, 8])
def test_cutout_patches_have_the_stated_size_and_stay_inside(patch):
    n = 5000
    g = torch.Generator().manual_seed(2)
    r = cd.draw_augmentation(n, 32, cd.AugmentSettings(crop_pad=0, flip="none", cutout=patch), generator=g)
    out = cd.augment_images(torch.ones(n, 3, 32, 32), r, 32, cutout=patch)
    zero = out[:, 0] == 0
    assert torch.equal(zero.sum((1, 2)), torch.full((n,), patch * patch))
    assert torch.equal(out[:, 0] == 0, out[:, 2] == 0)              # same patch in every channel
    ys = zero.any(2).float().argmax(1)
    xs = zero.any(1).float().argmax(1)
    assert torch.equal(ys, r["cy"]) and torch.equal(xs, r["cx"])
    assert r["cy"].min() == 0 and r["cy"].max() == 32 - patch       # the whole range is used


def small_data(n=64):
    x = torch.randn(n, 3, 40, 40)
    y = torch.arange(n) % 10
    return {"train_images": x, "train_labels": y, "test_images": x[:, :, 4:-4, 4:-4], "test_labels": y}


AUGMENT = cd.AugmentSettings(crop_pad=4, flip="random", cutout=8)


def test_labels_follow_their_images_and_epochs_differ():
    data = small_data()
    # tag each image with its label; the 4x4 centre of any crop lies inside the tagged area
    data["train_images"][:, :, 4:36, 4:36] = data["train_labels"].float().view(-1, 1, 1, 1) + 1
    g = torch.Generator().manual_seed(3)
    e1 = list(cd.epoch_batches(data, AUGMENT, g, batch_size=16, memory_format=torch.contiguous_format))
    e2 = list(cd.epoch_batches(data, AUGMENT, g, batch_size=16, memory_format=torch.contiguous_format))
    assert len(e1) == 4 and all(x.shape == (16, 3, 32, 32) for x, _ in e1)
    for x, y in e1 + e2:
        centre = x[:, 0, 14:18, 14:18].amax((1, 2))
        tagged = centre > 0                           # false only where cutout hid the whole centre
        assert tagged.float().mean() > 0.5
        assert torch.equal(centre[tagged], y[tagged].float() + 1)
    assert sorted(torch.cat([y for _, y in e1]).tolist()) == sorted(data["train_labels"].tolist())
    assert not torch.equal(torch.cat([x for x, _ in e1]), torch.cat([x for x, _ in e2]))


def test_random_calls_per_epoch_do_not_grow_with_the_dataset(monkeypatch):
    calls = []
    for name in ("rand", "randint", "randperm", "randn", "bernoulli", "multinomial"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    counts = []
    for n in (64, 640):
        calls.clear()
        g = torch.Generator().manual_seed(0)
        data = small_data(n)
        list(cd.epoch_batches(data, AUGMENT, g, batch_size=16, memory_format=torch.contiguous_format))
        counts.append(len(calls))
    assert counts[0] == counts[1] <= 5, counts


def crop_flip_by_masks(x, r, size):
    """The crop and flip as they were before the one-gather crop_flip, kept as its reference: a torch.where over the
    whole set for every offset of each axis, then one for the flip."""
    h, w = cd.pair(size)
    if "dy" in r:
        dy, dx = r["dy"], r["dx"]
        rows = x[:, :, :h]
        for off in range(1, x.shape[2] - h + 1):
            rows = torch.where((dy == off).view(-1, 1, 1, 1), x[:, :, off:off + h], rows)
        x = rows[..., :w]
        for off in range(1, rows.shape[3] - w + 1):
            x = torch.where((dx == off).view(-1, 1, 1, 1), rows[..., off:off + w], x)
    if "flip" in r:
        x = torch.where(r["flip"].view(-1, 1, 1, 1), x.flip(3), x)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad, size, flip", [(4, 32, "random"), (2, 32, "alternate"), (3, (24, 32), "random"),
                                             (4, 32, "none"), (0, 32, "random")])
def test_the_one_gather_crops_and_flips_exactly_as_the_masked_selects_did(dtype, pad, size, flip):
    h, w = cd.pair(size)
    side = 2 * pad + 1
    # every offset with and without the flip, then random draws
    every = torch.arange(side * side * 2)
    fixed = {"dy": every // 2 // side, "dx": every // 2 % side, "flip": every % 2 == 1}
    g = torch.Generator().manual_seed(4)
    n = len(every) + 500
    x = torch.randn(n, 3, h + 2 * pad, w + 2 * pad, generator=g).to(dtype)
    r = cd.draw_augmentation(n, size, cd.AugmentSettings(crop_pad=pad, flip=flip, cutout=0), generator=g,
                             flip_base=cd.flip_bits(n, g))
    for k in fixed:
        if k in r:
            r[k][:len(every)] = fixed[k]
    out = cd.augment_images(x, r, size, cutout=0)
    assert torch.equal(out, crop_flip_by_masks(x, r, size)) and out.is_contiguous()
