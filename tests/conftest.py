import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ROOT.parent / "shared" / "data" / "cifar10" / "parts"


@pytest.fixture(scope="session")
def cifar10_npz(tmp_path_factory):
    """Path of the real CIFAR-10 as one .npz: $CIFAR10_NPZ if set, else decoded from ../shared once per session."""
    env = os.environ.get("CIFAR10_NPZ")
    if env:
        if not Path(env).is_file():
            pytest.skip(f"CIFAR10_NPZ={env} does not exist")
        return Path(env)
    decoder = PARTS / "decode_cifar10_parts.py"
    if not decoder.is_file():
        pytest.skip(f"real CIFAR-10 not available: neither $CIFAR10_NPZ nor {PARTS} exists")
    out = tmp_path_factory.mktemp("cifar10") / "cifar10.npz"
    subprocess.run([sys.executable, str(decoder), str(PARTS), str(out)], check=True, capture_output=True)
    return out


def synthetic_arrays(n_train=256, n_test=128, seed=0):
    """Random CIFAR-shaped data whose class is written into the image (learnable, tiny)."""
    rng = np.random.default_rng(seed)
    def split(n):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = rng.integers(0, 256, (n, 32, 32, 3)).astype(np.uint8) // 4
        x[np.arange(n), :, :, 0] += (y * 19)[:, None, None].astype(np.uint8)
        return x, y
    (xtr, ytr), (xte, yte) = split(n_train), split(n_test)
    return {"train_images": xtr, "train_labels": ytr, "test_images": xte, "test_labels": yte}
