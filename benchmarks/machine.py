"""The machine a result was measured on: the fingerprint every result of the suite embeds.

On a GPU: its name, SMs, memory, driver, CUDA and torch versions, SM clock and power limit (nvidia-smi),
and two measured ceilings: the bf16 dense matmul rate (8192^3, mean of 10 after warm-up, random inputs)
and device-to-device copy bandwidth (bytes read plus bytes written). On a CPU: its model and cores, and
the same two measurements in float32 at a smaller size.
"""
import datetime
import os
import platform
import re
import subprocess
import time


def slugify(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def nvidia_smi(*fields):
    """{field: value} from nvidia-smi for GPU 0; {} where it is absent or fails."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    return {f: v.strip() for f, v in zip(fields, out.split(","))}


def device_name(device):
    """The accelerator's name (devices.name), or the CPU's model and cores: the results' folder."""
    import devices
    return f"CPU {os.cpu_count()} cores {devices.cpu_name()}" if devices.is_cpu(device) else devices.name(device)


def measure_rates(device, size, copy_bytes, reps=10):
    """Mean matmul TFLOP/s (bf16 on a GPU, float32 on a CPU, size^3, random inputs, after warm-up) and
    copy GB/s (bytes read plus bytes written) over reps repetitions."""
    import torch
    import devices
    dtype = devices.compute_dtype(device)          # bf16 on a GPU, float32 on a CPU
    sync = lambda: devices.synchronize(device)
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    src = torch.randn(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)

    def timed(f):
        for _ in range(3):
            f()
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            f()
        sync()
        return (time.perf_counter() - start) / reps
    matmul_s = timed(lambda: a @ b)
    copy_s = timed(lambda: dst.copy_(src))
    return {"matmul_dtype": str(dtype)[6:], "matmul_size": size, "matmul_tflops": 2 * size ** 3 / matmul_s / 1e12,
            "copy_bytes": 2 * src.numel() * 4, "copy_gbps": 2 * src.numel() * 4 / copy_s / 1e9, "reps": reps}


def fingerprint(device, smoke):
    import torch

    import devices
    fp = {"device_name": device_name(device), "device": str(device), "torch": torch.__version__,
          "load_average_1min": os.getloadavg()[0],          # other work on the host slows a CPU (and a GPU's feeder)
          "python": platform.python_version(), "host_cpu": devices.cpu_name(), "host_cores": os.cpu_count(),
          "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        fp.update(sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2 ** 30, 1),
                  cuda=torch.version.cuda)
        smi = nvidia_smi("driver_version", "clocks.sm", "clocks.max.sm", "power.limit", "clocks.mem")
        fp.update(driver=smi.get("driver_version"), sm_clock_mhz=smi.get("clocks.sm"),
                  max_sm_clock_mhz=smi.get("clocks.max.sm"), power_limit_w=smi.get("power.limit"),
                  mem_clock_mhz=smi.get("clocks.mem"))
        fp.update(measure_rates(device, 8192, 2 ** 30))
        # the clock right after the matmuls (nvidia-smi reads the idle clock before them)
        fp["sm_clock_after_matmul_mhz"] = nvidia_smi("clocks.sm").get("clocks.sm")
    else:
        fp["threads"] = torch.get_num_threads()
        fp.update(measure_rates(device, 256 if smoke else 2048, 2 ** 22 if smoke else 2 ** 28))
    fp["slug"] = slugify(fp["device_name"])
    return fp


def alternating(fns, reps):
    """{name: [seconds of each call]} for the dict of callables fns, called in turn, reps rounds: A B A B ..., so
    that the machine's drift falls on all of them alike."""
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times
