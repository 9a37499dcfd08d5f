"""What `prepare` says of an ImageFolder tree it should not take as it is: images carrying an EXIF orientation
(counted and said; --exif-transpose stores them upright), a --dst inside --src, a disk that fills
while it writes (one line, exit status 1, then resumed by the same command once there is room), a folder it cannot
list, a link that loops, files it does not read, one class, a flag the format does not read, a second prepare into
the same store, and photos beyond PIL's limits.

The full disk is the kernel's own refusal of a file past RLIMIT_FSIZE (EFBIG) in a subprocess: the same path through
the code as ENOSPC (a write that fails part-way through a shard), with no mount needed."""
import errno
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import core
import imagenet_store as ims
from conftest import ROOT, unmeasured_environment
from imagefolders import synthetic_imagefolder

RAW = ims.StoreSettings(format="raw", size=16)


def turned_jpeg(path, size=(20, 30), orientation=6):
    """A JPEG of `size` pixels (width, height) whose EXIF says to turn it (6: 90 degrees clockwise)."""
    exif = Image.Exif()
    exif[ims.ORIENTATION] = orientation
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, "JPEG", quality=95, exif=exif.tobytes())


@pytest.fixture
def src(tmp_path):
    root = synthetic_imagefolder(tmp_path / "src", 2, 3, 1, sizes=(16, 20))
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
    src = synthetic_imagefolder(tmp_path / "src", 2, 4, 1, sizes=(16, 20))
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
        assert ((tmp_path / "dst" / f"{split}.store").read_bytes()
                == (tmp_path / "whole" / f"{split}.store").read_bytes())


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


# --- a tree prepare cannot read as it is, said before anything is written ---------------------------------------

def prepare_main(capfd, src, dst, *flags):
    """(exit status, stdout, stderr lines) of `imagenet_fast.py prepare` in this process; capfd, so that what the
    encoding processes print is read too."""
    import imagenet_fast
    rc = imagenet_fast.main(["prepare", "--src", str(src), "--dst", str(dst), "--workers", "1", *map(str, flags)])
    out, err = capfd.readouterr()
    return rc, out, [line for line in err.replace("\r", "\n").splitlines() if line.strip()
                     and not line.startswith("prepare ")]       # the progress bar's redraws left out


# root reads any folder: the command runs without the capabilities that let it, as another user would
UNPRIVILEGED = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="root reads every folder, and setpriv "
                    "(util-linux), which runs a command without that right, is not installed")
def test_a_folder_that_cannot_be_listed_is_named_in_one_line(src, tmp_path):
    """A class folder, then train/ itself, without read permission: one line naming it, exit status 1, no
    traceback, nothing written (one process for both, as a user runs the command)."""
    code = ("import sys, imagenet_fast as inf\n"
            "for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    print(inf.main(['prepare', '--src', src, '--dst', dst, '--workers', '1']))\n")
    other = synthetic_imagefolder(tmp_path / "other", 2, 1, 1, sizes=(16, 16))
    (src / "train" / "c001").chmod(0o000)
    (other / "train").chmod(0o300)            # writable and searchable, not readable: its entries cannot be listed
    try:
        done = subprocess.run((UNPRIVILEGED if os.geteuid() == 0 else []) + [
            sys.executable, "-c", code, str(src), str(tmp_path / "a"), str(other), str(tmp_path / "b")],
            capture_output=True, text=True, cwd=ROOT, timeout=600)
    finally:
        (src / "train" / "c001").chmod(0o755)
        (other / "train").chmod(0o755)
    assert done.stdout.split() == ["1", "1"] and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {src / 'train' / 'c001'}: cannot be listed (Permission denied); give this user read access to it",
        f"error: {other / 'train'}: cannot be listed (Permission denied); give this user read access to it"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_class_folder_that_links_back_in_a_loop_is_refused_in_one_line(src, tmp_path, capfd):
    (src / "train" / "self").symlink_to("self")                 # a link to itself: the kernel's ELOOP
    rc, _, err = prepare_main(capfd, src, tmp_path / "a")
    assert (rc, err) == (1, [f"error: {src / 'train' / 'self'}: a symbolic link that loops (self); a class folder "
                             "must hold its images: remove the link, or make it point at one"])
    (src / "train" / "self").unlink()
    (src / "val" / "up").symlink_to("..")                       # to the folder that holds it: every split a class
    rc, _, err = prepare_main(capfd, src, tmp_path / "b")
    assert (rc, err) == (1, [f"error: {src / 'val' / 'up'}: a symbolic link to {src}, which holds it (a loop); a "
                             "class folder must hold its images: remove the link, or make it point at one"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_files_prepare_does_not_read_are_counted_and_named_in_a_warning(src, tmp_path, capfd):
    """Files beside the class folders (torchvision's ImageFolder passes them over too) and, in a class folder,
    files that are not images and folders: one warning line a split, with counts; the images are stored."""
    shutil.copy(src / "train" / "c000" / "00000.JPEG", src / "train" / "loose.JPEG")
    (src / "train" / "notes.txt").write_text("labels")
    (src / "train" / "c001" / "crops").mkdir()
    (src / "train" / ".DS_Store").write_text("")                # hidden: not a user's file
    (src / "val" / "readme").write_text("")
    rc, out, err = prepare_main(capfd, src, tmp_path / "dst")
    assert rc == 0 and err[:2] == [
        f"warning: {src / 'train'}: 3 not read, 2 beside the class folders and 1 in them that are not images (.bmp "
        f".jpeg .jpg .png .ppm .webp): loose.JPEG, notes.txt, c001/crops; a class's images go in {src / 'train'}/"
        "<class>/",
        f"warning: {src / 'val'}: 1 not read, 1 beside the class folders: readme; a class's images go in "
        f"{src / 'val'}/<class>/"], err
    assert out.strip().splitlines()[-1].startswith(f"wrote {tmp_path / 'dst'}: 2 classes, 7 train and 2 val images")


@pytest.mark.parametrize("empty", [False, True])
def test_a_tree_of_one_class_is_refused_before_anything_is_written(tmp_path, capfd, empty):
    """One class folder (or two, one of them empty): train would refuse the store, so prepare refuses the tree."""
    one = synthetic_imagefolder(tmp_path / "one", 1, 2, 1, sizes=(16, 16))
    if empty:
        (one / "train" / "c001").mkdir()
    rc, _, err = prepare_main(capfd, one, tmp_path / "dst")
    assert (rc, err) == (1, [f"error: {one / 'train'}: one class " + ("with images (c000; 1 empty)" if empty else
                                                                      "(c000)") + "; a classifier needs at least 2"])
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("flags, message", [
    (["--format", "raw", "--max-side", "300"], "--max-side 300: sets a JPEG store's longer side; a raw store does "
                                                "not read it: leave it out, or give --format jpeg"),
    (["--format", "raw", "--quality", "80"], "--quality 80: sets the JPEG quality; a raw store does not read it: "
                                              "leave it out, or give --format jpeg"),
    (["--size", "64"], "--size 64: sets a raw store's shorter side; a jpeg store does not read it: leave it out, or "
                       "give --format raw"),
    (["--format", "jpeg", "--size", "64"], "--size 64: sets a raw store's shorter side; a jpeg store does not read "
                                           "it: leave it out, or give --format raw"),
])
def test_a_flag_the_format_does_not_read_is_refused_in_one_line(src, tmp_path, capfd, flags, message):
    rc, _, err = prepare_main(capfd, src, tmp_path / "dst", *flags)
    assert (rc, err) == (2, [f"error: {message}"]) and not (tmp_path / "dst").exists()


def test_a_second_prepare_into_the_same_store_is_refused_naming_the_first_and_leaves_nothing(src, tmp_path, capfd,
                                                                                           monkeypatch):
    """While one prepare holds --dst (its lock, taken here as a prepare takes it), another into it stops in one line
    naming the holder and writes nothing; once the holder ends no lock file is left, and a lock file left by a
    holder that was killed (no lock held on it) is taken over and removed. On a file system without locks, prepare
    runs without one."""
    dst = tmp_path / "dst"
    dst.mkdir()
    with ims.held_by_prepare(dst):
        rc, _, err = prepare_main(capfd, src, dst)
        assert (rc, err) == (1, [f"error: --dst {dst}: another prepare is writing it (process {os.getpid()} on "
                                 f"{socket.gethostname()}); wait for it to end, or give another --dst"])
        assert os.listdir(dst) == [ims.LOCK]
    assert os.listdir(dst) == []
    (dst / ims.LOCK).write_text("process 1 on a machine since rebooted")
    rc, _, _ = prepare_main(capfd, src, dst)
    assert rc == 0 and sorted(os.listdir(dst)) == ["index.json", "train.store", "val.store"]

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(ims.fcntl, "flock", no_locks)
    rc, _, _ = prepare_main(capfd, src, tmp_path / "unlocked")
    assert rc == 0 and sorted(os.listdir(tmp_path / "unlocked")) == ["index.json", "train.store", "val.store"]


def test_a_photo_too_large_for_pil_is_skipped_and_a_large_one_stored_each_in_one_line(src, tmp_path, capfd):
    """20000x20000 (beyond the 179 megapixels PIL decodes) skipped, 12000x12000 (beyond the 89 at which PIL warns)
    stored: a line each, counted in the summaries, never PIL's own warning through the progress bar. A 1-bit PNG
    and a grey JPEG keep them small on disk and quick to write; the larger one is never decoded."""
    Image.new("1", (20000, 20000)).save(src / "train" / "c000" / "huge.png")
    Image.new("L", (12000, 12000), 128).save(src / "train" / "c001" / "large.jpg", quality=50)
    rc, out, err = prepare_main(capfd, src, tmp_path / "dst")
    assert rc == 0 and "DecompressionBomb" not in "\n".join(err), err
    assert err == [
        f"skipped {src / 'train/c000/huge.png'}: too large: 20000x20000 pixels (400 megapixels), beyond the 179 "
        "megapixels PIL decodes (its guard against decompression bombs)",
        f"note: {src / 'train/c001/large.jpg'}: 12000x12000 pixels (144 megapixels), stored; PIL takes images beyond "
        "89 megapixels for possible decompression bombs"]
    lines = out.strip().splitlines()
    assert "train: 8 images stored (0.000 GB of jpeg), 0 unreadable and skipped, 1 too large and skipped, 1 over 89 " \
           "megapixels stored, 0 empty classes" in lines
    assert lines[-1].endswith("GB; 0 unreadable files skipped, 1 too large")
    index = json.loads((tmp_path / "dst" / "index.json").read_text())
    assert (index["train"]["too_large"], index["train"]["large"], index["train"]["skipped"]) == (1, 1, 1)
    stored = ims.open_store(tmp_path / "dst").train.rows
    assert sorted(zip(stored["width"].tolist(), stored["height"].tolist()))[-1] == (500, 500)   # the large one, fitted
