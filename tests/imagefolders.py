"""Small generated ImageFolder trees, what imagenet_fast.py prepare reads: for the tests, and for benchmarks/suite.py's
ImageNet piece."""
from pathlib import Path

import numpy as np
from PIL import Image


def synthetic_imagefolder(root, classes=10, train_per_class=20, val_per_class=5, *, sizes=(24, 48), seed=0,
                          quality=90, lossless=False):
    """Writes root/{train,val}/c<k>/*.JPEG (or, lossless, *.png: pixels that decode alike on every machine) of random
    sizes in `sizes`: class k is a colour of its own with stripes of its own period, plus noise, so a network can
    learn the classes (tests, and benchmarks/suite.py's ImageNet piece)."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(30, 226, (classes, 3))
    for split, per in (("train", train_per_class), ("val", val_per_class)):
        for k in range(classes):
            d = Path(root) / split / f"c{k:03d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per):
                w, h = rng.integers(sizes[0], sizes[1] + 1, 2)
                stripes = (np.arange(w) // (2 + k % 5) % 2 * 40 - 20)[None, :, None]
                x = palette[k] + stripes + rng.normal(0, 12, (h, w, 3))
                im = Image.fromarray(x.clip(0, 255).astype(np.uint8))
                im.save(d / f"{i:05d}.png") if lossless else im.save(d / f"{i:05d}.JPEG", quality=quality)
    return Path(root)
