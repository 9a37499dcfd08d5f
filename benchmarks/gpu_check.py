"""The measurements a lent GPU makes first, in this order, as one command (the suite's pieces, so that every run goes
into results/<device>/ through its result writing, and a later call goes on from the finished runs):

  1. env                 the machine's fingerprint and every recipe's counted FLOPs (tier 0)
  2. fast94_next_record  fast94_next beside the 2-second record's own cifar10_speedrun.py, n = 25 each: ours 13, the
                         record's 25 in one process (only its run count edited), ours 12, on the same GPU and data
  3. fast94_fastest      fast94_fastest and each switch's ablation in turn with fast94_next in one process, n = 10 each

    python benchmarks/gpu_check.py --data-dir /root/cifar10.npz            # the record fetched into peers/ first
    python benchmarks/gpu_check.py --smoke     # the same pieces tiny, on the CPU under tests/cuda_standin.py

The headline beside E1 and the record, under both timings, in two calls of one lease: benchmarks/lease.py (its
`plan` prints the calls; its `smoke` is this script's --smoke for them).

Device time, an estimate made before any GPU ran it (inputs: the H200's measured cold max-autotune start of a
side_by_side command, 252 s for fast94 and 164 s for fast94_next, results/nvidia-h200/; fast94_next's 1.14 s a run;
the record's own cold start taken as fast94_next's, its 6e9-cycle spin before each run about 3 s, its run 1.1 s):
1 about 20 s; 2 about 165 + 25 x 1.2 + 165 + 25 x 4.5 = 470 s; 3 about 60 (fast94_next warm from the shared compile
cache) + 150 (fast94_fastest's second resolution cold) + 30 (its compiled optimiser step, cold; not measured) + 20 x
1.2 = 264 s: about 13 minutes in all, more than one call's 10. So --budget-s (default 540) stops it cleanly where
its estimate would overrun, and the same command in a second call goes on from the finished runs.
"""
import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from core import Parser  # noqa: E402
import suite  # noqa: E402

PIECES = ("env", "fast94_next_record", "fast94_fastest")
RUNS = {"fast94_next_record": {"fast94_next": 25, "record": 25},
        "fast94_fastest": {s: 10 for s in suite.FASTEST_SIDES}}


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="CIFAR-10 as one .npz (as for the suite)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no work whose estimate overruns this")
    p.add_argument("--results", default=None, help="results folder (default results/; with --smoke a temporary one)")
    p.add_argument("--copy-to", default=None, help="also write each result into DIR/<device>/")
    p.add_argument("--runs", type=int, default=None,
                   help="runs of every side of both pieces (default: RUNS, 25 beside the record and 10 in turn)")
    p.add_argument("--smoke", action="store_true", help="the same pieces tiny, on the CPU under CUDA's stand-in")
    args = p.parse_args(argv)
    if args.runs is not None and args.runs < 2:
        p.error("--runs must be at least 2 (a ratio's interval)")
    return args


def runs_wanted(runs):
    """RUNS, or every side at `runs` where it is given."""
    return RUNS if runs is None else {piece: dict.fromkeys(sides, runs) for piece, sides in RUNS.items()}


def suite_argv(args):
    """The suite's command line for these pieces."""
    return ["--pieces", ",".join(PIECES), *([] if args.smoke else ["--budget-s", str(args.budget_s)]),
            *(["--data-dir", args.data_dir] if args.data_dir else []),
            *(["--results", args.results] if args.results else []),
            *(["--copy-to", args.copy_to] if args.copy_to else [])]


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        return smoke(args)
    import torch
    if not torch.cuda.is_available():
        print("error: gpu_check measures a CUDA GPU; use --smoke on the CPU", file=sys.stderr)
        return 1
    if not args.data_dir:
        print("error: --data-dir: CIFAR-10 as one .npz (the GPU machines have no network)", file=sys.stderr)
        return 2
    if not (suite.RECORD_DIR / suite.RECORD_SCRIPT).is_file():
        print(f"error: the record's script is not at {suite.RECORD_DIR / suite.RECORD_SCRIPT}: fetch "
              f"github.com/hiverge/cifar10-speedrun's {suite.RECORD_SCRIPT} there (never its run.sh)", file=sys.stderr)
        return 1
    return suite.main(suite_argv(args), n=runs_wanted(args.runs))


def smoke(args):
    """The pieces tiny (the suite's --smoke: n = 2, the record's stand-in, no budget) in this process, as on a GPU:
    under tests/cuda_standin.py, whose matmul rate is measured at the CPU smoke's sizes."""
    sys.path.insert(0, str(ROOT / "tests"))
    import machine
    from cuda_standin import StandIn
    measure = machine.measure_rates
    small = lambda device, size, nbytes: measure(device, 256, 2 ** 22)     # the stand-in's matmuls run on the CPU
    with contextlib.ExitStack() as stack:
        results = args.results or stack.enter_context(tempfile.TemporaryDirectory())
        stack.enter_context(StandIn())
        stack.enter_context(mock.patch.object(machine, "measure_rates", small))
        return suite.main(["--smoke", "--device", "cuda", *suite_argv(argparse.Namespace(**{**vars(args),
                                                                                            "results": results}))])


if __name__ == "__main__":
    sys.exit(main())
