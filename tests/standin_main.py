"""`python tests/standin_main.py SCRIPT ARGS...`: a training script's whole command in a process of its own under the
CPU stand-in for CUDA GPUs (tests/cuda_standin.py), under torchrun too (each rank its own stand-in GPU, cuda:RANK).
STANDIN_GPUS sets how many GPUs the machine has (default 2), STANDIN_MEMORY each one's bytes."""
import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from cuda_standin import StandIn  # noqa: E402

if __name__ == "__main__":
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    with StandIn(gpus=int(os.environ.get("STANDIN_GPUS", "2")),
                 memory=int(os.environ.get("STANDIN_MEMORY", 80 << 30))):
        runpy.run_path(script, run_name="__main__")
