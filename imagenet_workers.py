"""The CPU's decoding worker processes: started once a run first needs them (forked while CUDA has not started, so
that they share the memory-mapped store, else spawned), each decoding its part of a batch (imagenet_decoders.cpu_crop)
into a staging buffer of shared memory that the training process reads (imagenet_data.cpu_batches). No lock is shared
between them.
"""
import math
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from core import DataError
from imagenet_decoders import cpu_crop, damaged_record, pil_decodes
from imagenet_store import open_store
from processes import die_with_parent

WORKER = {}     # in a decoding worker: the store it inherited and the staging buffers it has opened
STAGED = 3      # staging buffers: the batch the caller works on and the two decoding meanwhile


def default_workers(processes_on_node=1):
    """How many decoding processes a training process starts: its share of the cores this process may run on, less
    one for the training thread and one for the reader thread, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, processes_on_node) - 2)


def worker_start(parent, store):
    """A decoding worker's set-up: it ends with its parent and leaves Ctrl-C to it, and keeps the store it inherited
    (forked: the memory-mapped file itself, nothing copied) or opens it from its folder (spawned)."""
    die_with_parent(parent, True)
    WORKER.update(store=open_store(store) if isinstance(store, str) else store, buffers={})


def decode_part(split, path, *, shape, start, rows, boxes):
    """In a decoding worker: cpu_crop of each store row of split into images start, start + 1, ... of the
    staging file at path, a uint8 (n, height, width, 3) batch at its start."""
    buffers = WORKER["buffers"]
    if path not in buffers:
        while len(buffers) >= STAGED:            # the staging buffers take turns; an older one was replaced
            del buffers[next(iter(buffers))]
        buffers[path] = np.memmap(path, dtype=np.uint8, mode="r+")
    out = buffers[path][:math.prod(shape)].reshape(shape)
    records = WORKER["store"].train if split == "train" else WORKER["store"].val
    raw = WORKER["store"].format == "raw"
    for k, (r, box) in enumerate(zip(rows, boxes)):
        raw_shape = (int(records.rows["height"][r]), int(records.rows["width"][r])) if raw else None
        try:
            out[start + k] = cpu_crop(records.record(r), box=box, shape=shape[1:3], raw_shape=raw_shape)
        except Exception as e:      # a damaged record: named, not the worker's traceback; anything else raised whole
            if raw or pil_decodes(records.record(r)):
                raise
            raise DataError(damaged_record(WORKER["store"], split, r, e)) from None


def decoding_pool(data):
    """data's decoding workers, started on first use: `data.workers` processes that end with this one, forked from it
    (so they share its memory-mapped store) while it has not started CUDA, else spawned (a fork would copy CUDA's
    threads and driver state half-made), each opening the store from its folder."""
    if data.pool is None:
        forked = not torch.cuda.is_initialized()
        store = data.store if forked else os.path.dirname(data.store.train.data.filename)
        data.pool = ProcessPoolExecutor(data.workers, mp_context=multiprocessing.get_context(
            "fork" if forked else "spawn"), initializer=worker_start, initargs=(os.getpid(), store))
    return data.pool


def staging(data, slot, nbytes):
    """The shared file of staging buffer `slot` (0 ... STAGED - 1), holding at least nbytes: (its path, a uint8 numpy
    view of it). A larger one replaces it when needed. In /dev/shm where it has room for all of them (a full one would
    kill the writer with SIGBUS; containers often give it 64 MB), else in the temporary folder's page cache."""
    held = data.staging.get(slot)
    if held is None or held[1].nbytes < nbytes:
        shm = os.path.isdir("/dev/shm") and os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
        f = tempfile.NamedTemporaryFile(prefix="decode-", dir="/dev/shm" if shm and shm > 2 * STAGED * nbytes else None)
        f.truncate(max(nbytes, 1))
        data.staging[slot] = held = (f, np.memmap(f.name, dtype=np.uint8, mode="r+"))   # the file goes with f
    return held[0].name, held[1]
