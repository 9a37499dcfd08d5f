import functools
import hashlib
import http.server
import io
import pickle
import tarfile
import threading

import numpy as np
import pytest

import cifar_data as cd
from conftest import synthetic_arrays


def make_archive(path, n=6):
    """A tiny cifar-10-python.tar.gz in the official layout: pickled dicts with b'data' (N, 3072) CHW rows."""
    rng = np.random.default_rng(1)
    expected = {"train_images": [], "train_labels": []}
    with tarfile.open(path, "w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
            y = rng.integers(0, 10, n).tolist()
            blob = pickle.dumps({b"data": x.transpose(0, 3, 1, 2).reshape(n, 3072), b"labels": y,
                                 b"batch_label": name.encode()})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
            if name == "test_batch":
                expected["test_images"], expected["test_labels"] = x, np.array(y)
            else:
                expected["train_images"].append(x)
                expected["train_labels"].append(np.array(y))
    expected["train_images"] = np.concatenate(expected["train_images"])
    expected["train_labels"] = np.concatenate(expected["train_labels"])
    return expected


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
    with pytest.raises(cd.DataError, match=r"cifar-10-python.tar.gz: checksum mismatch \(md5 [0-9a-f]{32}, expected 0{32}\)"):
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


def test_unpacked_batches_folder(tmp_path):
    tgz = tmp_path / "cifar-10-python.tar.gz"
    expected = make_archive(tgz)
    with tarfile.open(tgz) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    d = cd.load_cifar10(tmp_path / "x" / "cifar-10-batches-py", download_ok=False)
    np.testing.assert_array_equal(d["test_images"], expected["test_images"])
    d = cd.load_cifar10(tmp_path / "x", download_ok=False)   # a data folder holding the unpacked folder
    np.testing.assert_array_equal(d["train_labels"], expected["train_labels"])
    assert (tmp_path / "x" / cd.CACHE_NAME).is_file()


def test_missing_archive_without_download(tmp_path):
    with pytest.raises(cd.DataError, match="cifar-10-python.tar.gz: not found and downloading is off"):
        cd.load_cifar10(tmp_path, download_ok=False)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(train_images=d["train_images"][:, :, :31]), r"train_images has shape \(256, 32, 31, 3\), expected \(N, 32, 32, 3\)"),
    (lambda d: d.update(test_images=d["test_images"].astype(np.float32)), "test_images has dtype float32, expected uint8"),
    (lambda d: d.update(train_labels=d["train_labels"][:-1]), r"train_labels has shape \(255,\), expected \(256,\)"),
    (lambda d: d["test_labels"].__setitem__(3, 10), r"test_labels out of range \(0..10\), expected 0..9"),
    (lambda d: d.pop("test_labels"), r"missing arrays \['test_labels'\]"),
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
    assert list((tmp_path / "data").iterdir()) == []
