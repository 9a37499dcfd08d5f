"""Every flag is checked before any work: a bad value stops the command with one line on stderr naming the flag,
what is wrong and what is allowed, and exit status 2, never a traceback. In this process (cf.main, inf.main), so
each case takes milliseconds."""
import pytest
import torch

import cifar10_fast as cf
import distributed as D
import imagenet_fast as inf
import scaling
from conftest import synthetic_npz
from imagefolders import synthetic_imagefolder


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    return synthetic_npz(tmp_path_factory, 256, 64)


def run(main, args, capsys):
    """(exit status, stderr lines) of main(args); argparse's errors leave by SystemExit."""
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err.strip().splitlines()


# (flags, the last line on stderr). NO_DATA cases run with a --data-dir that does not exist: they must stop before
# anything is loaded. DATA cases need the data's size: they load the 256 synthetic training images first.
NO_DATA = [
    (["--epochs", "0"], "error: --epochs 0: must be positive"),
    (["--epochs", "-2"], "error: --epochs -2: must be positive"),
    (["--epochs", "two"], "error: argument --epochs: 'two' is not a whole number"),
    (["--batch-size", "0"], "error: --batch-size 0: must be positive"),
    (["--batch-size", "9.5"], "error: --batch-size 9.5: must be a whole number"),
    (["--width", "0"], "error: --width 0: must be positive"),
    (["--subset", "0"], "error: --subset 0: must be positive"),
    (["--lr-values", "0,0.4"], "error: --lr-knots and --lr-values: must have the same length (here 3 and 2)"),
    (["--lr-knots", "0,1"], "error: --lr-knots and --lr-values: must have the same length (here 2 and 3)"),
    (["--tta", "all"], "error: argument --tta: 'all' is not one of none, flip, flip_translate"),
    (["--flip", "sometimes"], "error: argument --flip: 'sometimes' is not one of none, random, alternate"),
    (["--act", "tanh"], "error: argument --act: 'tanh' is not one of relu, celu, gelu, silu"),
    (["--device", "gpu"], "error: --device gpu: not a device; use cpu, cuda, cuda:N, mps, ..."),
    (["--target", "0"], "error: --target 0: must be in (0, 1]"),
    (["--target", "1.5"], "error: --target 1.5: must be in (0, 1]"),
    (["--runs", "0"], "error: --runs 0: must be at least 1"),
    (["--label-smoothing", "2"], "error: --label-smoothing 2: must be between 0 and 1"),
    (["--dataset", "mnist"], "error: argument --dataset: 'mnist' is not one of cifar10, cifar100"),
    (["--epochs", "1e12"], "error: --epochs 1000000000000: must be between 0 and 1000"),
    (["--lr-values", "0,nan,0"], "error: --lr-values 0,nan,0: must be a finite number"),
    (["--muon-ns-coeffs", "1,2"], "error: --muon-ns-coeffs 1,2: must be 3 numbers separated by commas"),
    (["--block-widths", "64,256"], "error: --block-widths 64,256: must be 3 numbers separated by commas"),
    (["--bucket-mb=-1"], "error: --bucket-mb -1: must be a positive number of MB"),
    (["--bucket-mb", "nan"], "error: --bucket-mb nan: must be a positive number of MB"),
    (["--dist-timeout", "inf"], "error: --dist-timeout must be positive (minutes)"),
    (["--target", "nan"], "error: --target nan: must be in (0, 1]"),
]
DATA = [
    (["--batch-size", "512"], "error: --batch-size 512: larger than the 256 training images"),
    (["--subset", "100", "--batch-size", "128"], "error: --batch-size 128: larger than the 100 training images"),
    (["--subset", "1000"], "error: --subset 1000: larger than the 256 training images"),
    (["--cutout", "40", "--batch-size", "64"], "error: --cutout 40: larger than the 32x32 images"),
    (["--resolution-schedule", "24,40", "--batch-size", "64"],
     "error: --resolution-schedule 24,40: 40 is larger than the 32x32 images"),
]


@pytest.mark.parametrize("flags, message", NO_DATA, ids=[" ".join(f) for f, _ in NO_DATA])
def test_a_bad_flag_stops_before_the_data_is_loaded(flags, message, tmp_path, capsys):
    rc, err = run(cf.main, ["--data-dir", tmp_path / "none", "--device", "cpu", *flags], capsys)
    assert rc == 2 and err[-1] == message, err


@pytest.mark.parametrize("flags, message", DATA, ids=[" ".join(f) for f, _ in DATA])
def test_a_flag_too_large_for_the_data_stops_before_training(flags, message, npz, capsys, monkeypatch):
    monkeypatch.setattr(cf, "train_run", lambda *a, **k: pytest.fail("trained"))
    rc, err = run(cf.main, ["--data-dir", npz, "--device", "cpu", "--recipe", "fast94", *flags], capsys)
    assert rc == 2 and err[-1] == message, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_cuda_without_a_gpu(tmp_path, capsys):
    rc, err = run(cf.main, ["--data-dir", tmp_path, "--device", "cuda"], capsys)
    assert rc == 2 and err == ["error: --device cuda: this machine has no cuda device; use --device cpu"]


def test_a_gpu_index_beyond_the_count(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rc, err = run(cf.main, ["--data-dir", tmp_path, "--device", "cuda:2"], capsys)
    assert rc == 2 and err == ["error: --device cuda:2: this machine has 2 cuda devices, cuda:0 to cuda:1"]


def test_outputs_are_checked_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for script, args in ((cf.main, ["--data-dir", tmp_path, "--device", "cpu"]),
                         (inf.main, ["train", "--store", tmp_path, "--device", "cpu"])):
        rc, err = run(script, [*args, "--out", tmp_path], capsys)
        assert rc == 2 and err == [f"error: --out {tmp_path}: is a folder; give a file name"]
        rc, err = run(script, [*args, "--out", tmp_path / "file" / "r.json"], capsys)
        assert rc == 2
        assert err == [f"error: --out {tmp_path / 'file' / 'r.json'}: {tmp_path / 'file'} is a file, not a folder"]
    rc, err = run(inf.main, ["train", "--store", tmp_path, "--device", "cpu", "--checkpoint", tmp_path], capsys)
    assert rc == 2 and err == [f"error: --checkpoint {tmp_path}: is a folder; give a file name"]


def test_an_output_in_folders_not_yet_there_is_fine(npz, tmp_path, capsys):
    out = tmp_path / "new" / "folders" / "r.json"
    rc, err = run(cf.main, ["--data-dir", npz, "--device", "cpu", "--recipe", "fast94", "--epochs", "1", "--width",
                            "0.0625", "--batch-size", "128", "--out", out], capsys)
    assert rc == 0 and out.is_file(), err


@pytest.mark.parametrize("args, message", [
    (["train", "--store", "S", "--batch-size", "0"], "error: --batch-size 0: must be positive"),
    (["train", "--store", "S", "--epochs", "0"], "error: --epochs 0: must be positive"),
    (["train", "--store", "S", "--epochs", "1.5"], "error: --epochs 1.5: must be a whole number"),
    (["train", "--store", "S", "--crop-scale", "0.5,0.2"],
     "error: --crop-scale 0.5,0.2: must be two fractions, 0 < low <= high <= 1"),
    (["train", "--store", "S", "--min-res", "16"],
     "error: --res-step 32: rounds --min-res 16 to 0 pixels; use at most 16"),
    (["train", "--store", "S", "--schedule", "exp"],
     "error: argument --schedule: 'exp' is not one of linear, cosine, step, slow_start"),
    (["train", "--store", "S", "--device", "gpu"],
     "error: --device gpu: not a device; use cpu, cuda, cuda:N, mps, ..."),
    (["train", "--store", "S", "--val-crop", "1.5"], "error: --val-crop 1.5: must be between 0 and 1"),
    (["train", "--store", "S", "--loader-workers", "0"], "error: --loader-workers must be positive"),
    (["train", "--store", "S", "--decoder", "nvjpeg"],
     "error: argument --decoder: 'nvjpeg' is not one of auto, cpu, gpu, nvimgcodec"),
    (["simulate", "--gpus", "0"], "error: argument --gpus: '0': expected GPU counts of 1 or more separated by commas, "
                                  "e.g. 8,64"),
    (["simulate", "--gpus", "a,b"], "error: argument --gpus: 'a,b': expected GPU counts of 1 or more separated by "
                                    "commas, e.g. 8,64"),
    (["simulate", "--step-time", "0"], "error: argument --step-time: '0': must be positive"),
    (["simulate", "--backward-fraction", "2"], "error: argument --backward-fraction: '2': must be between 0 and 1"),
    (["simulate", "--latency-us", "-1"], "error: argument --latency-us: '-1': must not be negative"),
])
def test_imagenet_and_simulate_flags(args, message, capsys):
    rc, err = run(inf.main, args, capsys)
    assert rc == 2 and err == [message]
    if args[0] == "simulate":
        assert run(scaling.main_simulate, args[1:], capsys) == (2, [message])


def test_help_lists_the_allowed_values(capsys):
    with pytest.raises(SystemExit) as e:
        cf.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())         # argparse wraps the help's lines
    assert e.value.code == 0
    for choices in ("--tta {none,flip,flip_translate}", "--flip {none,random,alternate}", "--act {relu,celu,gelu,silu}",
                    "--dataset {cifar10,cifar100}", "--whiten-act {'',relu,celu,gelu,silu}"):
        assert choices in out
    # every setting says what it does and its value in the default recipe (or the value it takes when turned on)
    import settings
    assert out.count("(default: ") >= len(settings.leaves(cf.Recipe))
    for shown in ("--block-widths X,X,X fastnet's three blocks' channels (default: 64,256,256)",
                  "--lr-knots X,... fractions of the run where the rate's linear pieces meet (default: "
                  "0,0.20833333333333334,1)", "--bn-eps X added to the batch variance (default: 1e-05)",
                  "added to each eigenvalue (default: off; on: 0.01)",
                  "--whiten true|false Patch whitening (Myrtle 2018), on or off (default: off)"):
        assert shown in out, shown


def test_under_torchrun_only_rank_0_prints_the_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    for flags in (["--tta", "all"], ["--epochs", "0"]):
        assert run(cf.main, ["--data-dir", tmp_path, *flags], capsys) == (2, [])


@pytest.mark.parametrize("flags, message", [
    (["--shard-size", "0"], "error: --shard-size 0: must be positive"),
    (["--workers", "0"], "error: --workers 0: must be positive"),
    (["--max-shards", "0"], "error: --max-shards 0: must be positive"),
    (["--max-aspect", "0"], "error: --max-aspect 0: must be at least 1 (the longer side over the shorter)"),
    (["--max-aspect", "-1"], "error: --max-aspect -1: must be at least 1 (the longer side over the shorter)"),
    (["--size", "4"], "error: --size 4: must be at least 8"),
    (["--max-side", "4"], "error: --max-side 4: must be at least 8"),
    (["--quality", "0"], "error: --quality 0: must be 1..100"),
    (["--quality", "101"], "error: --quality 101: must be 1..100"),
    (["--format", "png"], "error: argument --format: 'png' is not one of jpeg, raw"),
])
def test_prepare_flags_are_checked_before_anything_is_written(flags, message, tmp_path, capsys):
    src = synthetic_imagefolder(tmp_path / "src", 2, 2, 1)
    rc, err = run(inf.main, ["prepare", "--src", src, "--dst", tmp_path / "store", *flags], capsys)
    assert (rc, err) == (2, [message])
    assert not (tmp_path / "store").exists()


def numeric_knobs(recipe_class):
    """Every setting of recipe_class that takes a number or numbers (not a switch, a choice or a preset)."""
    import settings
    return [leaf for leaf in settings.leaves(recipe_class) if "component" not in leaf.field.metadata
            and leaf.field.metadata.get("choices") is None and not isinstance(leaf.field.default, bool)]


def non_finite_cases(leaf):
    """(flag text, the error line) of each non-finite value the setting's flag can be given: NaN, +inf and -inf, in
    a tuple the first of its numbers."""
    import settings
    flag, default = "--" + leaf.name.replace("_", "-"), leaf.field.default
    for bad in ("nan", "inf", "-inf"):
        text = ",".join([bad, *map(settings.show, default[1:])]) if isinstance(default, tuple) else bad
        yield f"{flag}={text}", f"error: {flag} {text}: must be a finite number"


SCRIPTS = {"cifar10_fast": (cf.main, cf.Recipe, ["--data-dir", "none", "--device", "cpu"]),
           "imagenet_fast": (inf.main, inf.Recipe, ["train", "--store", "none", "--device", "cpu"])}
KNOBS = [(script, leaf) for script, (_, cls, _) in SCRIPTS.items() for leaf in numeric_knobs(cls)]


@pytest.mark.parametrize("script, leaf", KNOBS, ids=[f"{s} {leaf.name}" for s, leaf in KNOBS])
def test_every_setting_refuses_nan_and_infinity(script, leaf, capsys, monkeypatch):
    main, _, args = SCRIPTS[script]
    monkeypatch.setattr(D, "init_from_env", lambda *a, **k: pytest.fail("the flags passed"))
    for flag, message in non_finite_cases(leaf):
        assert run(main, [*args, flag], capsys) == (2, [message]), flag


LENGTHS = [(script, leaf) for script, leaf in KNOBS if leaf.field.metadata.get("length")]


@pytest.mark.parametrize("script, leaf", LENGTHS, ids=[f"{s} {leaf.name}" for s, leaf in LENGTHS])
def test_every_tuple_setting_refuses_the_wrong_length(script, leaf, capsys, monkeypatch):
    import settings
    main, _, args = SCRIPTS[script]
    monkeypatch.setattr(D, "init_from_env", lambda *a, **k: pytest.fail("the flags passed"))
    flag, default, n = "--" + leaf.name.replace("_", "-"), leaf.field.default, leaf.field.metadata["length"]
    for value in (default[:-1], default + default[-1:]):
        text = settings.show(value)
        assert run(main, [*args, f"{flag}={text}"], capsys) == (
            2, [f"error: {flag} {text}: must be {n} numbers separated by commas"]), text


def test_the_lengths_the_components_need_are_declared():
    assert {(s, leaf.name): leaf.field.metadata["length"] for s, leaf in LENGTHS} == {
        ("cifar10_fast", "block_widths"): 3, ("cifar10_fast", "muon_ns_coeffs"): 3,
        ("cifar10_fast", "muon_renorm_every"): 2, ("imagenet_fast", "crop_scale"): 2,
        ("imagenet_fast", "crop_ratio"): 2}
