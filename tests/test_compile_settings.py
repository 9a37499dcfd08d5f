"""Tests leave torch.compile's settings as they found them: conftest's compile_settings_kept checks every test."""
import copy

import torch

from conftest import changed_settings, compile_settings


def test_a_config_patch_changes_its_settings_inside_and_leaves_every_setting_as_it_was_after():
    before = compile_settings()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        assert changed_settings(before, compile_settings()) == ["torch._dynamo.config.fail_on_recompile_limit_hit",
                                                                "torch._dynamo.config.recompile_limit"]
    assert changed_settings(before, compile_settings()) == []


def test_a_setting_deleted_as_pytests_monkeypatch_undoes_one_is_named():
    before = compile_settings()
    after = copy.deepcopy(before)
    del after["torch._dynamo.config"]["recompile_limit"]
    after["torch._inductor.config"]["max_autotune"] = not before["torch._inductor.config"]["max_autotune"]
    assert changed_settings(before, after) == ["torch._dynamo.config.recompile_limit",
                                               "torch._inductor.config.max_autotune"]
