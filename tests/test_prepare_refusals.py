"""What `prepare` says of an ImageFolder tree it should not take as it is: images carrying an EXIF orientation
(counted and said; --exif-transpose stores them upright), a --dst inside --src, and a disk that fills
while it writes (one line, exit status 1, then resumed by the same command once there is room).

The full disk is the kernel's own refusal of a file past RLIMIT_FSIZE (EFBIG) in a subprocess: the same path through
the code as ENOSPC (a write that fails part-way through a shard), with no mount needed."""
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import core
import imagenet_store as ims
from conftest import ROOT, unmeasured_environment

RAW = ims.StoreSettings(format="raw", size=16)


def turned_jpeg(path, size=(20, 30), orientation=6):
    """A JPEG of `size` pixels (width, height) whose EXIF says to turn it (6: 90 degrees clockwise)."""
    exif = Image.Exif()
    exif[ims.ORIENTATION] = orientation
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, "JPEG", quality=95, exif=exif.tobytes())


@pytest.fixture
def src(tmp_path):
    root = ims.synthetic_imagefolder(tmp_path / "src", 2, 3, 1, sizes=(16, 20))
    turned_jpeg(root / "train" / "c000" / "turned.jpg")
    return root


@pytest.mark.parametrize("upright", [False, True])
def test_images_with_an_exif_orientation_are_counted_and_turned_upright_on_request(src, tmp_path, upright):
    said = []
    index = ims.prepare(src, tmp_path / "dst", ims.StoreSettings(exif_transpose=upright), workers=1, log=said.append)
    assert index["train"]["exif_oriented"] == 1 and index["val"]["exif_oriented"] == 0
    assert [s for s in said if "EXIF" in s] == ["train: an EXIF orientation in 1 image: " + (
        "stored upright (re-encoded)" if upright else
        "stored as the pixels lie, turned or mirrored (--exif-transpose stores them upright)")]
    rows = ims.read_rows(tmp_path / "dst" / "train.store")
    data = (tmp_path / "dst" / "train.store").read_bytes()
    turned = rows[3]                                       # c000's images sorted: 0.JPEG..2.JPEG, then turned.jpg
    assert (turned["height"], turned["width"]) == ((20, 30) if upright else (30, 20))
    stored = bytes(data[turned["offset"]:turned["offset"] + turned["nbytes"]])
    assert (stored == (src / "train" / "c000" / "turned.jpg").read_bytes()) is not upright   # re-encoded only upright


def test_the_raw_format_turns_the_image_too(src, tmp_path):
    ims.prepare(src, tmp_path / "dst", ims.StoreSettings(format="raw", size=16, exif_transpose=True), workers=1,
                log=lambda s: None)
    rows = ims.read_rows(tmp_path / "dst" / "train.store")
    assert (rows[3]["height"], rows[3]["width"]) == (16, 24)          # the shape kept: upright, 30x20 at 16


def test_a_dst_inside_src_is_refused_before_anything_is_written(src, tmp_path):
    for dst in (src / "store", src / "train" / "store", src):
        with pytest.raises(core.UsageError) as e:
            ims.prepare(src, dst, RAW, workers=1, log=lambda s: None)
        assert str(e.value) == (f"--dst {dst}: inside --src {src}, where the next prepare would take it for a class; "
                                "give a --dst outside --src")
    assert not (src / "store").exists() and not (src / "train" / "store").exists()


def prepare_command(src, dst, limit=None):
    """`imagenet_fast.py prepare` of src into dst as a user runs it, its files limited to `limit` bytes."""
    set_limit = (lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_FSIZE, (limit, limit))) \
        if limit else None
    return subprocess.run([sys.executable, "imagenet_fast.py", "prepare", "--src", str(src), "--dst", str(dst),
                           "--format", "raw", "--size", "16", "--shard-size", "2", "--workers", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, preexec_fn=set_limit,
                          env=unmeasured_environment() if limit else None)


def test_prepare_on_a_full_disk_stops_in_one_line_and_resumes_once_there_is_room(tmp_path):
    """Records of 768 bytes in shards of 2: a 4,000-byte limit stops the training split's store in its third shard."""
    src = ims.synthetic_imagefolder(tmp_path / "src", 2, 4, 1, sizes=(16, 20))
    full = prepare_command(src, tmp_path / "dst", limit=4000)
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr
    assert full.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'dst'}: cannot write the store (File too large); 2 whole train shards (4 images) kept in "
        f"{tmp_path / 'dst'}; once there is room, the same command resumes from there")
    said = []
    ims.prepare(src, tmp_path / "dst", RAW, workers=1, shard_size=2, log=said.append)        # room again
    assert "train: 8 images in 4 shards; 2 already written, 2 to encode with 1 workers" in said
    ims.prepare(src, tmp_path / "whole", RAW, workers=1, shard_size=2, log=lambda s: None)
    for split in ("train", "val"):
        assert (tmp_path / "dst" / f"{split}.store").read_bytes() == (tmp_path / "whole" / f"{split}.store").read_bytes()


@pytest.mark.parametrize("settings, keywords, message", [
    (ims.StoreSettings(size="big"), {}, "--size big: must be a whole number, not str 'big'"),
    (ims.StoreSettings(), {"workers": "2"}, "--workers 2: must be a whole number, not str '2'"),
    (ims.StoreSettings(), {"shard_size": 2.5}, "--shard-size 2.5: must be a whole number, not float 2.5"),
    (ims.StoreSettings(max_aspect="wide"), {}, "--max-aspect wide: must be a number, not str"),
    (ims.StoreSettings(exif_transpose="yes"), {}, "--exif-transpose: true or false, not str"),
])
def test_the_librarys_wrong_types_are_one_line_before_anything_is_written(src, tmp_path, settings, keywords, message):
    with pytest.raises(core.UsageError) as e:
        ims.prepare(src, tmp_path / "dst", settings, log=lambda s: None, **keywords)
    assert str(e.value) == message and not (tmp_path / "dst").exists()
