import sys

import pytest
import torch

import cifar_data as cd
import devices
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import augment_launches  # noqa: E402


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
    assert torch.equal(dy, r["dy"][r["perm"]]) and torch.equal(dx, r["dx"][r["perm"]])     # in the epoch's order
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
    assert torch.equal(flipped, r["flip"][r["perm"]])
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
    assert torch.equal(ys, r["cy"][r["perm"]]) and torch.equal(xs, r["cx"][r["perm"]])
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
    e1 = list(cd.epoch_batches(data, AUGMENT, g, batch_size=16))
    e2 = list(cd.epoch_batches(data, AUGMENT, g, batch_size=16))
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
        monkeypatch.setattr(torch, name,
                            lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    counts = []
    for n in (64, 640):
        calls.clear()
        g = torch.Generator().manual_seed(0)
        data = small_data(n)
        list(cd.epoch_batches(data, AUGMENT, g, batch_size=16))
        counts.append(len(calls))
    assert counts[0] == counts[1] <= 5, counts


def crop_flip_by_masks(x, r, size):
    """The crop and flip as they were before augment_images's one gather, kept as its reference: a torch.where over the
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
    assert torch.equal(out, crop_flip_by_masks(x, r, size)[r["perm"]]) and out.is_contiguous()


def epoch_as_it_was(data, augment, generator, *, memory_format, epoch=0, flip_base=None):
    """One epoch's images and labels as epoch_batches made them before one gather shuffled and laid them out, kept as
    its reference: the draws' arithmetic out of place, crop and flip (the masked selects above), jitter, cutout, then
    the order's gather, the resize and a copy into memory_format."""
    size = tuple(data["test_images"].shape[-2:])
    x, y, n = data["train_images"], data["train_labels"], len(data["train_labels"])
    draw = lambda high: torch.randint(0, high, (2, n), generator=generator)
    r = {"perm": torch.randperm(n, generator=generator)}
    if augment.crop_pad:
        r["dy"], r["dx"] = draw(2 * augment.crop_pad + 1)
    if augment.flip != "none":
        r["flip"] = cd.flip_bits(n, generator) if augment.flip == "random" else flip_base ^ bool(epoch % 2)
    if augment.cutout:
        r["cy"], r["cx"] = draw(size[0] - augment.cutout + 1)
    x = crop_flip_by_masks(x, r, size)
    if augment.jitter_brightness or augment.jitter_contrast:
        u = torch.rand(2, n, generator=generator) * 2 - 1
        per_image = lambda v: v.view(-1, 1, 1, 1).to(x.dtype)
        x = (x + per_image(u[0] * augment.jitter_brightness)) * per_image(1 + u[1] * augment.jitter_contrast)
    if augment.cutout:
        x = x.masked_fill(cd.cutout_mask(r["cy"], r["cx"], size, augment.cutout), 0)
    x, side = x[r["perm"]], augment.resolution(epoch, size)
    if cd.pair(side) != size:
        x = cd.low_resolution(x, side)
    return x.contiguous(memory_format=memory_format), y[r["perm"]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("augment, epoch", [
    (cd.AugmentSettings(crop_pad=2, flip="alternate", cutout=0, jitter_brightness=0.1399, jitter_contrast=0.1308), 0),
    (cd.AugmentSettings(crop_pad=2, flip="alternate", cutout=0, jitter_brightness=0.1399, jitter_contrast=0.1308), 1),
    (cd.AugmentSettings(crop_pad=2, flip="alternate", cutout=0, jitter_brightness=0.1399, jitter_contrast=0.1308,
                        resolution_schedule=(24, 28)), 1),
    (cd.AugmentSettings(crop_pad=4, flip="random", cutout=8), 0),
    (cd.AugmentSettings(crop_pad=0, flip="none", cutout=0), 0)])
def test_one_gather_shuffles_and_lays_out_the_epoch_giving_the_images_and_labels_the_steps_before_it_gave(
        dtype, memory_format, augment, epoch, monkeypatch):
    """fast94_next's augmentation (even and odd epochs, and at a side of a resolution schedule), myrtle24's and none:
    the same draws from one seed give the same images bit for bit, in the same order and layout (a GPU's too)."""
    monkeypatch.setattr(devices, "memory_format", lambda device: memory_format)
    n = 96
    data = {"train_images": torch.randn(n, 3, 32 + 2 * augment.crop_pad, 32 + 2 * augment.crop_pad).to(dtype),
            "train_labels": torch.arange(n) % 10, "test_images": torch.zeros(1, 3, 32, 32)}
    base = cd.flip_bits(n, torch.Generator().manual_seed(1))
    new, old = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    batches = list(cd.epoch_batches(data, augment, new, batch_size=n // 3, epoch=epoch, flip_base=base))
    x, y = epoch_as_it_was(data, augment, old, memory_format=memory_format, epoch=epoch, flip_base=base)
    assert torch.equal(torch.cat([b for b, _ in batches]), x) and torch.equal(torch.cat([lab for _, lab in batches]), y)
    assert all(b.is_contiguous(memory_format=memory_format) for b, _ in batches)
    assert torch.equal(new.get_state(), old.get_state())          # as many random numbers drawn


@pytest.mark.parametrize("recipe, epoch, launches, passes", [("fast94_next", 0, 21, 3.22), ("fast94_next", 1, 22, 3.22),
                                                             ("fast94_curriculum", 0, 25, 6.91)])
def test_an_epochs_augmentation_launches_fewer_kernels_and_passes_over_the_images_fewer_times(
        recipe, epoch, launches, passes):
    """Counted as CUDA runs it (benchmarks/augment_launches.py): fast94_next's epoch in 21 kernel launches (22 in an
    odd epoch: its flips negated) and three passes over the images (the gather, then the jitter's add and multiply in
    place; the rest is their indices), where it took 25 launches and 5.14 passes before one gather shuffled and laid
    it out. The record's loader, counted the same way with its own file: 65 launches (66 in an odd epoch), 2
    compiled-graph calls, 3.0 passes (4.0 in an odd epoch)."""
    counts = augment_launches.ours(recipe, epoch)
    assert (counts["launches"], counts["graph_calls"], counts["passes"]) == (launches, 0, passes)
