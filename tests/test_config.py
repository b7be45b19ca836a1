import pytest

import npu_fx_fusion as nff
from npu_fx_fusion.config import PASS_NAMES


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
