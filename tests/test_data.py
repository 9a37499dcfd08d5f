import functools
import hashlib
import http.server
import io
import os
import pickle
import re
import socket
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import cifar10_fast as cf
import cifar_data as cd
from conftest import synthetic_arrays


def make_archive(path, n=6, dataset="cifar10", tamper=None):
    """A tiny cifar-10-python.tar.gz (or cifar-100-python.tar.gz) in the official layout: pickled dicts with
    b'data' (N, 3072) CHW rows and the labels (CIFAR-100: fine and coarse); tamper: {member: its bytes, or None
    to leave it out}."""
    spec, classes = cd.DATASETS[dataset], 10 if dataset == "cifar10" else 100
    rng = np.random.default_rng(1)
    expected = {k: [] for k in cd.KEYS}
    with tarfile.open(path, "w:gz") as tar:
        for split in ("train", "test"):
            for name in spec[split]:
                x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
                y = rng.integers(0, classes, n).tolist()
                blob = pickle.dumps({b"data": x.transpose(0, 3, 1, 2).reshape(n, 3072), spec["labels"]: y,
                                     b"coarse_labels": [label // 5 for label in y], b"batch_label": name.encode()})
                if tamper and name in tamper:
                    if tamper[name] is None:
                        continue
                    blob = tamper[name]
                info = tarfile.TarInfo(f"{spec['folder']}/{name}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
                expected[f"{split}_images"].append(x)
                expected[f"{split}_labels"].append(np.array(y))
    return {k: np.concatenate(v) for k, v in expected.items()}


def unpacked(tgz, folder, monkeypatch, dataset="cifar10"):
    """tgz unpacked into folder, its batch files taken as the published ones (cifar_data.published_md5s): the folder
    of the official archive, unpacked, as this small archive stands for it. Returns the folder of the batches."""
    with tarfile.open(tgz) as tar:
        tar.extractall(folder, filter="data")
    batches = folder / cd.DATASETS[dataset]["folder"]
    md5s = {f.name: hashlib.md5(f.read_bytes()).hexdigest() for f in batches.iterdir()}
    monkeypatch.setattr(cd, "published_md5s", lambda spec: md5s)
    return batches


def spec_of(path):
    return {"name": path.name, "md5": hashlib.md5(path.read_bytes()).hexdigest(), "size": path.stat().st_size}


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name != "cifar-10-python.tar.gz")


def test_archive_is_read_verified_and_cached(tmp_path):
    tgz = tmp_path / "cifar-10-python.tar.gz"
    expected = make_archive(tgz)
    d = cd.load_cifar10(tmp_path, download_ok=False, archive=spec_of(tgz))
    for k in cd.KEYS:
        np.testing.assert_array_equal(d[k], expected[k])
    assert d["train_images"].shape == (30, 32, 32, 3) and d["train_labels"].dtype == np.uint8
    assert leftovers(tmp_path) == [cd.CACHE_NAME]
    tgz.unlink()                                   # the second start reads only the cache
    d2 = cd.load_cifar10(tmp_path, download_ok=False)
    for k in cd.KEYS:
        np.testing.assert_array_equal(d2[k], expected[k])


def test_checksum_mismatch_is_reported_and_leaves_no_cache(tmp_path):
    tgz = tmp_path / "cifar-10-python.tar.gz"
    make_archive(tgz)
    spec = {**spec_of(tgz), "md5": "0" * 32}
    with pytest.raises(cd.DataError,
                       match=r"cifar-10-python.tar.gz: checksum mismatch \(md5 [0-9a-f]{32}, expected 0{32}\)"):
        cd.load_cifar10(tmp_path, download_ok=False, archive=spec)
    assert leftovers(tmp_path) == []


def test_truncated_archive_is_reported_and_leaves_no_cache(tmp_path):
    tgz = tmp_path / "cifar-10-python.tar.gz"
    make_archive(tgz)
    spec = spec_of(tgz)
    tgz.write_bytes(tgz.read_bytes()[: spec["size"] // 2])
    with pytest.raises(cd.DataError, match=rf"truncated archive \({spec['size'] // 2} of {spec['size']} bytes\)"):
        cd.load_cifar10(tmp_path, download_ok=False, archive=spec)
    # with no size or checksum to compare against, the archive reader itself notices
    with pytest.raises(cd.DataError, match="truncated or corrupt archive"):
        cd.load_cifar10(tmp_path, download_ok=False, archive={"name": tgz.name, "md5": None, "size": None})
    assert leftovers(tmp_path) == []


def test_unpacked_batches_folder(tmp_path, monkeypatch):
    tgz = tmp_path / "cifar-10-python.tar.gz"
    expected = make_archive(tgz)
    unpacked(tgz, tmp_path / "x", monkeypatch)
    d = cd.load_cifar10(tmp_path / "x" / "cifar-10-batches-py", download_ok=False)
    np.testing.assert_array_equal(d["test_images"], expected["test_images"])
    d = cd.load_cifar10(tmp_path / "x", download_ok=False)   # a data folder holding the unpacked folder
    np.testing.assert_array_equal(d["train_labels"], expected["train_labels"])
    assert (tmp_path / "x" / cd.CACHE_NAME).is_file()


def test_missing_archive_without_download(tmp_path):
    with pytest.raises(cd.DataError, match="cifar-10-python.tar.gz: not found and downloading is off"):
        cd.load_cifar10(tmp_path, download_ok=False)


@pytest.mark.parametrize("tamper, message", [
    ({"data_batch_3": None}, ": data_batch_3 missing from the archive"),
    ({"test_batch": b"not a pickle"}, r"/test_batch: not a CIFAR-10 batch \(UnpicklingError: "),
    ({"data_batch_2": pickle.dumps({b"data": []})}, r"/data_batch_2: not a CIFAR-10 batch \(KeyError: b'labels'\)"),
    ({"data_batch_1": pickle.dumps({b"data": np.zeros((4, 3071), np.uint8), b"labels": [0] * 4})},
     r"/data_batch_1: wrong shapes \(data \(4, 3071\), labels \(4,\)\); expected \(N, 3072\) and \(N,\)"),
])
def test_a_bad_archive_member_is_named_and_leaves_no_cache(tmp_path, tamper, message):
    tgz = tmp_path / "cifar-10-python.tar.gz"
    make_archive(tgz, tamper=tamper)
    with pytest.raises(cd.DataError, match=rf"^{re.escape(str(tgz))}{message}"):
        cd.load_cifar10(tmp_path, download_ok=False, archive=spec_of(tgz))
    assert leftovers(tmp_path) == []


def test_an_unpacked_folder_missing_a_batch_is_named(tmp_path, monkeypatch):
    tgz = tmp_path / "cifar-10-python.tar.gz"
    make_archive(tgz)
    batches = unpacked(tgz, tmp_path / "x", monkeypatch)
    (batches / "data_batch_4").unlink()
    with pytest.raises(cd.DataError, match=rf"^{re.escape(str(batches / 'data_batch_4'))}: missing$"):
        cd.load_cifar10(tmp_path / "x", download_ok=False)
    assert not (tmp_path / "x" / cd.CACHE_NAME).exists()


def test_a_data_dir_that_is_neither_a_folder_nor_an_npz_is_named(tmp_path):
    with pytest.raises(cd.DataError, match=rf"^{re.escape(str(tmp_path / 'absent.npz'))}: no such file$"):
        cd.load_cifar10(tmp_path / "absent.npz")
    (tmp_path / "data.tar").write_bytes(b"x")
    with pytest.raises(cd.DataError, match=rf"^{re.escape(str(tmp_path / 'data.tar'))}: expected a .npz file or a "
                                           "folder$"):
        cd.load_cifar10(tmp_path / "data.tar")


def test_a_preset_refuses_images_of_another_size(tmp_path):
    d = synthetic_arrays(16, 8)
    d = {**d, "train_images": d["train_images"][:, :28, :28], "test_images": d["test_images"][:, :28, :28]}
    np.savez(tmp_path / "small.npz", **d)
    with pytest.raises(cd.DataError, match=r"small.npz: train_images are 28x28 pixels; CIFAR-10's are 32x32 "
                                           r"\(leave out --dataset to train on your own data\)$"):
        cd.load_cifar10(tmp_path / "small.npz")
    assert cd.load(tmp_path / "small.npz")["train_images"].shape == (16, 28, 28, 3)     # own data: any size


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(train_images=d["train_images"][:, :, :31]),
     "train_images are 32x31 pixels but test_images 32x32; expected the same size"),
    (lambda d: d.update(train_images=d["train_images"][:, :7, :7]),
     r"train_images has shape \(256, 7, 7, 3\), expected \(N, H, W, 3\) with N > 0 and H, W at least 8"),
    (lambda d: d.update(test_images=d["test_images"][..., :1]),
     r"test_images has shape \(128, 32, 32, 1\), expected \(N, H, W, 3\) with N > 0 and H, W at least 8"),
    (lambda d: d.update(test_images=d["test_images"].astype(np.float32)),
     "test_images has dtype float32, expected uint8"),
    (lambda d: d.update(train_labels=d["train_labels"][:-1]), r"train_labels has shape \(255,\), expected \(256,\)"),
    (lambda d: d.update(test_labels=d["test_labels"].astype(np.int16) - 1),
     r"test_labels out of range \(-1..8\), expected integers from 0"),
    (lambda d: d.pop("test_labels"), r"missing arrays \['test_labels'\]"),
    (lambda d: d.update(train_labels=d["train_labels"].astype(np.float32)),
     "train_labels has dtype float32, expected integers"),
])
def test_bad_npz_is_named_and_explained(tmp_path, change, message):
    d = synthetic_arrays()
    change(d)
    p = tmp_path / "bad.npz"
    np.savez(p, **d)
    with pytest.raises(cd.DataError, match=rf"bad.npz: {message}"):
        cd.load_cifar10(p)


def test_npz_that_is_not_an_npz(tmp_path):
    p = tmp_path / "junk.npz"
    p.write_bytes(b"not a zip")
    with pytest.raises(cd.DataError, match="junk.npz: not a readable .npz"):
        cd.load_cifar10(p)


@pytest.fixture
def served(tmp_path, monkeypatch):
    """(folder, its URL): the folder served over HTTP on 127.0.0.1 while the test runs. Not a file:// URL:
    torchvision's downloader reads the response's length, which urllib's file responses lack."""
    folder = tmp_path / "src"
    folder.mkdir()
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("no_proxy", "127.0.0.1")         # never through a proxy the environment may name
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_download_goes_through_a_temporary_name_then_verifies(tmp_path, served, capsys):
    folder, url = served
    src = folder / "cifar-10-python.tar.gz"
    expected = make_archive(src)
    dst = tmp_path / "data"
    d = cd.load_cifar10(dst, archive=spec_of(src), url=f"{url}/{src.name}")
    np.testing.assert_array_equal(d["test_labels"], expected["test_labels"])
    assert "downloading cifar-10-python.tar.gz" in capsys.readouterr().err
    assert sorted(p.name for p in dst.iterdir()) == ["cifar-10-python.tar.gz", cd.CACHE_NAME]


def test_failed_download_leaves_nothing(tmp_path, served):
    _, url = served
    with pytest.raises(cd.DataError, match="download failed"):
        cd.load_cifar10(tmp_path / "data", url=f"{url}/nowhere.tar.gz", progress=False)
    assert not (tmp_path / "data").exists()


def test_cifar100_archive_is_read_verified_and_cached(tmp_path):
    tgz = tmp_path / "cifar-100-python.tar.gz"
    expected = make_archive(tgz, n=200, dataset="cifar100")
    with pytest.raises(cd.DataError, match=r"cifar-100-python.tar.gz: checksum mismatch \(md5 [0-9a-f]{32}, expected"):
        cd.load(tmp_path, "cifar100", download_ok=False, archive={**spec_of(tgz), "md5": "0" * 32})
    d = cd.load(tmp_path, "cifar100", download_ok=False, archive=spec_of(tgz))
    for k in cd.KEYS:
        np.testing.assert_array_equal(d[k], expected[k])
    assert d["train_labels"].max() == 99 and cd.num_classes(d) == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-100-python.tar.gz", "cifar100_uint8.npz"]
    tgz.unlink()                                   # the second start reads only the cache
    np.testing.assert_array_equal(cd.load(tmp_path, "cifar100", download_ok=False)["test_images"],
                                  expected["test_images"])
    with pytest.raises(cd.DataError, match="cifar-10-python.tar.gz: not found and downloading is off"):
        cd.load(tmp_path, "cifar10", download_ok=False)         # each data set has a cache of its own


def test_cifar100_downloads_as_cifar10_does(tmp_path, served):
    folder, url = served
    src = folder / "cifar-100-python.tar.gz"
    expected = make_archive(src, dataset="cifar100")
    dst = tmp_path / "data"
    d = cd.load(dst, "cifar100", archive=spec_of(src), url=f"{url}/{src.name}", progress=False)
    np.testing.assert_array_equal(d["train_labels"], expected["train_labels"])
    assert sorted(p.name for p in dst.iterdir()) == ["cifar-100-python.tar.gz", "cifar100_uint8.npz"]
    with pytest.raises(cd.DataError, match="download failed"):
        cd.load(tmp_path / "other", "cifar100", url=f"{url}/nowhere.tar.gz", progress=False)
    assert not (tmp_path / "other").exists()


def test_the_command_line_trains_on_cifar100(tmp_path, capsys, monkeypatch):
    """--dataset cifar100 reads an unpacked cifar-100-python/ folder in --data-dir, offline."""
    import cifar10_fast as cf
    tgz = tmp_path / "cifar-100-python.tar.gz"
    make_archive(tgz, n=500, dataset="cifar100")
    unpacked(tgz, tmp_path / "data", monkeypatch, "cifar100")
    assert cf.main(["--dataset", "cifar100", "--data-dir", str(tmp_path / "data"), "--device", "cpu", "--recipe",
                    "fast94", "--epochs", "1", "--width", "0.0625", "--batch-size", "100"]) == 0
    assert "500 training and 500 test images of 32x32 pixels, 100 classes" in capsys.readouterr().out


def test_a_preset_refuses_labels_outside_its_classes_and_own_data_counts_them(tmp_path):
    d = synthetic_arrays(64, 32)
    d["test_labels"][5] = 10                               # an eleventh class in a file said to be CIFAR-10
    np.savez(tmp_path / "eleven.npz", **d)
    with pytest.raises(cd.DataError) as e:
        cd.load(tmp_path / "eleven.npz", "cifar10")
    assert str(e.value) == (f"{tmp_path / 'eleven.npz'}: test_labels out of range (0..10); CIFAR-10's labels are "
                            "0..9 (leave out --dataset to train on your own data's 11 classes)")
    assert cd.num_classes(cd.load(tmp_path / "eleven.npz")) == 11       # own data: the labels say how many classes
    folder = tmp_path / "data"
    folder.mkdir()
    np.savez(folder / cd.CACHE_NAME, **d)                  # the cache of a data folder is CIFAR-10 whatever it holds
    with pytest.raises(cd.DataError, match="test_labels out of range"):
        cd.load(folder)


def test_offline_without_a_data_file_says_how_to_go_on_and_leaves_no_folder(tmp_path):
    with socket.socket() as s:                             # a port nobody listens on: the download is refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/cifar-10-python.tar.gz"
    with pytest.raises(cd.DataError) as e:
        cd.load_cifar10(tmp_path / "data", url=url, progress=False)
    message = str(e.value)
    assert message.startswith(f"{url}: download failed (") and "\n" not in message
    assert message.endswith(f"; put cifar-10-python.tar.gz in {tmp_path / 'data'}, or give the data as one file: "
                            "--data-dir FILE.npz holding train_images (N, 32, 32, 3) uint8, train_labels (N,), "
                            "test_images and test_labels")
    assert not (tmp_path / "data").exists()


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs a folder no process may write in (/sys)")
def test_a_data_dir_the_download_cannot_be_written_in_is_one_line_before_any_download(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cd, "download", lambda *a, **k: pytest.fail("downloaded"))
    (tmp_path / "a_file").write_text("x")
    for folder, why in ((Path("/sys"), "cannot write CIFAR-10's download there (Permission denied)"),
                        (Path("/sys/cifar10"), "cannot write CIFAR-10's download there (Operation not permitted)"),
                        (tmp_path / "a_file" / "data", "cannot write CIFAR-10's download there (Not a directory)")):
        assert cf.main(["--data-dir", str(folder), "--device", "cpu"]) == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: {folder}: {why}; give --data-dir a folder you can write in, or the data as one file: "
            "--data-dir FILE.npz")
    assert not Path("/sys/cifar10").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.parametrize("change, preset, message", [
    ("stray", None, "labels 0..1000000: 1000001 classes, of which only 11 occur; labels must number the classes "
                    "0..C-1 (a stray label of 1000000?)"),
    ("one", None, "every label is 0, one class; a classifier needs at least 2"),
    ("one", "cifar10", "every label is 0, one class; a classifier needs at least 2"),
    ("none", "cifar100", "labels 0..9: 10 classes, as CIFAR-10's; CIFAR-100 has 100 (give the --dataset this data is, "
                         "or leave it out)"),
    ("many", None, "labels 0..99: 100 classes, more than the 64 training images; labels must number the classes "
                   "0..C-1"),
])
def test_labels_that_make_no_plausible_classes_are_one_line_naming_the_count(tmp_path, change, preset, message):
    d = synthetic_arrays(64, 100)
    if change == "stray":                 # one training label of a million: a network of a million outputs
        d["train_labels"] = d["train_labels"].astype(np.int64)
        d["train_labels"][7] = 1_000_000
    elif change == "one":
        d["train_labels"][:], d["test_labels"][:] = 0, 0
    elif change == "many":
        d["test_labels"] = np.arange(100, dtype=np.uint8)
    np.savez(tmp_path / "d.npz", **d)
    with pytest.raises(cd.DataError) as e:
        cd.load(tmp_path / "d.npz", preset)
    assert str(e.value) == f"{tmp_path / 'd.npz'}: {message}"


def test_the_command_line_refuses_a_stray_label_and_cifar100_said_of_10_classes_in_one_line(tmp_path, capsys):
    d = synthetic_arrays(64, 32)
    d["train_labels"] = d["train_labels"].astype(np.int64)
    d["train_labels"][0] = 1_000_000
    np.savez(tmp_path / "stray.npz", **d)
    np.savez(tmp_path / "ten.npz", **synthetic_arrays(64, 32))
    for name, flags, message in (
            ("stray.npz", [], "labels 0..1000000: 1000001 classes, of which only 11 occur; labels must number the "
                              "classes 0..C-1 (a stray label of 1000000?)"),
            ("ten.npz", ["--dataset", "cifar100"], "labels 0..9: 10 classes, as CIFAR-10's; CIFAR-100 has 100 (give "
                                                   "the --dataset this data is, or leave it out)")):
        assert cf.main(["--data-dir", str(tmp_path / name), "--device", "cpu", *flags]) == 1
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: no GPU")]
        assert err == [f"error: {tmp_path / name}: {message}"]


class Payload:
    """A pickle that, unpickled, writes a file: what a doctored batch file could run instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path(self.marker).write_text, ("ran",))


def test_an_unpacked_batch_is_checked_against_its_published_md5_and_never_unpickled_otherwise(tmp_path, capsys):
    assert cd.published_md5s(cd.DATASETS["cifar10"])["data_batch_1"] == "c99cafc152244af753f735de768cd75f"
    assert cd.published_md5s(cd.DATASETS["cifar100"])["test"] == "f0ef6b0ae62326f3e7ffdfab6717acfc"
    tgz, marker = tmp_path / "cifar-10-python.tar.gz", tmp_path / "ran"
    make_archive(tgz, tamper={"data_batch_1": pickle.dumps(Payload(marker))})
    with tarfile.open(tgz) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    batch = tmp_path / "x" / "cifar-10-batches-py" / "data_batch_1"
    md5 = hashlib.md5(batch.read_bytes()).hexdigest()
    for folder in (tmp_path / "x", batch.parent):              # a data folder holding it, and the folder itself
        assert cf.main(["--data-dir", str(folder), "--device", "cpu"]) == 1
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: no GPU")]
        assert err == [f"error: {batch}: not CIFAR-10's published data_batch_1 (md5 {md5}, expected "
                       "c99cafc152244af753f735de768cd75f); not unpickled, as a pickle can run code: unpack the "
                       "official archive again, or give the data as one file: --data-dir FILE.npz"]
    assert not marker.exists() and not (tmp_path / "x" / cd.CACHE_NAME).exists()
    pickle.loads(batch.read_bytes())                            # what unpickling it would have done
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("data, message", [
    (np.full((6, 3072), 300.0), "pixel values 300.0..300.0 of dtype float64; expected whole numbers 0..255"),
    (np.linspace(0, 300, 6 * 3072).reshape(6, 3072), "pixel values 0.0..300.0 of dtype float64; expected whole "
                                                     "numbers 0..255"),
    (np.full((6, 3072), 0.5), "pixel values 0.5..0.5 of dtype float64; expected whole numbers 0..255"),
    (np.full((6, 3072), -1), "pixel values -1..-1 of dtype int64; expected whole numbers 0..255"),
    (np.full((6, 3072), "a"), "pixel values of dtype <U1; expected whole numbers 0..255"),
])
def test_pixels_a_batch_holds_outside_0_to_255_or_not_whole_are_refused_not_wrapped(tmp_path, data, message):
    tgz = tmp_path / "cifar-10-python.tar.gz"
    make_archive(tgz, tamper={"data_batch_2": pickle.dumps({b"data": data, b"labels": [0] * 6})})
    with pytest.raises(cd.DataError) as e:
        cd.load_cifar10(tmp_path, download_ok=False, archive=spec_of(tgz))
    assert str(e.value) == f"{tgz}/data_batch_2: {message}"
    assert leftovers(tmp_path) == []
    make_archive(tgz, tamper={"data_batch_2": pickle.dumps({b"data": np.full((6, 3072), 255.0), b"labels": [0] * 6})})
    assert (cd.load_cifar10(tmp_path, download_ok=False, archive=spec_of(tgz))["train_images"][6:12] == 255).all()


def test_an_npz_whose_members_are_not_npy_data_is_one_line(tmp_path, capsys):
    import zipfile
    with zipfile.ZipFile(tmp_path / "fake.npz", "w") as z:
        for key in cd.KEYS:
            z.writestr(f"{key}.npy", b"not an array")
    assert cf.main(["--data-dir", str(tmp_path / "fake.npz"), "--device", "cpu"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: no GPU")]
    assert err == [f"error: {tmp_path / 'fake.npz'}: train_images.npy is not .npy data (numpy.save's format); "
                   "write the file with numpy.savez"]


def test_each_data_path_that_is_no_npz_file_says_what_it_is(tmp_path):
    np.savez(tmp_path / "upper.npz", **synthetic_arrays(64, 32))
    (tmp_path / "upper.npz").rename(tmp_path / "UPPER.NPZ")
    os.mkfifo(tmp_path / "fifo.npz")
    (tmp_path / "folder.npz").mkdir()
    os.symlink(tmp_path / "loop.npz", tmp_path / "loop.npz")
    os.symlink("/dev/zero", tmp_path / "zero.npz")
    cases = {"fifo.npz": "is a fifo, not a .npz file", "folder.npz": "is a folder, not a .npz file",
             "loop.npz": "is a loop of symbolic links", "zero.npz": "is a character device, not a .npz file",
             "absent.npz": "no such file", "/dev/zero": "is a character device; expected a .npz file or a folder"}
    for name, message in cases.items():
        with pytest.raises(cd.DataError) as e:
            cd.load(tmp_path / name)
        assert str(e.value) == f"{tmp_path / name}: {message}"
    assert len(cd.load(tmp_path / "UPPER.NPZ")["train_labels"]) == 64            # the suffix in any case


def test_a_constant_channels_statistics_are_a_zero_spread_and_it_normalises_to_zero():
    images = np.zeros((4, 8, 8, 3), np.uint8)
    images[..., 0] = np.arange(4)[:, None, None]
    images[..., 1] = 200
    mean, std = cd.channel_stats(images)
    assert std[1:] == (0.0, 0.0) and std[0] > 0 and mean[1:] == (200.0, 0.0)
    x = cd.upload_normalised(images, "cpu", dtype=torch.float32, stats=(mean, std))
    assert torch.isfinite(x).all() and (x[:, 1:] == 0).all()


def test_images_all_one_colour_are_refused_on_the_command_line_naming_the_file(tmp_path, capsys):
    d = synthetic_arrays(64, 32)
    d["train_images"][:] = 0
    np.savez(tmp_path / "black.npz", **d)
    assert cf.main(["--data-dir", str(tmp_path / "black.npz"), "--device", "cpu"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: no GPU")]
    assert err == [f"error: {tmp_path / 'black.npz'}: every pixel of every training image is (0, 0, 0); there is "
                   "nothing to learn"]
