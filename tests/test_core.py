import subprocess
import sys

import pytest

from conftest import ROOT


def test_the_framework_free_files_import_no_torch():
    code = ("import sys, core, outputs, processes, progress, run_statistics, scaling, schedules, "
            "versions, imagenet_store; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "False"


def test_a_recipe_once_built_cannot_change_and_every_setting_has_a_flag_of_its_own():
    import dataclasses
    import cifar10_fast as cf
    import imagenet_fast as inf
    import settings
    r = cf.recipe("fast94")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.epochs = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.whitening.eps = 1.0
    for script in (cf, inf):
        names = [leaf.name for leaf in settings.leaves(script.Recipe)]
        assert len(names) == len(set(names))                  # one flag, one setting
        for name in script.RECIPES:
            settings.check(script.recipe(name))


def test_a_recipe_is_checked_whole_when_made_and_its_changes_are_made_together():
    import dataclasses
    import cifar10_fast as cf
    import training
    from core import UsageError
    with pytest.raises(UsageError, match=r"^--whiten-eps -1: must not be negative$"):
        dataclasses.replace(cf.FAST94, whitening=dataclasses.replace(cf.FAST94.whitening, eps=-1.0))
    with pytest.raises(UsageError, match=r"^--ema-momentum and --lookahead-momentum: one weight average at a time"):
        dataclasses.replace(cf.MYRTLE10, lookahead=training.LookaheadSettings())
    # each change alone would make a recipe refused: two rates for three knots, two weight averages
    assert cf.recipe("myrtle24", lr_knots=(0, 1), lr_values=(0.4, 0.0)).lr.values == (0.4, 0.0)
    r = cf.recipe("fast94", ema_momentum=0.99, lookahead_momentum=0)
    assert r.ema.momentum == 0.99 and r.lookahead is None


def test_no_function_is_longer_than_80_lines_and_none_but_a_constructor_takes_more_than_8_parameters():
    """The recipe reads top to bottom when every function can be read at once."""
    import ast
    big = []
    for path in sorted(ROOT.glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                length = node.end_lineno - min([d.lineno for d in node.decorator_list] + [node.lineno]) + 1
                if length > 80 or (len(params) > 8 and node.name != "__init__"):
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines, "
                               f"{len(params)} parameters)")
    assert big == []


def test_no_public_function_takes_more_than_four_positional_parameters():
    """Beyond the first few, arguments are keyword-only, so that one in the wrong place cannot pass silently."""
    import ast
    crowded = []
    for path in sorted(ROOT.glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                positional = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(positional) > 4:
                    crowded.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert crowded == []
