"""A stand-in for the 2-second record's cifar10_speedrun.py (hiverge/cifar10-speedrun) on the CPU: no training, only
what the harness reads of the real one, namely the data where it loads it (./cifar10/train.pt), one loop
`for run in range(N):` that sets its run count, a table whose last row of each run has the epoch "eval", the
warm-up's row first, a progress line ended by a carriage return after each run, and the summary at its end.
Run i reports the accuracy 0.9400 + i / 10000 and the time 2.0 + i / 100 s. It imports no torch, to start fast."""
import statistics
import zipfile

assert zipfile.is_zipfile("cifar10/train.pt") and zipfile.is_zipfile("cifar10/test.pt")     # torch.save's format
columns = ["run   ", "epoch", "train_acc", "val_acc", "tta_val_acc", "time_seconds"]


def row(values):
    line = "".join(f"|  {str(v).rjust(len(c))}  " for v, c in zip(values, columns)) + "|"
    print(line)
    print("-" * len(line))


print("".join(f"|  {c}  " for c in columns) + "|")
row(["warmup", "eval", "0.1000", "0.1000", "0.1000", "9.9999"])
accs, times = [], []
for run in range(200):
    acc, seconds = 0.94 + (run + 1) / 10000, 2.0 + (run + 1) / 100
    row([run + 1, "eval", "0.9700", f"{acc - 0.0005:.4f}", f"{acc:.4f}", f"{seconds:.4f}"])
    accs.append(acc)
    times.append(seconds)
    print(f"Mean accuracy after {run + 1} runs: {sum(accs) / len(accs):.6f} | Mean time: "
          f"{sum(times) / len(times):.6f}s", end="\r", flush=True)
print()
spread = lambda xs: statistics.stdev(xs) if len(xs) > 1 else float("nan")
print("Accuracies: Mean: %.6f    Std: %.6f" % (sum(accs) / len(accs), spread(accs)))
print("Times (s):  Mean: %.6f    Std: %.6f" % (sum(times) / len(times), spread(times)))
