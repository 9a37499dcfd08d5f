"""torchrun's store, which its agent serves to a job's workers before their process group exists: which attempt this
is (torchrun_attempt) and whether this process is the first of the attempt to count a line (first_to_say), so that
a line is said once in the job. Imports torch only in first_to_say, which torchrun's workers have.
"""
import os


def torchrun_attempt():
    """How many times torchrun has restarted this job's workers (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def first_to_say(what):
    """Whether this process is the first of its torchrun job's attempt to count `what`, in the store at MASTER_ADDR:
    MASTER_PORT (torchrun's agent's, which outlives its workers and serves them before their process group exists);
    True too where that store cannot be reached within seconds (its machine gone), so that a line is said at least
    once. Imports torch, which torchrun's workers have."""
    import datetime
    from torch.distributed import DistError, TCPStore
    try:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=5))
        key = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{torchrun_attempt()}/{what}"
        return store.add(key, 1) == 1
    except (KeyError, ValueError, RuntimeError, DistError):
        return True
