"""experiments.ipynb's pace on the machine that runs it: the CPU threads it trains with, each stage's expected time
from a few steps of the stage's own recipe timed here first, a progress bar per stage, and the figures its closing
note reports, computed from the run it closes."""
import math
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

import cifar10_fast as cf
from schedules import run_steps


def train_threads(device):
    """The intra-op threads torch trains with, set here: the count OMP_NUM_THREADS names if set, else one on a CPU;
    an accelerator's host threads are left as torch chose."""
    if torch.device(device).type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        # OpenMP's workers spin at every operation's barrier waiting for each other: where other processes share the
        # cores, one waits through the time slice of another that was descheduled, and a step of these small networks
        # took over ten times longer on two threads than on one
        torch.set_num_threads(1)
    return torch.get_num_threads()


def duration(seconds):
    """Seconds as people read them: "45 s" under 90 s, else "2.9 min"."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


@dataclass(frozen=True)
class Timing:
    """A recipe's pace on this machine, from two short epochs: the call's set-up (data to the device, the network
    built, FLOPs counted), the first epoch (with the whitening fit and the first steps' warm-up) and each later
    step, an evaluation without and with the recipe's test-time augmentation, and a run's remaining book-keeping."""
    set_up_s: float
    first_epoch_s: float
    first_epoch_steps: int
    step_s: float
    plain_eval_s: float
    final_eval_s: float
    run_extra_s: float


def time_steps(r, arrays, *, device, steps, test_images=250):
    """The Timing of recipe r on `device`: one cf.train run of two epochs of `steps` steps each on its first
    steps x batch training images, evaluated on `test_images` of the test images (scaled to all of them)."""
    images = min(steps * r.batch_size, len(arrays["train_labels"]))
    tested = min(test_images, len(arrays["test_labels"]))
    scale = len(arrays["test_labels"]) / tested             # an evaluation's time grows with its images
    arrays = {**arrays, "test_images": arrays["test_images"][:tested], "test_labels": arrays["test_labels"][:tested]}
    started = time.perf_counter()
    result = cf.train(replace(r, epochs=2.0), arrays, subset=images,
                      options=cf.Options(device=device, runs=1, eval_every=0))
    call_s, run = time.perf_counter() - started, result.runs[0]
    (first, second), flops = run["rows"], result.flops
    steps_per_epoch = run_steps(images, r.batch_size, 1.0)[0]
    final_eval_s = run["final_eval_time"] * scale
    return Timing(set_up_s=call_s - run["wall_s"], first_epoch_s=first["epoch_time"],
                  first_epoch_steps=steps_per_epoch, step_s=second["epoch_time"] / steps_per_epoch,
                  plain_eval_s=final_eval_s * flops["per_forward_image"] / flops["per_test_image"],
                  final_eval_s=final_eval_s, run_extra_s=max(0.0, run["wall_s"] - run["time"]))


def expected_run_s(timing, r, n_train):
    """Seconds one run of recipe r should take on n_train images, evaluated after every epoch (as the notebook
    trains): its Timing's first epoch, then every further step, evaluation and book-keeping."""
    steps = run_steps(n_train, r.batch_size, r.epochs)[1]
    epochs = math.ceil(r.epochs)
    return (timing.first_epoch_s + max(0, steps - timing.first_epoch_steps) * timing.step_s
            + (epochs - 1) * timing.plain_eval_s + timing.final_eval_s + timing.run_extra_s)


def expected_stage_s(timing, r, *, n_train, runs):
    """Seconds a cf.train call of `runs` runs of recipe r should take: its set-up and every run."""
    return timing.set_up_s + runs * expected_run_s(timing, r, n_train)


class Pace:
    """Every stage's planned, expected and actual seconds, in the order trained. A stage's expectation is its plan
    (its recipe's Timing) scaled by how the stage before it compared to its own plan: the machine's load now."""

    def __init__(self):
        self.stages = []        # (label, planned_s, expected_s, actual_s)

    def drift(self):
        """Actual over planned seconds of the last stage trained (1 before the first)."""
        return self.stages[-1][3] / self.stages[-1][1] if self.stages else 1.0

    def record(self, label, *, planned_s, expected_s, actual_s):
        self.stages.append((label, planned_s, expected_s, actual_s))


def stage_bar(label, *, epochs, runs, expected_s):
    """A tqdm bar on stderr counting a stage's epochs over all its runs, beside the time it should take."""
    from tqdm import tqdm
    return tqdm(total=runs * math.ceil(epochs), desc=label, unit="epoch", file=sys.stderr, leave=True,
                bar_format="{desc}: {bar:20} {n_fmt}/{total_fmt} epochs, {elapsed} of about "
                           f"{duration(expected_s)}{{postfix}}")


def ablation_sentence(ablation):
    """What switching each trick off did to fast94's accuracy: the drops and their p, then the tricks whose
    removal did not lower it."""
    rows = ablation.drop(index="fast94", errors="ignore")
    lowered = rows[rows["drop"] > 0].sort_values("drop", ascending=False)
    rest = rows[~(rows["drop"] > 0)]
    said = [f"{label} cost {row['drop']:.3f} (p = {row['p (drop)']:.2g})" for label, row in lowered.iterrows()]
    text = "switching each trick off in turn: " + ("; ".join(said) if said else "none lowered the accuracy")
    if len(rest) and said:
        text += (f"; {', '.join(rest.index)} did not lower it (the accuracy changed by "
                 f"{', '.join(f'{round(-d, 3) + 0.0:+.3f}' for d in rest['drop'])})")
    return text


def closing_note(*, elapsed_s, planned_s, cpu_s, threads, pace, journey, modern, ablation):
    """The closing note's lines, every figure from this run: its time against the plan, each stage's expected and
    actual time, the journey's accuracies and times beside Myrtle's, the modern recipes and the ablation."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    lines = [f"This run took {duration(elapsed_s)} ({cpu_s / 60:.1f} min of CPU time, {threads} thread"
             f"{'s' * (threads > 1)}" + (f", load average {load[2]:.1f} over the last 15 minutes" if load else "")
             + f"); planned {duration(planned_s)} from the steps timed at the start: {elapsed_s / planned_s:.2f}x.",
             "Each stage, expected then actual: "
             + ", ".join(f"{label} {duration(e)} / {duration(a)}" for label, _, e, a in pace.stages) + "."]
    parts = []
    for k, (name, row) in enumerate(journey.iterrows()):
        said = f"{name} {row['accuracy']:.3f} in {row['time (s)']:.0f} s"
        if k:
            said += f" ({row['ours / first']:.2f} of the first stage's time; Myrtle's {row['published / first']:.2f})"
        parts.append(said)
    lines.append("The journey's stages reached " + "; ".join(parts) + ".")
    spread = lambda row: f" (± {row['accuracy std']:.3f}, n = {row['n']:.0f})" if row["n"] > 1 else ""
    lines.append("Then " + "; ".join(f"{name} {row['accuracy']:.3f}{spread(row)} in {row['time (s)']:.0f} s"
                                      for name, row in modern.iterrows()) + ".")
    lines.append(f"In fast94's ablation (n = {ablation['n'].max():.0f} a variant), {ablation_sentence(ablation)}.")
    return lines


def spans_decades(values):
    """Whether the positive values span a factor of ten or more: an axis a log scale shows better."""
    values = np.asarray([v for v in values if v and v > 0], dtype=float)
    return len(values) > 1 and values.max() / values.min() >= 10
