"""Where a result may be written, and what a failed write keeps: --out and --checkpoint refused, in one line and before
any work, on anything but a regular file or a new one (a fifo, a character device: a pty's own end stands in for
one, a device this process owns; never a real one); nothing renamed onto such a file; a full disk, met by a finished
run's write, leaves the result whole on stdout, one line saying so and exit status 1.

The full disk is simulated two ways: in a subprocess by the kernel itself (RLIMIT_FSIZE: a write past the limit fails
with EFBIG, as one onto a full disk fails with ENOSPC, after the pre-flight's one byte succeeded), and in this process
by the file that write_json opens failing its writes with ENOSPC (the error a full disk gives)."""
import errno
import io
import json
import os
import socket
import stat
import subprocess
import sys

import pytest

import core
import outputs
from conftest import ROOT, main_output, synthetic_npz, unmeasured_environment
from imagefolders import synthetic_imagefolder

CIFAR = ["--device", "cpu", "--subset", "64", "--epochs", "1", "--width", "0.125", "--batch-size", "32", "--quiet"]


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    return synthetic_npz(tmp_path_factory, 64, 32)


@pytest.fixture
def char_device():
    """The path of a character device this process owns and nothing reads: a pseudo-terminal's other end."""
    ours, theirs = os.openpty()
    yield os.ttyname(theirs)
    os.close(ours)
    os.close(theirs)


def special_files(tmp_path, char_device):
    fifo, sock, link = tmp_path / "fifo", tmp_path / "sock", tmp_path / "link.json"
    os.mkfifo(fifo)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    os.symlink(fifo, link)
    return {fifo: "a fifo", sock: "a socket", link: "a fifo", char_device: "a character device"}, s


def test_check_output_refuses_every_file_that_is_not_regular_in_one_line(tmp_path, char_device):
    files, s = special_files(tmp_path, char_device)
    try:
        for path, kind in files.items():
            with pytest.raises(core.UsageError) as e:
                outputs.check_output(path, "--out")
            assert str(e.value) == f"--out {path}: is {kind}, not a regular file; give a new file's name or a file's"
    finally:
        s.close()
    (tmp_path / "r.json").write_text("old")
    outputs.check_output(tmp_path / "r.json", "--out")            # a regular file: replaced at the end, as before
    assert (tmp_path / "r.json").read_text() == "old"


def test_write_atomic_never_renames_onto_a_fifo_or_a_device(tmp_path, char_device):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a fifo"), (char_device, "a character device")):
        with pytest.raises(core.DataError) as e:
            outputs.write_json(path, {"a": 1})
        assert str(e.value) == f"{path}: is {kind}, not a regular file; nothing written there"
    assert os.path.exists(fifo) and not os.path.isfile(fifo) and os.listdir(tmp_path) == ["fifo"]


def test_write_atomic_checks_again_after_writing(tmp_path):
    """A path that became a fifo while the file was written is still not renamed onto; no temporary is left."""
    out = tmp_path / "r.json"
    with pytest.raises(core.DataError):
        outputs.write_atomic(out, lambda tmp: (open(tmp, "w").write("{}"), os.mkfifo(out)))
    assert not os.path.isfile(out) and os.listdir(tmp_path) == ["r.json"]


def cifar(capsys, *args):
    import cifar10_fast as cf
    return main_output(cf.main, args, capsys)


def test_the_command_line_refuses_a_fifo_and_a_device_as_out_before_loading(tmp_path, char_device, capsys,
                                                                            monkeypatch):
    import cifar10_fast as cf
    monkeypatch.setattr(cf, "load", lambda *a, **k: pytest.fail("loaded"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a fifo"), (char_device, "a character device")):
        rc, _, err = cifar(capsys, "--data-dir", tmp_path / "x.npz", *CIFAR, "--out", path)
        assert (rc, err) == (2, [f"error: --out {path}: is {kind}, not a regular file; give a new file's name or a "
                                 "file's"]), err
    assert os.path.exists(fifo) and not os.path.isfile(fifo)


def test_an_out_with_a_trailing_slash_and_no_such_folder_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    import cifar10_fast as cf
    monkeypatch.setattr(cf, "load", lambda *a, **k: pytest.fail("loaded"))
    rc, _, err = cifar(capsys, "--data-dir", tmp_path / "x.npz", *CIFAR, "--out", f"{tmp_path / 'results'}/")
    assert (rc, err) == (2, [f"error: --out {tmp_path / 'results'}/: names a folder (a trailing /), and there is none; "
                             "give a file name"]), err
    (tmp_path / "results").mkdir()
    with pytest.raises(core.UsageError) as e:
        outputs.check_output(f"{tmp_path / 'results'}/", "--out")
    assert str(e.value) == f"--out {tmp_path / 'results'}/: is a folder; give a file name"
    assert os.listdir(tmp_path) == ["results"] and os.listdir(tmp_path / "results") == []


def test_out_in_a_folder_not_yet_made_is_written_and_its_lock_leaves_nothing(npz, tmp_path, capsys):
    out = tmp_path / "a" / "b" / "r.json"
    rc, _, err = cifar(capsys, "--data-dir", npz, *CIFAR, "--out", out)
    assert (rc, err) == (0, []) and os.listdir(out.parent) == ["r.json"]
    rc, _, err = cifar(capsys, "--data-dir", tmp_path / "absent.npz", *CIFAR, "--out", tmp_path / "c" / "r.json")
    assert (rc, err) == (1, [f"error: {tmp_path / 'absent.npz'}: no such file"])
    assert sorted(os.listdir(tmp_path)) == ["a"]          # no results: the folder made for them removed


def test_imagenet_refuses_a_device_as_checkpoint_and_a_fifo_as_out(tmp_path, char_device, capsys):
    import imagenet_fast as inf
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for flag, path, kind in (("--checkpoint", char_device, "a character device"), ("--out", fifo, "a fifo")):
        rc, _, err = main_output(inf.main, ["train", "--store", tmp_path, "--device", "cpu", flag, path], capsys)
        assert (rc, err) == (2, [f"error: {flag} {path}: is {kind}, not a regular file; give a new file's name or a "
                                 "file's"]), err


class FullDisk(io.StringIO):
    """A file on a full disk: every write fails as the kernel's would."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_at_the_results_write_prints_the_result_whole_and_exits_1(npz, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text("the previous results\n")
    monkeypatch.setattr(outputs, "open", lambda *a, **k: FullDisk(), raising=False)
    rc, stdout, err = cifar(capsys, "--data-dir", npz, *CIFAR, "--out", out)
    assert (rc, err) == (1, [f"error: --out {out}: not written (No space left on device); the result is printed in "
                             "full above, on stdout, as one line of JSON"]), err
    record = json.loads(stdout.splitlines()[-1])
    assert record["recipe"] == "myrtle24" and [r["seed"] for r in record["runs"]] == [0] and record["summary"]
    assert len(record["runs"][0]["rows"]) == 1 and not record["complete"]
    assert out.read_text() == "the previous results\n" and os.listdir(tmp_path) == ["r.json"]


def test_the_kernel_refusing_the_results_write_keeps_the_result(npz, tmp_path):
    """In a subprocess whose files may not grow past 200 bytes (RLIMIT_FSIZE): the pre-flight's byte is written, the
    results' file is not; the result is on stdout all the same."""
    out = tmp_path / "r.json"
    code = ("import resource, sys, runpy; resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200)); "
            f"sys.argv = ['cifar10_fast.py', *{[str(a) for a in ['--data-dir', npz, *CIFAR, '--out', out]]!r}]; "
            "runpy.run_path('cifar10_fast.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=unmeasured_environment())
    err = [line for line in r.stderr.strip().splitlines() if not line.startswith("warning: no GPU")]
    assert (r.returncode, err) == (1, [f"error: --out {out}: not written (File too large); the result is printed in "
                                       "full above, on stdout, as one line of JSON"]), r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["runs"][0]["seed"] == 0 and os.listdir(tmp_path) == []


def test_the_pre_flight_write_meets_a_full_disk(tmp_path, monkeypatch):
    """The trial file holds a byte: on a full disk its write fails, so --out is refused before any work."""
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(outputs.os, "write", full)
    with pytest.raises(core.UsageError) as e:
        outputs.check_output(tmp_path / "r.json", "--out")
    assert str(e.value) == (f"--out {tmp_path / 'r.json'}: {tmp_path}: cannot write --out's file there (No space "
                            "left on device); give a path in a folder you can write in")
    assert os.listdir(tmp_path) == []


def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_epoch_before(tmp_path, capsys, monkeypatch):
    import imagenet_fast as inf
    import imagenet_store as ims
    src = synthetic_imagefolder(tmp_path / "src", 4, 6, 2, sizes=(16, 20))
    ims.prepare(src, tmp_path / "store", ims.StoreSettings(format="raw", size=16), workers=1, log=lambda s: None)
    capsys.readouterr()
    real, calls = inf.save_checkpoint, []

    def full_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)
    monkeypatch.setattr(inf, "save_checkpoint", full_at_the_second)
    checkpoint = tmp_path / "c.pt"
    rc, _, err = main_output(inf.main, ["train", "--store", tmp_path / "store", "--recipe", "tiny", "--device", "cpu",
                                        "--width", "4", "--batch-size", "8", "--min-res", "16", "--max-res", "16",
                                        "--val-res", "16", "--warmup-epochs", "0", "--quiet", "--epochs", "3",
                                        "--checkpoint", checkpoint], capsys)
    assert (rc, err) == (1, [f"error: --checkpoint {checkpoint}: not written after epoch 2 (No space left on device); "
                             f"the checkpoint of epoch 1 is kept in {checkpoint} (--resume continues from it)"]), err
    assert checkpoint.is_file()


def test_write_json_is_atomic_on_failure(tmp_path):
    p = tmp_path / "r.json"
    outputs.write_json(p, {"a": 1})
    written = json.loads(p.read_text())
    assert written["a"] == 1 and set(written) == {"a", "code"}

    def broken(tmp):
        open(tmp, "w").write("half")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        outputs.write_atomic(p, broken)
    assert json.loads(p.read_text()) == written         # old file untouched
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]   # no temporary left


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_get_the_permissions_open_gives(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        outputs.write_json(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == mode
