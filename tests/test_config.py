import os

import pytest

import npu_fx_fusion as nff
from npu_fx_fusion.config import PASS_NAMES, check_environment


def test_default_runs_every_pass_in_pipeline_order():
    assert nff.FusionConfig().enabled_passes() == PASS_NAMES
    assert PASS_NAMES.index("rms_norm") < PASS_NAMES.index("add_rms_norm")


def test_enable_and_disable():
    assert nff.FusionConfig(enable={"add_rms_norm", "rms_norm"}).enabled_passes() == ("rms_norm", "add_rms_norm")
    assert "rope" not in nff.FusionConfig(disable={"rope"}).enabled_passes()
    assert nff.FusionConfig(enable={"rope"}, disable={"rope"}).enabled_passes() == ()


@pytest.mark.parametrize("kwargs", [{"disable": {"rmsnorm"}}, {"enable": ["rope", "ropee"]}, {"disable": "rms"}])
def test_unknown_pass_name_lists_the_valid_ones(kwargs):
    with pytest.raises(ValueError) as err:
        nff.FusionConfig(**kwargs)
    assert "unknown pass name" in str(err.value)
    assert all(name in str(err.value) for name in PASS_NAMES)


def test_unknown_soc():
    with pytest.raises(ValueError, match="known: Ascend910B"):
        nff.FusionConfig(soc="Ascend999")


def test_environment_switches_everything_off(monkeypatch):
    monkeypatch.setenv("NPU_FX_FUSION", "0")
    assert nff.FusionConfig().enabled_passes() == ()


def test_environment_disables_passes(monkeypatch):
    monkeypatch.setenv("NPU_FX_FUSION_DISABLE", "rope, swiglu")
    enabled = nff.FusionConfig(enable={"rms_norm", "rope"}).enabled_passes()
    assert enabled == ("rms_norm",)
    monkeypatch.setenv("NPU_FX_FUSION_DISABLE", "rope,nope")
    with pytest.raises(ValueError, match="NPU_FX_FUSION_DISABLE"):
        nff.FusionConfig().enabled_passes()


# ---- bad settings, caught when they are made (issue 20) -------------------------------------
def _one_line(exc_info):
    message = str(exc_info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("value, off", [("0", True), (" OFF ", True), ("no", True), ("false", True),
                                        ("1", False), ("on", False), ("Yes", False), ("", False)])
def test_switch_values(monkeypatch, value, off):
    monkeypatch.setenv("NPU_FX_FUSION", value)
    assert (nff.FusionConfig().enabled_passes() == ()) is off


@pytest.mark.parametrize("create", [nff.get_npu_backend, lambda: nff.install({}), check_environment,
                                    lambda: nff.FusionConfig().enabled_passes()])
def test_a_switch_that_is_neither_on_nor_off_is_an_error_not_on(monkeypatch, create):
    monkeypatch.setenv("NPU_FX_FUSION", "banana")
    with pytest.raises(ValueError) as err:
        create()
    message = _one_line(err)
    assert "$NPU_FX_FUSION='banana'" in message
    assert "1, true, on, yes" in message and "0, false, off, no" in message


@pytest.mark.parametrize("create", [nff.get_npu_backend, lambda: nff.install({}), check_environment])
def test_a_misspelt_pass_in_the_environment_fails_when_the_backend_is_made(monkeypatch, create):
    monkeypatch.setenv("NPU_FX_FUSION_DISABLE", "rope,rms_nrom")
    with pytest.raises(ValueError) as err:
        create()
    message = _one_line(err)
    assert "$NPU_FX_FUSION_DISABLE='rope,rms_nrom'" in message and "'rms_nrom'" in message
    assert ", ".join(PASS_NAMES) in message


@pytest.mark.parametrize("kwargs, field", [
    ({"enable": [1, 2]}, "enable"), ({"disable": 5}, "disable"), ({"soc": 910}, "soc"),
    ({"mode": ["max-autotune"]}, "mode"), ({"dump_dir": 3}, "dump_dir"), ({"verify": "yes"}, "verify"),
    ({"strict": 1}, "strict"), ({"npu_dispatch": "off"}, "npu_dispatch"),
    ({"keep_intermediate_rounding": None}, "keep_intermediate_rounding"), ({"ep_group": 3}, "ep_group"),
])
def test_fields_of_the_wrong_type(kwargs, field):
    with pytest.raises(TypeError) as err:
        nff.FusionConfig(**kwargs)
    message = _one_line(err)
    assert message.startswith(f"FusionConfig({field}=...)") and repr(kwargs[field]) in message


def test_an_ep_group_is_a_process_group_of_this_process():
    # (a ProcessGroup is stored as its name: tests/test_expert_parallel.py passes the EP mesh's)
    with pytest.raises(ValueError) as err:
        nff.FusionConfig(ep_group="no-such-group")
    assert _one_line(err).startswith("FusionConfig(ep_group='no-such-group'): no process group of this process")


def test_unknown_mode():
    with pytest.raises(ValueError) as err:
        nff.FusionConfig(mode="max-autotuned")
    assert "max-autotune" in _one_line(err)


def test_a_dump_dir_that_cannot_be_written(tmp_path, monkeypatch):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    for bad in (a_file, a_file / "dumps"):  # a file, or a folder that would have to be inside one
        with pytest.raises(ValueError) as err:
            nff.FusionConfig(dump_dir=bad)
        assert f"{a_file} is not a directory" in _one_line(err)
    # permissions: simulated, since root (CI) may write anywhere
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(locked) else real_access(path, mode))
    with pytest.raises(ValueError) as err:
        nff.FusionConfig(dump_dir=locked / "run1")
    assert f"{locked}, where it would be created, is not writable" in _one_line(err)
    # a new folder under a writable one is fine, and nothing is created until a graph is dumped
    assert nff.FusionConfig(dump_dir=tmp_path / "new" / "run").dump_dir == str(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()


class _CompilerConfig:  # torchair / npugraph_ex CompilerConfig: its mode is an OptionValue
    class _Option:
        def __init__(self, value):
            self.value = value

    def __init__(self, mode):
        self.mode = self._Option(mode)
        self.post_grad_custom_pre_pass = None


def test_a_compiler_config_mode_we_do_not_know():
    with pytest.raises(ValueError) as err:
        nff.install(_CompilerConfig("max-overdrive"))
    message = _one_line(err)
    assert "'max-overdrive'" in message and "max-autotune, reduce-overhead, npugraph_ex" in message
    with pytest.raises(ValueError, match="'turbo'"):
        nff.install({"mode": "turbo"})


def test_a_fusion_mode_that_contradicts_the_compiler_config():
    with pytest.raises(ValueError) as err:
        nff.install(_CompilerConfig("reduce-overhead"), nff.FusionConfig(mode="max-autotune"))
    assert "lowers in 'reduce-overhead'" in _one_line(err)
    # agreeing, or left to the compiler config: fine
    assert nff.install(_CompilerConfig("reduce-overhead"), nff.FusionConfig(mode="reduce-overhead"))
    assert nff.install(_CompilerConfig("max-autotune"), nff.FusionConfig(soc="Ascend910B"))


def test_a_fusion_config_that_is_not_one():
    with pytest.raises(TypeError, match="fusion_config must be a FusionConfig, got dict"):
        nff.get_npu_backend(fusion_config={"disable": {"rope"}})
