"""Writes every results table of README.md and docs/*.md from results/ (and the scaling model's table in
docs/scaling.md from scaling.py), so that no figure is typed by hand: each table sits between
`<!-- report:NAME -->` and `<!-- /report:NAME -->` and is replaced whole; a piece with no result reads
"not measured". It draws README's picture too (FIGURE: ours beside the fastest peer measured on the device, then
beside airbench), a PNG that carries the digest of what it draws, so that --check finds it stale without comparing
pixels; and it writes the line above each recipe in cifar10_recipes.py: our figure on a GPU beside the published one.

    python benchmarks/report.py             # rewrite the tables and the recipes' lines, redraw the figure
    python benchmarks/report.py --check     # exit 1, naming what differs from results/

results/<device>/*.json are written by benchmarks/suite.py and benchmarks/compare.py (smoke results are never
shown); a table shows each result's command where its script is still here, and the commit it ran, or that it names
none.
"""
import argparse
import difflib
import hashlib
import inspect
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from core import Parser  # noqa: E402
NM = "not measured"


def side_by_side_pieces():
    """(our recipe, the peer beside it) of every side-by-side piece of the suite, in its order."""
    from suite import pieces
    return [tuple(pc.sides) for pc in pieces() if pc.kind == "side_by_side"]


DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))


class ResultsError(Exception):
    """A results file the report cannot read: its one line names the file (nothing is rewritten)."""


def load_results(folder, smoke=False):
    """{piece: [result, ...]} over every device folder, devices in name order; smoke results only if asked. A file
    that is not a JSON object (empty, cut short, another kind of file) raises ResultsError: a table drawn without it
    would say "not measured" of what was measured."""
    out = {}
    for path in sorted(Path(folder).glob("*/*.json")):
        try:
            text = path.read_text()
            r = json.loads(text)
        except (OSError, ValueError) as e:          # UnicodeDecodeError is a ValueError
            why = ("empty" if not text.strip() else f"not JSON: {e}") if isinstance(e, json.JSONDecodeError) else (
                e.strerror if isinstance(e, OSError) else "not UTF-8 text")
            raise ResultsError(f"{path}: not a readable results file ({why}); restore it (git checkout -- FILE) or "
                               "remove it") from None
        if not isinstance(r, dict):
            raise ResultsError(f"{path}: a JSON {type(r).__name__}, not a results record (a JSON object); restore it "
                               "(git checkout -- FILE) or remove it")
        if smoke or not r.get("smoke"):
            r["_file"] = f"results/{path.parent.name}/{path.name}"      # where a table says it is kept
            out.setdefault(r.get("piece", path.stem), []).append(r)
    return out


# ----------------------------------------------------------------------------------------------
# Formatting

def pct(s, target=None):
    """A mean (and spread) in percent to 0.01, or to as many digits as show on which side of `target` it lies."""
    if not s or s.get("mean") is None:
        return NM
    digits, show = 2, lambda v, d: f"{100 * v:.{d}f}"
    while target is not None and s["mean"] != target and show(s["mean"], digits) == show(target, digits) and digits < 6:
        digits += 1
    return f"{show(s['mean'], digits)}%" + (f" ± {100 * s['std']:.2f}" if s["n"] > 1 else "")  # no spread of one run


def secs(s, std=True):
    if not s or s.get("mean") is None:
        return "–"
    return f"{s['mean']:.2f} s" + (f" ± {s['std']:.2f}" if std and s.get("n", 2) > 1 else "")   # no spread of one run


def timed(st, std=True):
    """The time of a side's statistics, flagged when torch.compile compiled inside some of its timed runs."""
    k = st.get("recompiled_runs")
    return secs(st["time"], std) + (f" (compiled inside the clock in {k} run{'s' * (k > 1)})" if k else "")


def pval(p):
    """p to two digits; near 1 to the digits that keep it from reading 1 (a mean far on the other side)."""
    if p is None:
        return "–"
    if p < 1e-4:
        return "< 1e-4"
    if p > 1 - 1e-4:
        return "> 0.9999"
    return f"{p:.2g}" if p < 0.99 else f"{p:.4f}".rstrip("0")


def device(r):
    return r["fingerprint"]["device_name"]


def n_of(side):
    n, want = len(side["runs"]), side["n_wanted"]
    return f"{n}" if n >= want else f"{n} (partial, of {want})"


def code(cmd):
    return f"`{cmd}`"


def command_of(r, cmd):
    """A result's command as the tables show it: as typed where its script is still here, else the file its record is
    kept in (a script since folded into benchmarks/compare.py)."""
    script = next((w for w in cmd.split() if w.endswith(".py")), None)
    if script and (ROOT / script).is_file():
        return code(cmd)
    return f"an earlier script since folded into `benchmarks/compare.py` (its command in {r.get('_file', 'results/')})"


def commit_of(r):
    """The code a result ran, in words: its commit (and whether it had changes not committed), or that it names none."""
    ran = r.get("code") or {}
    if not ran.get("commit"):
        return "commit not recorded"
    return f"commit {ran['commit'][:7]}" + (" with uncommitted changes" if ran.get("dirty") else "")


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def sides(results, piece, side):
    """(result, side dict) for every device that measured this side of this piece."""
    return [(r, r["sides"][side]) for r in results.get(piece, []) if r.get("sides", {}).get(side, {}).get("runs")]


def counted(results, recipe):
    """Counted FLOPs per run of a recipe, from any env.json (the count is the same on every device)."""
    for r in results.get("env", []):
        f = r.get("counted_flops", {}).get(recipe)
        if f:
            return f["total"]
    return None


def pflop(f, note=""):
    return NM if not f else f"{f / 1e15:.3f} PFLOP{note}"


# ----------------------------------------------------------------------------------------------
# Tables

def t_flops(results):
    env = next((r for r in results.get("env", []) if r.get("counted_flops")), None)
    rows = []
    for recipe, f in (env or {}).get("counted_flops", {}).items():
        if recipe.startswith(("fast9", "myrtle")):      # the speed recipes, not the journey's stages (faster_bn)
            views, fraction = f.get("tta_views", 1), f.get("tta_fraction", 1.0)
            # selective TTA: the plain pass on every test image, the other views on `fraction` of them
            forward = f.get("per_forward_image", f["per_test_image"] / (1 + fraction * (views - 1)))
            on = f" on {fraction:.0%} of the images" if views > 1 and fraction < 1 else ""
            rows.append([recipe, f"{f['parameters']:,}", f"{forward / 1e9:.4f}",
                         f"{f['per_train_image'] / 1e9:.4f}", f"{f['train'] / 1e15:.4f}",
                         f"{f['final_eval'] / 1e12:.3f} ({views} view{'s' * (views > 1)}{on})",
                         f"{f['total'] / 1e15:.4f}"])
    return table(["recipe", "parameters", "forward GFLOP/image", "train GFLOP/image", "training PFLOP",
                  "final eval TFLOP", "total PFLOP/run"], rows or [["–", NM, NM, NM, NM, NM, NM]])


def t_env(results):
    rows = []
    for r in results.get("env", []):
        fp = r["fingerprint"]
        gpu = fp.get("sm_count") is not None
        rows.append([fp["device_name"], fp.get("sm_count", "–") if gpu else f"{fp.get('host_cores')} cores",
                     f"{fp['memory_gib']} GiB" if gpu else "–", fp.get("driver") or "–", fp.get("cuda") or "–",
                     fp["torch"],
                     f"{fp.get('sm_clock_after_matmul_mhz') or '–'} / {fp.get('max_sm_clock_mhz') or '–'} MHz"
                     if gpu else "–", f"{fp.get('power_limit_w') or '–'} W" if gpu else "–",
                     f"{fp['matmul_tflops']:.1f} TFLOP/s ({fp['matmul_dtype']}, {fp['matmul_size']}³, "
                     f"mean of {fp['reps']})",
                     f"{fp['copy_gbps']:.0f} GB/s",
                     f"{fp['load_average_1min']:.1f}" if "load_average_1min" in fp else "–",
                     fp["date"][:10]])
    return table(["device", "SMs", "memory", "driver", "CUDA", "torch", "SM clock after matmuls / max", "power limit",
                  "measured matmul rate", "copy bandwidth (read + write)", "host load (1 min)", "date"],
                 rows or [["GPU"] + [NM] * 11])


def t_plain(results, pieces, target=0.94, cpu=False):
    rows = []
    for piece, recipe in pieces:
        found = sides(results, piece, recipe)
        for r, s in found:
            st = s["stats"]
            rows.append([recipe, device(r), command_of(r, s["command"]), commit_of(r), n_of(s),
                         pct(st["accuracy"], target), pval(st["p_mean_above_target"]), timed(st),
                         secs(st["time_to_target"], std=False), f"{100 * st['fraction_reaching_target']:.0f}%"])
        if not found and not cpu:
            rows.append([recipe, "GPU", "see docs/measuring.md", "–", "–", NM, NM, NM, NM, NM])
    return table(["recipe", "device", "command", "code", "n", "final test accuracy (mean ± std)",
                  f"p (mean > {100 * target:.0f}%)", "time (mean ± std)", f"time to {100 * target:.0f}% (mean)",
                  f"runs reaching {100 * target:.0f}%"], rows)


def t_fast(results):
    rows = []
    for recipe, _ in side_by_side_pieces():
        found = sides(results, recipe, recipe)
        for r, s in found:
            st = s["stats"]
            rows.append([recipe, device(r), command_of(r, s["command"]), commit_of(r), n_of(s),
                         pct(st["accuracy"], 0.94), pval(st["p_mean_above_target"]), timed(st),
                         pflop(st.get("flops_per_run")),
                         f"{st['tflops_per_s']:.0f}" if st.get("tflops_per_s") else "–"])
        if not found:
            rows.append([recipe, "GPU", "see docs/measuring.md", "–", "–", NM, NM, NM,
                         pflop(counted(results, recipe), " (counted)"), NM])
    return table(["recipe", "device", "command", "code", "n", "accuracy (mean ± std)", "p (mean > target)",
                  "time (mean ± std)", "FLOPs per run", "achieved TFLOP/s"], rows)


def t_side_by_side(results):
    rows = []
    for recipe, peer in side_by_side_pieces():
        found = [r for r in results.get(recipe, []) if r["sides"][recipe]["runs"]]
        for r in found:
            a, b = r["sides"][recipe], r["sides"][peer]
            ratio, after = r.get("time_ratio"), r.get("time_ratio_after_construction")
            rows.append([f"{recipe} / {peer}", device(r), commit_of(r), f"{n_of(a)} / {n_of(b)}",
                         f"{pct(a['stats']['accuracy'], a.get('target'))} "
                         f"(p {pval(a['stats']['p_mean_above_target'])})",
                         f"{pct(b['stats']['accuracy'], b.get('target'))} "
                         f"(p {pval(b['stats']['p_mean_above_target'])})"
                         if b["runs"] else "not run (needs `pip install airbench` and a GPU)",
                         f"{timed(a['stats'], False)} / {timed(b['stats'], False)}",
                         interval(ratio) if ratio else "–", interval(after, n_of=len(b["runs"])) if after else NM])
        if not found:
            rows.append([f"{recipe} / {peer}", "GPU", "–", "–", NM, NM, NM, NM, NM])
    return table(["ours / peer", "device", "code", "n (ours / peer)", "our accuracy (p: mean > target)",
                  "peer's accuracy (p: mean > target)", "mean time (ours / peer)", "time ratio [95% CI]",
                  "time ratio, the peer's model construction left out as ours is [95% CI]"], rows)


COMPARE_COMMAND = ("python benchmarks/compare.py --sides fast94_next,e1,hiverge,airbench94 --runs 25 "
                   "--data-dir cifar10.npz")
PEER_NAMES = {"hiverge": "the 2-second record (hiverge)", "e1": "E1 (Fulcrum)"}


def comparisons(results):
    """Every comparison measured (benchmarks/compare.py's, and one from an earlier script), its builds alone left out:
    each result whose headline holds both clocks."""
    return [r for found in results.values() for r in found
            if "ours_s" in r.get("headline", {}) and not r.get("build_only")]


def t_compare(results):
    """Each comparison's headline: each of our recipes beside each peer, the same runs under both clocks, the 6-view
    accuracy of each side; a row for each of E1 and the record not yet measured."""
    rows = []
    for r in comparisons(results):
        for pair in r["headline"]["ours_s"]["ratios"]:
            ours, peer = pair.split("/")
            a, b = (r["headline"]["ours_s"]["sides"][s] for s in (ours, peer))
            accuracy = [f"{pct(x['accuracy_6view'], 0.94)} (p {pval(x.get('p_6view_above_target'))})" for x in (a, b)]
            times = [f"{secs(r['headline'][t]['sides'][ours]['time'], False)} / "
                     f"{secs(r['headline'][t]['sides'][peer]['time'], False)}, "
                     + (interval(r["headline"][t]["ratios"][pair]) if r["headline"][t]["ratios"][
                         pair] else "–") for t in ("ours_s", "fulcrum_s")]
            rows.append([f"{ours} / {peer}", r.get("device_name") or NM, command_of(r, r.get("command", "–")),
                         commit_of(r), f"{a['n']} / {b['n']}", *accuracy, *times])
    for peer in ("e1", "hiverge"):
        if not any(row[0].endswith(f" / {peer}") for row in rows):
            rows.append([f"fast94_next / {peer}", "GPU", code(COMPARE_COMMAND), "–", "–", NM, NM, NM, NM])
    return table(["ours / peer", "device", "command", "code", "n (ours / peer)", "our 6-view accuracy (p: mean > 94%)",
                  "peer's 6-view accuracy (p: mean > 94%)", "our clock: mean time (ours / peer), ratio [95% CI]",
                  "the Fulcrum harness's clock: mean time (ours / peer), ratio [95% CI]"], rows)


def interval(ratio, *, n_of=None):
    """A ratio with its confidence interval, and the n of its denominator's runs where fewer than n_of counted."""
    fewer = n_of is not None and ratio.get("n_to", n_of) < n_of
    return f"{ratio['ratio']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]" + (
        f" (the peer's n = {ratio['n_to']})" if fewer else "")


def t_journey(results):
    import cifar10_fast as cf
    found = [r for r in results.get("journey", []) if any(s["runs"] for s in r["sides"].values())]
    rows = []
    for i, stage in enumerate(cf.JOURNEY):
        name = stage["name"]
        ours = []
        for r in found:
            s = r["sides"].get(name)
            if s and s["runs"]:
                ours.append(f"{secs(s['stats']['time'], False)}, {pct(s['stats']['accuracy'], s.get('target'))} "
                            f"(n={len(s['runs'])}, {device(r)})")
        rows.append([f"`{name}`", stage["doc"], f"{stage['published_v100_s']} s", "; ".join(ours) or NM])
    return table(["stage", "changes from the stage before (Myrtle's numbers)", "published V100 time",
                  "ours: mean time, accuracy (mean ± std)"], rows)


def t_throughput(results):
    rows = []
    for r in results.get("imagenet_throughput", []):
        for row in r.get("rows", []):
            per_core = "–" if row.get("loader/core") is None else f"{row['loader/core']:.0f}"
            pil = "–" if row.get("pil/core") is None else f"{row['pil/core']:.0f}"
            rows.append([device(r), f"{r['fingerprint']['load_average_1min']:.1f}", row["res"],
                         f"{row['loader']:.0f}", f"{row['ceiling']:.0f}", f"{row['together']:.0f}",
                         f"{row['together/ceil']:.3f}", per_core, pil])
    header = ["device", "load (1 min)", "res", "loader img/s", "ceiling img/s", "together img/s", "together / ceiling",
              "loader img/s per core", "PIL ImageFolder img/s per core"]
    if not rows:
        rows = [["GPU", "–", res] + [NM] * 6 for res in (160, 192)]
    cmd = next((r["command"] for r in results.get("imagenet_throughput", [])), None)
    out = table(header, rows) + ([""] + [f"Command: {code(cmd)}."] if cmd else [])
    counted = [(r, c) for r in results.get("imagenet_throughput", []) for c in r.get("counts", [])]
    if not counted:
        return out + ["", f"Operations and blocking copies per step: {NM}."]
    models = sorted({f"{r['count_model']}{' + BlurPool' if r['count_blurpool'] else ''}" for r, _ in counted})
    return out + ["", "Per step, counted under the CPU stand-in for a CUDA GPU (`tests/cuda_standin.py`: "
                      f"every operation on a GPU tensor, and the copies that make the host wait), {', '.join(models)}, "
                      "bf16 autocast, "
                      "the second step of an epoch, same command:", ""] + table(
        ["store", "batch", "data path: GPU operations", "data path: blocking copies", "whole step: GPU operations",
         "whole step: blocking copies"],
        [[c["store"], c["batch"], c["data ops"], c["data blocking"], c["step ops"], c["step blocking"]]
         for _, c in counted])


def t_imagenet_gpu(results):
    """The first ImageNet run on a GPU (benchmarks/imagenet_gpu_check.py): each decoder alone, each network's step
    alone and fed by each GPU decoder, at each size; then a line for the images, the killed run and the race."""
    from devices import size_text
    rows, lines = [], []
    for r in results.get("imagenet_gpu_check", []):
        for row in r["rows"]:
            if row["check"] not in ("decoder", "step", "together") or "skipped" in row:
                continue
            memory = ("–" if row.get("peak_memory_bytes") is None else
                      f"{size_text(row['peak_memory_bytes'])} ({size_text(row['estimated_bytes'])})")
            counts = ", ".join(f"{path} {n}" for path, n in row.get("decode_counts", {}).items()) or "–"
            rate = f"not run: {row['error']}" if "error" in row else f"{row['images_per_s']:.0f}"
            share = f"{row['of_step_alone']:.3f}" if "of_step_alone" in row else "–"
            net = f"`{row['recipe']}` ({row['model']})" if "recipe" in row else "–"
            rows.append([device(r), WHAT[row["check"]], net, row["res"], row["batch"], row.get("decoder", "–"), rate,
                         share, memory, counts])
        lines += ["", imagenet_gpu_line(r)]
    if not rows:
        rows = [["GPU", WHAT["step"], f"`{name}` ({model})", res, "–", "–", NM, "–", NM, "–"]
                for name, model in (("rn50_16ep", "resnet50"), ("rn18_16ep", "resnet18")) for res in (160, 224)]
    return table(["device", "check", "recipe (network)", "res", "batch", "decoder", "images/s", "of the step alone",
                  "peak memory (estimate)", "decodes by path"], rows) + lines


WHAT = {"decoder": "decoder alone", "step": "step alone", "together": "decoder feeding the step"}


def imagenet_gpu_line(r):
    """The check's other rows in a line: its images, the training killed and resumed, the race, the host waits."""
    by = {row["check"]: row for row in r["rows"]}
    said = [f"Command: {code(r['command'])}"]
    if "images" in by:
        i = by["images"]
        said.append(f"{i['images']:,} training JPEGs, mean {i['mean_width']:.0f} × {i['mean_height']:.0f} px")
    for name in ("train", "race", "sync"):
        row = by.get(name, {})
        if "skipped" in row or not row:
            said.append(f"{name}: {row.get('skipped', NM)}")
        elif name == "train":
            said.append(f"training killed (exit {row['first']['returncode']}) and resumed (exit "
                        f"{row['resumed']['returncode']}: {row['resumed']['resumed_line'] or 'no resumed line'})")
        elif name == "race":
            races = [x for x in r["rows"] if x["check"] == "race" and "equal" in x]
            said.append("the same batches quiet and under load: " + (", ".join(
                f"{x['decoder']} {'equal' if x['equal'] else str(x['differing']) + ' differing'}" for x in races)
                or NM))
        else:
            said.append(f"host waits over {row['steps']} steps: {row.get('host_waits', NM)}")
    return "; ".join(said) + "."


def t_prepare(results):
    rows = []
    for r in results.get("imagenet_prepare", []):
        for row in r["rows"]:
            rows.append([device(r), r.get("source", "–"), row["format"], row["images"], f"{row['images/s']:.0f}",
                         f"{row['read GB/s']:.3f}", f"{row['written GB/s']:.3f}",
                         f"{row['store GB'] / row['source GB']:.2f}"])
    if not rows:
        return [f"`prepare` throughput: {NM}."]
    cmds = sorted({code(r["command"]) for r in results.get("imagenet_prepare", [])})
    return table(["machine", "source", "format", "images", "images/s", "source GB/s read", "store GB/s written",
                  "store / source bytes"], rows) + ["", f"Commands: {', '.join(cmds)} ({r['workers']} workers, median "
                                                        f"of {r['repeats']})."]


def t_decoders(results):
    rows = []
    for r in results.get("jpeg_decoders", []):
        for row in r["rows"]:
            rows.append([device(r), r["res"], f"`{row['method']}`", f"{row['ms per image']:.3f}",
                         f"{row['images/s per core']:.0f}", row["n"]])
    if not rows:
        return [f"CPU JPEG decoders: {NM}."]
    cmds = sorted({code(r["command"]) for r in results.get("jpeg_decoders", [])})
    return table(["machine", "crop res", "method", "ms per image (median)", "images/s per core", "n"], rows) + [
        "", f"Command: {', '.join(cmds)}."]


def t_cpu_loaders(results):
    rows = []
    for r in results.get("cpu_loaders", []):
        load = f"{r['fingerprint']['load_average_1min']:.1f}"
        for row in r["rows"]:
            rows.append([device(r), load, row["res"], f"`{row['method']}`", r["workers"], f"{row['images/s']:.0f}",
                         f"{row['images/s per core']:.0f}", f"{row['n']} × {row['repeats']}"])
    if not rows:
        return [f"CPU loaders side by side: {NM}."]
    cmds = sorted({code(r["command"]) for r in results.get("cpu_loaders", [])})
    return table(["machine", "load (1 min)", "res", "method", "workers", "images/s (median)", "images/s per core",
                  "n (images × repeats)"], rows) + ["", f"Command: {', '.join(cmds)}."]


def t_cpu_layout(results):
    """Each recipe's step and evaluation forward on the CPU in both layouts (benchmarks/cpu_layout.py)."""
    rows = []
    for r in results.get("cpu_layout", []):
        by = {(row["recipe"], row["layout"]): row for row in r["rows"]}
        for name in dict.fromkeys(row["recipe"] for row in r["rows"]):
            a, b = by[name, "contiguous"], by[name, "channels_last"]
            rows.append([device(r), f"{r['fingerprint']['load_average_1min']:.1f}", r["threads"], f"`{name}`",
                         f"{a['batch']:,}", f"{a['step s']:.2f}", f"{b['step s']:.2f}",
                         f"{b['step s'] / a['step s']:.2f}",
                         f"{a['eval s']:.3f}", f"{b['eval s']:.3f}", f"{b['eval s'] / a['eval s']:.2f}",
                         f"{a['batch_norm_error']:.1e}", f"{b['batch_norm_error']:.1e}", a["n"]])
    if not rows:
        return [f"The CPU's layouts side by side: {NM}."]
    cmds = sorted({code(r["command"]) for r in results.get("cpu_layout", [])})
    evals = sorted({f"{r['eval_batch']:,}" for r in results.get("cpu_layout", [])})
    return table(["machine", "load (1 min)", "threads", "recipe", "batch", "step s, contiguous",
                  "step s, channels_last", "ratio", f"eval s ({'/'.join(evals)} images), contiguous",
                  "eval s, channels_last", "ratio",
                  "batch norm's error, contiguous", "batch norm's error, channels_last", "n (medians of)"], rows) + [
        "", f"Command: {', '.join(cmds)}. Times are medians; batch norm's error is the largest of its output's and "
        "gradients' errors in float32 against float64, relative to the largest float64 value (a (batch, 64, 32, 32) "
        "activation, forward and backward)."]


def t_op_counts(results, part):
    """The aten operations of a ResNet-50 step (part "optimisers") or of its forward and backward by BlurPool."""
    rs = results.get("op_counts", [])
    if not rs:
        return [f"Operation counts: {NM}."]
    n = lambda v: "–" if v is None else f"{v:,}"
    if part == "optimisers":
        rows = [[device(r), row["step"], n(row["loop"]), n(row["ours"])] for r in rs for row in r["optimisers"]]
        header = ["machine", "step", "per-tensor loop", "foreach (optim.py)"]
    else:
        rows = [[device(r), row["blurpool"], n(row["operations"])] for r in rs for row in r["blurpool"]]
        header = ["machine", "BlurPool", "operations (forward and backward)"]
    return table(header, rows) + ["", f"Command: {', '.join(sorted({code(r['command']) for r in rs}))} (a count of "
                                      "operations, not a timing)."]


def places_in_stretches(touched):
    """"6 in 3 (17)": a technique's places, the stretches they make (older records: "6 (17)") and its lines."""
    stretches = f" in {touched['stretches']}" if "stretches" in touched else ""
    return f"{len(touched['places'])}{stretches} ({touched['lines']})"


def t_reading_path(results):
    """What a reader follows to learn what a recipe computes, and where each technique of the first recipe is
    touched beside the references (benchmarks/reading_path.py)."""
    rs = results.get("reading_path", [])
    if not rs:
        return [f"The reading path: {NM}."]
    chars = lambda c, code: f"{c[code]:,}" if code in c else "–"
    rows = [[f"`{c['recipe']}`", f"{c['path_lines']} ({c['path_code_lines']})",
             f"{chars(c, 'path_chars')} ({chars(c, 'path_code_chars')})", c["path_files"],
             len(c["calls_to_step"]) - 1, c["skippable_lines"]] for r in rs for c in r["recipes"]]
    rows += [[f"{p['file']} (a reference; the whole file)", f"{p['lines']} ({p['code_lines']})",
              f"{chars(p, 'chars')} ({chars(p, 'code_chars')})", 1, "–", "–"] for r in rs for p in r.get("peers", [])]
    out = table(["recipe", "lines to read (of code)", "characters (of code)", "files", "calls from main to the step",
                 "lines a reader may skip (flags, checks, warm-up, records)"], rows)
    ratios = [f"`{c['recipe']}` {c['path_chars'] / p['chars']:.2f}× {p['file']}'s" for r in rs for c in r["recipes"]
              for p in r.get("peers", []) if "path_chars" in c and p.get("chars")]
    out += ["", f"Characters to read against each reference's whole file: {'; '.join(ratios)}."] if ratios else []
    for r in rs:
        first, peers = r["recipes"][0], [p for p in r.get("peers", []) if "techniques" in p]
        if "techniques" in first:
            out += ["", f"Where each technique of `{first['recipe']}` is touched on its path (a place: one top-level "
                        "definition; a stretch: places one after another in a file, no other definition between "
                        "them; in parentheses, the lines), beside the references' whole files:", ""]
            out += table(["technique", f"`{first['recipe']}`", *(p["file"] for p in peers),
                          f"where, in `{first['recipe']}`'s path"],
                         [[t, *(places_in_stretches(c["techniques"][t]) for c in [first, *peers]),
                           "; ".join(touched["places"]) or "–"]
                          for t, touched in first["techniques"].items()])
    return out + [
        "", f"Command: {', '.join(sorted({code(r['command']) for r in rs}))}: every function a short run calls, "
            "each whole and once, with the recipe's definition and its setting types (a count, not a timing); a line "
            "touches a technique where one of the technique's names (reading_path.TECHNIQUES) is in its code."]


def t_compile_cache(results):
    rows = []
    for r in results.get("compile_cache", []):
        for row in r["rows"]:
            cache = row["cache"] + (" (other images)" if row["cache"] == "warm" and r.get("warm_seed") else "")
            rows.append([device(r), f"`{r['recipe']}` (width {r['width']:g}, mode {r['mode']})", cache, row["n"],
                         f"{row['mean s']:.1f} s", f"{row['min s']:.1f}-{row['max s']:.1f} s"])
    if not rows:
        return [f"Compiled warm-up, cold and warm cache: {NM}."]
    cmds = sorted({code(r["command"]) for r in results.get("compile_cache", [])})
    return table(["machine", "recipe", "cache", "n", "compiled warm-up (mean)", "min-max"], rows) + [
        "", f"Command: {', '.join(cmds)} (each run a fresh process)."]


def t_build_counts(results):
    """What E1's build does (benchmarks/build_counts.py, counted on the CPU): each compiled function's graphs by the
    layout of their first input, its CUDA graph captures and the sleeps it asks for."""
    found = results.get("build_counts", [])
    if not found:
        return [f"E1's build, counted: {NM}."]
    r, by = found[-1], {}
    for c in r["compiles"]:
        x = c["first_input"]
        layout = "–" if x is None else (f"{'×'.join(map(str, x['shape']))} {x['dtype']}, strides "
                                        f"({', '.join(map(str, x['stride']))})"
                                        + (": channels-last" if len(x["stride"]) == 4 and x["stride"][1] == 1 else ""))
        by[c["function"], layout] = by.get((c["function"], layout), 0) + 1
    return table(["compiled function", "its graphs' first input", "graphs compiled"],
                 [[f"`{f}`", layout, n] for (f, layout), n in by.items()]) + [
        "", f"{len(r['compiles'])} graphs in all; {r['captures']} CUDA graphs captured ({r['replays']} replays); "
            f"{r['sleeps']} sleep of {r['sleeps_s']:.0f} s asked for (skipped). Counted on {device(r)} (n = 1, "
            f"{commit_of(r)}): {code(r['command'])}, E1's batch cut to {r['batch']} and its data to {r['images']} "
            "random images."]


def t_gpu_chunks(results):
    """Every chunk the suite ran on a GPU, oldest first: where a GPU's seconds went."""
    rows = []
    for piece, found in results.items():
        for r in found:
            if r.get("fingerprint", {}).get("device") != "cuda":
                continue
            for c in r.get("chunks", []):
                setup = "–" if c.get("setup_s") is None else f"{c['setup_s']:.0f} s"
                rows.append([c["date"], device(r), f"`{piece}`", c["runs_added"], f"{c['seconds']:.0f} s",
                             f"{c['estimated_s']:.0f} s", setup])
    if not rows:
        return [f"The suite's chunks on a GPU: {NM}."]
    return table(["finished", "device", "piece", "runs added (all sides)", "the chunk's time", "estimated",
                  "outside the runs' clocks (start, data, warm-ups, compiling)"], sorted(rows)) + [
        "", "Each row is one command of the suite, n = 1; its command line is the chunk's `argv` in "
            "results/<device>/<piece>.json."]


def t_torchrun(results):
    rows = []
    for piece, what in (("torchrun_fast94", "fast94"), ("torchrun_imagenet_tiny", "ImageNet `tiny`")):
        found = [r for r in results.get(piece, []) if r["sides"]["plain"]["runs"]]
        for r in found:
            a, b = r["sides"]["plain"], r["sides"]["torchrun"]
            ratio = r.get("time_ratio")
            rows.append([what, device(r), f"{n_of(a)} / {n_of(b)}", secs(a["stats"]["time"]),
                         secs(b["stats"]["time"]),
                         f"{1 / ratio['ratio']:.3f} [{1 / ratio['high']:.3f}, {1 / ratio['low']:.3f}]"
                         if ratio else "–"])
        if not found:
            rows.append([what, "GPU", "–", NM, NM, NM])
    return table(["run", "device", "n (plain / torchrun)", "plain `python` time", "`torchrun --nproc_per_node=1` time",
                  "torchrun / plain [95% CI]"], rows)


def t_floor(results):
    rows = []
    for recipe in [r for r, _ in side_by_side_pieces()] + ["myrtle24", "myrtle10"]:
        piece_sides = sides(results, recipe, recipe)
        for r, s in piece_sides:
            st, fp = s["stats"], r["fingerprint"]
            floor = st.get("floor_s")
            rows.append([recipe, device(r), pflop(st.get("flops_per_run")),
                         f"{fp['matmul_tflops']:.0f} TFLOP/s", f"{floor:.3f} s" if floor else "–",
                         secs(st["time"], False), f"{st['time']['mean'] / floor:.1f}×" if floor else "–"])
        if not piece_sides:
            rows.append([recipe, "GPU", pflop(counted(results, recipe), " (counted)"), NM, NM, NM, NM])
    return table(["recipe", "device", "FLOPs per run", "measured matmul rate", "floor (FLOPs ÷ rate)",
                  "measured mean time", "time ÷ floor"], rows)


def outcome(results, ref, change=None):
    """The outcome cell of a perf-notes row measured by piece:side (or '-'); a change that names neither its piece nor
    its side is one switch of that piece's recipe, so its cell says the result is the whole recipe's."""
    if ref in ("", "-", "–"):
        return "–"
    piece, _, side = ref.strip("`").partition(":")
    found = sides(results, piece, side or piece)
    if not found:
        return NM
    cell = "; ".join(f"{device(r)}: {secs(s['stats']['time'])}, {pct(s['stats']['accuracy'], s.get('target'))} "
                     f"(n={len(s['runs'])})" for r, s in found)
    alone = change is None or f"`{piece}`" in change or (side and f"`{side}`" in change)
    return cell if alone else f"not alone, only in the whole {ref}: {cell}"


def t_scaling(results):
    """The scaling model against the published many-GPU runs (model output, not a measurement)."""
    import scaling
    return scaling.published_table().split("\n")


def t_scaling_recipes(results):
    """The scaling model's time for each cluster recipe's schedule beside its published time (model output)."""
    import scaling
    return scaling.recipe_table().split("\n")


def t_cpu_accuracy(results):
    """The record recipes' accuracy at full size on the CPU (the suite's cpu_accuracy piece): n so far, mean ± std,
    the one-sided p of "mean > 94%", and the mean time of a run on the CPU (not a speed figure)."""
    from run_statistics import detectable_gap
    from suite import CPU_ACCURACY
    rows, verdicts = [], []
    for recipe in CPU_ACCURACY:                 # the tier's order
        found = sides(results, "cpu_accuracy", recipe)
        for r, s in found:
            st = s["stats"]
            rows.append([recipe, device(r), command_of(r, s["command"]), commit_of(r), n_of(s),
                         pct(st["accuracy"], 0.94), pval(st["p_mean_above_target"]), secs(st["time"], std=False)])
            n, mean, p = len(s["runs"]), st["accuracy"]["mean"], st["p_mean_above_target"]
            if mean is None:
                continue
            where = "below" if mean < 0.94 - 1e-9 else "above" if mean > 0.94 + 1e-9 else None   # to rounding
            # below: the other side of the same t-test, the p of a sample mean this low at a true 94%
            side_p = None if p is None else 1 - p if where == "below" else p
            said = f"`{recipe}`'s mean is " + (f"{where} 94% here" if where else "94% here, on neither side")
            if side_p is None or where is None:
                verdicts.append(said + (f" (n = {n}: too few runs to say more)." if side_p is None else f" (n = {n})."))
            else:
                verdicts.append(f"{said}, {'' if side_p < 0.05 else 'not '}significantly (p = {side_p:.2g} for a mean "
                                f"{where} 94%, n = {n}).")
            if side_p is not None and side_p >= 0.05:
                gap = detectable_gap(st["accuracy"]["std"], n)
                verdicts[-1] += (f" At this spread, n = {n} finds a true mean {100 * gap:.2f} points or more from "
                                 "94% (p < 0.05, four times in five), a smaller gap not reliably.")
            base = recipe.split()[0]
            if base != recipe and r["sides"].get(base, {}).get("runs"):       # a recipe with flags: against its own
                verdicts.append(against(recipe, s["runs"], base, r["sides"][base]["runs"]))
        if not found:
            rows.append([recipe, "CPU", "see docs/measuring.md", "–", "–", NM, NM, NM])
    return table(["recipe", "device", "command", "code", "n", "final test accuracy (mean ± std)", "p (mean > 94%)",
                  "time of a run on this CPU (mean)"], rows) + ([""] + [" ".join(verdicts)] if verdicts else [])


def against(name, runs, base, base_runs):
    """One sentence: a side's mean final accuracy against another's on the same device, with the p of a one-sided
    Welch t-test in the direction the means differ."""
    from run_statistics import one_sided_welch_p, summarize
    xs, ys = [r["final_acc"] for r in runs], [r["final_acc"] for r in base_runs]
    gap = summarize(xs)["mean"] - summarize(ys)["mean"]
    p = one_sided_welch_p(xs, ys) if gap >= 0 else one_sided_welch_p(ys, xs)
    said, n = f"`{name}`'s mean is {100 * abs(gap):.2f} points {'above' if gap >= 0 else 'below'} `{base}`'s", \
        f"n = {len(xs)} and {len(ys)}"
    if p is None:
        return f"{said} ({n}: too few runs to say more)."
    return f"{said}, {'' if p < 0.05 else 'not '}significantly (p = {p:.2g}, a one-sided Welch t-test, {n})."


def t_install(results):
    """One sentence: what the CPU build of PyTorch saves against the default (CUDA) build, to download and installed."""
    found = results.get("install_size", [])
    if not found:
        return [f"The CPU build's saving against the default CUDA build: {NM}."]
    r = found[-1]
    build = {row["build"]: row for row in r["rows"]}
    what = (f"{' and '.join(r['packages'])} with what they depend on, in a fresh environment on {device(r)}, n = 1: "
            f"{code(r['command'])}")
    gb = lambda b, key: build[b][key] / 1e9
    default = (f"the default CUDA build is {gb('default', 'downloaded bytes'):.1f} GB to download and "
               f"{gb('default', 'installed bytes'):.1f} GB installed")
    if "error" in build["cpu"]:
        return [f"Measured: {default} ({what}); the CPU build's sizes are {NM} (PyTorch's CPU index was out of that "
                "machine's reach)."]
    return [f"Measured: {default}, the CPU build {gb('cpu', 'downloaded bytes'):.1f} GB and "
            f"{gb('cpu', 'installed bytes'):.1f} GB ({what})."]


def t_tests(results):
    """One sentence: how long README's test command took, as a whole process (benchmarks/test_time.py)."""
    found = results.get("test_time", [])
    if not found:
        return [f"The time of `python -m pytest`: {NM}."]
    r = found[-1]
    counts = ", ".join(f"{n} {word}" for word, n in r["counts"].items())
    workers = f" on {r['workers']} pytest-xdist workers" if r.get("workers", 1) > 1 else ""
    return [f"Measured on {device(r)} as a whole process, the load average {r['load_average_at_start']:.2f} at its "
            f"start: {code(r['command'])}{workers} took {r['wall_s']:.0f} s wall and {r['cpu_s']:.0f} CPU s (n = 1; "
            f"{counts}; exit status {r['exit_status']}), timed by {code('python benchmarks/test_time.py')}"
            + (f"{' in a fresh virtual environment' if r.get('fresh_environment') else ''}, with "
               f"{r['versions']}." if r.get("versions") else ".")
            + "".join(f" Failed: {code(t)}." for t in r.get("failed", []))]


def t_coverage(results):
    """The coverage map (benchmarks/coverage_map.py): per product module, the share of its lines and branches the
    default tests run, and devices.py's lines that no CPU test reaches, each with the reason its line gives."""
    found = results.get("coverage", [])
    if not found:
        return [f"Coverage: {NM}."]
    r = found[-1]
    rows, gone = [], [name for name in r["files"] if not (ROOT / name).is_file()]
    for name, f in r["files"].items():
        ran = 1 - len(f["missing lines"]) / max(1, f["statements"])
        taken = 1 - len(f["missing branches"]) / max(1, f["branches"])
        if name not in gone:
            rows.append([code(name), f["statements"], f"{ran:.1%}", f["branches"], f"{taken:.1%}"])
    lines = [f"Measured on {device(r)} (n = 1, tests exit status {r['tests_exit_status']}, {commit_of(r)}): "
             f"{code(r['command'])}" + (f"; {len(gone)} modules it measured are gone since, left out" if gone else "")
             + ".", ""]
    lines += table(["module", "statements", "run", "branches", "taken"], rows)
    unrun = r["devices_unrun"]
    lines += ["", f"`devices.py`'s lines that no CPU test runs: {len(unrun)}" + (":" if unrun else ".")]
    lines += [f"- line {u['line']}, {code(u['code'].split('#')[0].strip())}: {u['code'].split('#', 1)[1].strip()}"
              if "#" in u["code"] else f"- line {u['line']}, {code(u['code'])}: no reason given" for u in unrun]
    return lines


# ----------------------------------------------------------------------------------------------
# README's figure: ours beside the fastest peer measured on the device, then beside airbench

FIGURE = "docs/figures/time_to_94.png"


def interval_row(name, time, *, ours, group, r, n, accuracy, ratios=(None, None)):
    """A figure row: a side's mean time per run and the 95% t-interval of the mean; ratios: its time ratio to the
    peer under our clock and under the Fulcrum harness's (None where not measured)."""
    from scipy.stats import t
    mean, std, k = time["mean"], time["std"], time["n"]
    half = float(t.ppf(0.975, k - 1)) * std / math.sqrt(k) if k > 1 else 0.0
    return {"group": group, "side": name, "ours": ours, "device": r.get("device_name") or device(r),
            "mean": round(mean, 6), "low": round(mean - half, 6), "high": round(mean + half, 6), "n": n,
            "accuracy": accuracy, "ratio": ratios[0], "fulcrum_ratio": ratios[1],
            "command": command_of(r, r.get("command") or r.get("_command", "")), "commit": commit_of(r)}


def fastest_peer_rows(results):
    """For each device, the comparison whose peer was fastest there (our clock): each of our recipes in it, then that
    peer (6-view accuracy)."""
    best = {}
    for r in comparisons(results):
        sides = r["headline"]["ours_s"]["sides"]
        for pair, ci in r["headline"]["ours_s"]["ratios"].items():
            ours, peer = pair.split("/")
            if ci and peer in PEER_NAMES and (r["device_name"] not in best or
                                              sides[peer]["time"]["mean"] < best[r["device_name"]][2]):
                best[r["device_name"]] = (r, peer, sides[peer]["time"]["mean"])
    rows = []
    for r, peer, _ in best.values():
        h = r["headline"]
        for pair, ci in h["ours_s"]["ratios"].items():
            ours = pair.split("/")[0]
            if pair.endswith(f"/{peer}") and ci:
                accuracy = lambda s: pct(h["ours_s"]["sides"][s]["accuracy_6view"], 0.94)
                rows.append(interval_row(ours, h["ours_s"]["sides"][ours]["time"], ours=True, group=peer, r=r,
                                         n=str(h["ours_s"]["sides"][ours]["n"]), accuracy=accuracy(ours),
                                         ratios=(interval(ci), interval(h["fulcrum_s"]["ratios"][pair])
                                                 if h["fulcrum_s"]["ratios"].get(pair) else None)))
                rows.append(interval_row(peer, h["ours_s"]["sides"][peer]["time"], ours=False, group=peer, r=r,
                                         n=str(h["ours_s"]["sides"][peer]["n"]), accuracy=accuracy(peer)))
    return rows


def airbench_rows(results):
    """For each side-by-side piece measured beside airbench, our side then the peer's (the recipe's own accuracy)."""
    rows = []
    for recipe, peer in side_by_side_pieces():
        for r in results.get(recipe, []):
            if not (r["sides"][recipe]["runs"] and r["sides"].get(peer, {}).get("runs")):
                continue
            for name in (recipe, peer):
                side, st = r["sides"][name], r["sides"][name]["stats"]
                rows.append(interval_row(name, st["time"], ours=name == recipe, group=peer,
                                         r={**r, "_command": r["sides"][recipe]["command"]},
                                         n=n_of(side).replace(" (partial, of", " of").rstrip(")"),
                                         accuracy=pct(st["accuracy"], side.get("target")),
                                         ratios=(interval(r["time_ratio"]) if name == recipe and r.get("time_ratio")
                                                 else None, None)))
    return rows


def figure_rows(results):
    """What the figure draws, pairs of rows (ours, then the peer beside it): ours beside the fastest peer measured on
    each device, then beside airbench; each mean time per run on our clock (training and the final evaluation) with
    the 95% t-interval of the mean."""
    return fastest_peer_rows(results) + airbench_rows(results)


def figure_digest(rows):
    """What the figure shows, as a digest: its rows and the code that draws them."""
    text = json.dumps(rows, sort_keys=True) + inspect.getsource(draw_figure)
    return hashlib.sha256(text.encode()).hexdigest()


def draw_figure(rows, path):
    """The figure as a PNG at path: a row per side, its mean time per run and 95% interval, ours above the peer
    beside it, the fastest peer's pair first; a fixed size and resolution and no date or software in its metadata,
    so the same rows give the same file, which carries their digest (figure_digest)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    devices = sorted({row["device"] for row in rows})
    fig, ax = plt.subplots(figsize=(8, 1.4 + 0.45 * len(rows)), dpi=110)
    for y, row in enumerate(rows):
        color = "tab:blue" if row["ours"] else "tab:gray"
        ax.errorbar(row["mean"], y, xerr=[[row["mean"] - row["low"]], [row["high"] - row["mean"]]], fmt="o",
                    color=color, capsize=4, markersize=5)
        ratio = f"\n{row['ratio']} x the peer's time" if row["ratio"] else ""
        ax.annotate(f"{row['mean']:.3f} s [{row['low']:.3f}, {row['high']:.3f}]{ratio}", (row["high"], y),
                    xytext=(8, 0), textcoords="offset points", va="center", fontsize=8, color=color)
    peers = {"hiverge": "the 2-second record", "e1": "E1"}
    labels = [f"{row['side']} ({'ours' if row['ours'] else peers.get(row['side'], 'peer')})\nn = {row['n']}"
              + (f", {row['device']}" if len(devices) > 1 else "") for row in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    for y in range(1, len(rows) - 1, 2):       # a line between one pair and the next, darker where the peers change
        ax.axhline(y + 0.5, color="0.4" if rows[y]["group"] != rows[y + 1]["group"] else "0.85", linewidth=0.8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, 1.5 * max(row["high"] for row in rows))
    ax.set_xlabel("seconds per run on our clock: training and final evaluation, mean and its 95% interval", fontsize=8)
    ax.set_title(f"CIFAR-10 to a mean of 94% on one {', '.join(devices)}: ours beside the fastest peer measured\n"
                 "there, then beside airbench (runs in turn, the same data)", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None, "Description": figure_digest(rows)})
    plt.close(fig)


def figure_is_current(rows, path):
    """Whether the PNG at path was drawn from these rows by this code (the digest it carries)."""
    from PIL import Image
    if not Path(path).is_file():
        return False
    with Image.open(path) as image:
        return image.info.get("Description") == figure_digest(rows)


def pair_sentence(ours, peer):
    return (f"{ours['side']} {ours['mean']:.3f} s [{ours['low']:.3f}, {ours['high']:.3f}] (n = {ours['n']}, accuracy "
            f"{ours['accuracy']}) against {peer['side']} {peer['mean']:.3f} s [{peer['low']:.3f}, {peer['high']:.3f}] "
            f"(n = {peer['n']}, accuracy {peer['accuracy']}), time ratio {ours['ratio'] or '–'}"
            + (f" ({ours['fulcrum_ratio']} on the Fulcrum harness's clock)" if ours.get("fulcrum_ratio") else "")
            + f"; measured by {ours['command']}, {ours['commit']}")


def t_figure(results):
    """README's figure and its caption: what it shows, on which device, n, the commands and their commits."""
    rows = figure_rows(results)
    if not rows:
        return [f"Time per run beside the peers: {NM}."]
    pairs = list(zip(rows[::2], rows[1::2]))
    fastest = [(o, p) for o, p in pairs if p["side"] in PEER_NAMES]
    others = [(o, p) for o, p in pairs if p["side"] not in PEER_NAMES]
    devices = ", ".join(sorted({row["device"] for row in rows}))
    said = ([f"Beside the fastest peer measured there, {PEER_NAMES[fastest[0][1]['side']]}, each side in a process of "
             f"its own (6-view accuracy, the Fulcrum harness's evaluation): "
             + "; ".join(pair_sentence(o, p) for o, p in fastest) + "."] if fastest else
            [f"Beside E1 and the 2-second record: {NM}."])
    said += (["Below, beside airbench (its time includes its model construction, which ours leaves out): "
              + "; ".join(pair_sentence(o, p) for o, p in others) + "."] if others else [])
    return [f"![Time per run of our CIFAR-10 recipes beside the fastest peer and airbench]({FIGURE})", "",
            f"*Time per run on CIFAR-10 on one {devices}, runs in turn with the peer's on the same data (our clock, "
            f"from the network built to the end of the final evaluation; mean and its 95% interval). "
            + " ".join(said) + " Drawn by `python benchmarks/report.py` from results/.*"]


# ----------------------------------------------------------------------------------------------
# Each CIFAR-10 recipe's evidence: our figure on a GPU beside its peer's published one, above its definition

RECIPES_FILE = "cifar10_recipes.py"


def ours_on_a_gpu(results):
    """{recipe: our figure on a GPU in words}: mean accuracy and time (our clock), the device, n and the commit of
    the measurement with the most runs (the suite's pieces and the comparisons)."""
    import cifar10_recipes as cr
    best = {}
    for found in results.values():
        for r in found:
            gpu = (r.get("device_name") or r.get("fingerprint", {}).get("device_name") or "CPU").removeprefix("NVIDIA ")
            if gpu.startswith("CPU"):
                continue
            suite_sides = r["sides"] if isinstance(r.get("sides"), dict) else {}     # a comparison's: a list
            measured = [(name, side["stats"]["n"], side["stats"]["accuracy"], side["stats"]["time"])
                        for name, side in suite_sides.items() if side.get("runs") and side.get("stats")]
            measured += [(name, side["n"], side["accuracy_own"], side["time"])
                         for name, side in r.get("headline", {}).get("ours_s", {}).get("sides", {}).items()]
            for name, n, acc, time in measured:
                if name in cr.RECIPES and n and (name not in best or n > best[name][0]):
                    best[name] = (n, f"{pct(acc, 0.94).split(' ±')[0]}, {time['mean']:.2f} s ({gpu}, n = {n}, "
                                     f"{commit_of(r).replace(' with uncommitted changes', ' + local changes')})")
    return {name: text for name, (_, text) in best.items()}


def t_recipes(results):
    """README's table of the CIFAR-10 recipes (the journey's stages in --list-recipes): what each trains, our figure
    on a GPU and the one its peer published."""
    import cifar10_recipes as cr
    ours, stages = ours_on_a_gpu(results), {s["name"] for s in cr.JOURNEY}
    rows = [[f"`{name}`", r.doc, ours.get(name, "not measured on a GPU"),
             cr.PEERS_PUBLISHED.get(name, "none (an idea of ours)")]
            for name, r in cr.RECIPES.items() if name not in stages]
    return table(["recipe", "what", "ours on a GPU (mean accuracy, time, device, n, code)",
                  "published by its peer (not measured here)"], rows)


def with_measured(source, results):
    """cifar10_recipes.py's source with the line above each recipe's definition its evidence: our figure on a GPU (or
    "not measured on a GPU") and the one its peer published (cifar10_recipes.PEERS_PUBLISHED)."""
    import cifar10_recipes as cr
    ours, lines = ours_on_a_gpu(results), source.split("\n")
    for name, i in sorted(cr.definitions(lines).items(), key=lambda item: -item[1]):
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        line = (f"{indent}# measured: {ours.get(name, 'not measured on a GPU')}; published: "
                f"{cr.PEERS_PUBLISHED.get(name, 'none (an idea of ours)')}")
        if i and cr.MEASURED.match(lines[i - 1]):
            lines[i - 1] = line
        else:
            lines.insert(i, line)
    return "\n".join(lines)


TABLES = {"figure": t_figure, "recipes": t_recipes, "tests": t_tests, "coverage": t_coverage, "env": t_env,
          "install": t_install, "cpu_accuracy": t_cpu_accuracy, "flops": t_flops, "scaling": t_scaling,
          "scaling_recipes": t_scaling_recipes,
          "results": lambda r: t_plain(r, (("myrtle24", "myrtle24"), ("myrtle10", "myrtle10"))),
          "cpu_demo": lambda r: t_plain(r, (("cpu_demo", "myrtle24"),), cpu=True) if r.get("cpu_demo")
          else [f"CPU demonstration: {NM}."],
          "fast": t_fast, "side_by_side": t_side_by_side, "compare": t_compare, "imagenet_gpu": t_imagenet_gpu,
          "journey": t_journey, "throughput": t_throughput, "prepare": t_prepare, "decoders": t_decoders,
          "cpu_loaders": t_cpu_loaders, "cpu_layout": t_cpu_layout, "compile_cache": t_compile_cache,
          "gpu_chunks": t_gpu_chunks, "build_counts": t_build_counts,
          "torchrun": t_torchrun, "floor": t_floor, "op_counts": lambda r: t_op_counts(r, "optimisers"),
          "blurpool_ops": lambda r: t_op_counts(r, "blurpool"), "reading_path": t_reading_path}


def fill_outcomes(block, results):
    """The perf-notes changes table: every column as written except the last, outcome, which is computed
    from the piece:side named in the 'measured by' column."""
    lines = block.split("\n")
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    change, by, out = header.index("change"), header.index("measured by"), header.index("outcome")
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        cells[out] = outcome(results, cells[by], cells[change])
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines[:2] + rows)


MARK = re.compile(r"(<!-- report:(\w+) -->\n)(.*?)(<!-- /report:\2 -->)", re.S)


def render(text, results):
    """text with every marked table regenerated."""
    def one(m):
        name, body = m.group(2), m.group(3)
        new = fill_outcomes(body.strip(), results) if name == "outcomes" else "\n".join(TABLES[name](results))
        return m.group(1) + new + "\n" + m.group(4)
    return MARK.sub(one, text)


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a document is out of date")
    p.add_argument("--results", default=str(ROOT / "results"), help="results folder (default results/)")
    p.add_argument("--root", default=str(ROOT), help="the folder holding README.md and docs/")
    args = p.parse_args(argv)
    missing = [doc for doc in DOCS if not (Path(args.root) / doc).is_file()]
    if missing:
        print(f"error: --root {args.root}: no {missing[0]} there (the folder holding README.md and docs/)",
              file=sys.stderr)
        return 2
    if not Path(args.results).is_dir():
        print(f"error: --results {args.results}: no such folder", file=sys.stderr)
        return 2
    try:
        results = load_results(args.results)
    except ResultsError as e:
        print(f"error: {e}; nothing rewritten", file=sys.stderr)
        return 1
    stale = []
    for doc in DOCS + (RECIPES_FILE,):
        path = Path(args.root) / doc
        old = path.read_text()
        unknown = sorted({m.group(2) for m in MARK.finditer(old)} - set(TABLES) - {"outcomes"})
        if unknown:
            print(f"error: {doc}: unknown report tables {unknown}", file=sys.stderr)
            return 2
        new = with_measured(old, results) if doc == RECIPES_FILE else render(old, results)
        if new != old:
            stale.append(doc)
            if args.check:
                diff = difflib.unified_diff(old.splitlines(), new.splitlines(), doc, "from results/", lineterm="", n=0)
                print("\n".join(list(diff)[:20]))
            else:
                path.write_text(new)
    rows, figure = figure_rows(results), Path(args.root) / FIGURE
    if rows and not figure_is_current(rows, figure):
        stale.append(FIGURE)
        if not args.check:
            draw_figure(rows, figure)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python benchmarks/report.py", file=sys.stderr)
        return 1
    print(f"rewrote {', '.join(stale)}" if stale and not args.check else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
