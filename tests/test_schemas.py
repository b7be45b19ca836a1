"""Every stand-in op has exactly the schema of the real torch_npu op.

The schemas live once, in each op's spec (npu_ops/spec.py); here each is compared with
the `func:` line of the real torch-npu 2.13.0 wheel's
torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml (scripts/fetch_torch_npu.sh
unpacks it), both parsed by torch._C.parse_schema.

The cann_ops_transformer schemas are not torch_npu's: they are copied from that package's
OpBuilder.schema() (npu_ops/spec.py says where from). The wheel cannot vouch for them, so
they are checked against the installed package, and that test skips, saying so, where it is
not installed.
"""
import importlib.util
import os
import re

import pytest
import torch

from npu_fx_fusion.npu_ops import all_specs
from torchair_harness.runner import torch_npu_dir_or_skip

YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
OURS = sorted((spec.namespace, spec.name, spec.schema) for spec in all_specs().values())
SCHEMAS = {}
for _namespace, _name, _schema in OURS:
    SCHEMAS.setdefault(_namespace, {})[_name] = _schema


@pytest.fixture(scope="module")
def wheel_schemas():
    path = os.path.join(torch_npu_dir_or_skip(), YAML)
    with open(path, encoding="utf-8") as f:
        lines = re.findall(r"^\s*-?\s*func:\s*(.+?)\s*$", f.read(), flags=re.M)
    schemas = {}
    for line in lines:
        schemas.setdefault(line.split("(", 1)[0], line)  # the custom section comes first
    return schemas


@pytest.mark.parametrize("namespace, name, schema", [o for o in OURS if o[0] == "npu"],
                         ids=[o[1] for o in OURS if o[0] == "npu"])
def test_npu_schema_equals_torch_npu(wheel_schemas, namespace, name, schema):
    assert name in wheel_schemas, f"{name} is not an op of torch_npu 2.13.0"
    assert torch._C.parse_schema(schema) == torch._C.parse_schema(wheel_schemas[name])
    assert schema == wheel_schemas[name]  # character for character, too


def test_registered_stand_ins_carry_those_schemas():
    from npu_fx_fusion.npu_ops import ensure_registered

    for qualname in ensure_registered():
        namespace, name = qualname.split("::")
        registered = getattr(getattr(torch.ops, namespace), name).default._schema
        expected = torch._C.parse_schema(f"{namespace}::{SCHEMAS[namespace][name]}")
        assert registered == expected


# ---- ops of other packages (cann_ops_transformer) ---------------------------------------
OTHER = [o for o in OURS if o[0] != "npu"]


@pytest.mark.parametrize("namespace, name, schema", OTHER, ids=[f"{o[0]}.{o[1]}" for o in OTHER])
def test_other_packages_schemas_are_not_torch_npus(wheel_schemas, namespace, name, schema):
    # they are not compared with the wheel above: make sure the wheel indeed lacks them
    # (an op torch_npu adopted would have to move to the npu namespace and be compared)
    assert name not in wheel_schemas
    assert schema.split("(", 1)[0] == name
    torch._C.parse_schema(f"{namespace}::{schema}")


def test_cann_ops_transformer_schemas_equal_the_installed_package():
    if importlib.util.find_spec("cann_ops_transformer") is None:
        pytest.skip("cann_ops_transformer is not installed: its schemas in the op specs are copied from "
                    "its OpBuilder.schema() (hicann/ops-transformer, torch_extension/cann_ops_transformer/ops/"
                    "sparse_flash_mla_softmax_l1_norm.py) and cannot be compared here")
    try:
        importlib.import_module("cann_ops_transformer")  # registers torch.ops.cann_ops_transformer.*
    except Exception as exc:  # it needs torch_npu and CANN
        pytest.skip(f"cann_ops_transformer is installed but does not import here ({exc}): not compared")
    for name, schema in SCHEMAS["cann_ops_transformer"].items():
        registered = getattr(torch.ops.cann_ops_transformer, name).default._schema
        assert registered == torch._C.parse_schema(f"cann_ops_transformer::{schema}"), name
