"""One name for one thing: the top-level names that two product modules both define, each a parallel role of the two
scripts' own modules (the same job, once for CIFAR-10 and once for ImageNet); settings classes named as such."""
import ast
import dataclasses
import importlib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in ROOT.glob("*.py"))

# name -> (the modules that define it, the role each plays for its own dataset)
PARALLEL = {
    "main": ({"cifar10_fast", "imagenet_fast"}, "the script's command line"),
    "parse_args": ({"cifar10_fast", "imagenet_fast"}, "the script's flags"),
    "train_run": ({"cifar10_fast", "imagenet_fast"}, "one run, the loop written out"),
    "warmup": ({"cifar10_fast", "imagenet_fast"}, "the untimed warm-up before the timed runs"),
    "Options": ({"cifar10_fast", "imagenet_fast"}, "how the script runs a recipe (each extends training.RunOptions)"),
    "COLUMNS": ({"cifar10_fast", "imagenet_fast"}, "the columns of the script's per-epoch table"),
    "PROGRESS_AFTER_S": ({"cifar10_fast", "imagenet_fast"}, "when an epoch shows its progress"),
    "BEFORE_TRAINING": ({"cifar10_fast", "imagenet_fast"}, "what Ctrl-C stopped before the first run"),
    "Recipe": ({"cifar10_recipes", "imagenet_recipes"}, "what a run computes"),
    "RECIPES": ({"cifar10_recipes", "imagenet_recipes"}, "the named recipes"),
    "recipe": ({"cifar10_recipes", "imagenet_recipes"}, "a recipe by name"),
    "MAX_EPOCHS": ({"cifar10_recipes", "imagenet_recipes"}, "the longest run a recipe may ask for"),
    "MEAN": ({"cifar_data", "imagenet_data"}, "the dataset's per-channel mean"),
    "STD": ({"cifar_data", "imagenet_data"}, "the dataset's per-channel standard deviation"),
    "check_classes": ({"cifar_data", "imagenet_store"}, "the refusal of data with fewer than 2 classes"),
}


def top_level_names(path):
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_a_name_two_product_modules_define_is_a_parallel_role_of_the_two_scripts():
    where = defaultdict(set)
    for module in MODULES:
        for name in top_level_names(ROOT / f"{module}.py"):
            where[name].add(module)
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert {name: modules for name, modules in shared.items() if PARALLEL.get(name, (None,))[0] != modules} == {}
    assert set(PARALLEL) <= set(shared), "a parallel role listed here that is no longer defined twice"


def test_every_settings_class_is_named_settings():
    """A settings class: a frozen dataclass whose fields are knobs (settings.knob), as every technique's is."""
    unnamed = []
    for module in MODULES:
        m = importlib.import_module(module)
        for name, obj in vars(m).items():
            if (isinstance(obj, type) and obj.__module__ == module and dataclasses.is_dataclass(obj)
                    and hasattr(obj, "PREFIX") and not name.endswith("Settings") and name != "Recipe"):
                unnamed.append(f"{module}.{name}")
    assert unnamed == []


def test_devices_holds_device_decisions_and_no_jpeg_decoding():
    names = {n.lower() for n in top_level_names(ROOT / "devices.py")}
    assert [n for n in names if "jpeg" in n or "nvimgcodec" in n or "decode" in n] == []
