"""How a process ends: a child with its parent, even one killed (die_with_parent), and a script at once, its output
flushed, after Ctrl-C (exit_now). Nothing here imports torch.
"""
import os
import signal
import sys
import time


def die_with_parent(parent, ignore_interrupt=False):
    """In a child process: end when the process `parent` ends, even by SIGKILL (Linux's PR_SET_PDEATHSIG; elsewhere a
    thread that watches its pid); its pid is read by the parent, since the child's parent may by then be another.
    ignore_interrupt: Ctrl-C and SIGTERM (sent to a process group by `timeout` and SLURM) are the parent's to handle."""
    if ignore_interrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)        # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        import threading

        def watch():
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:            # the parent ended before the line above took effect
        os._exit(1)


def exit_now(status):
    """Ends this process at once with `status`, its output flushed and nothing more run: after Ctrl-C, whose line is
    printed and whose files are written, Python's finalisation of torch.compile's state holds the exit for seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
