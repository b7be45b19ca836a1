"""The NPU dispatch inventory against the wheel, and the emulation against the inventory.

Wheel tests (they need the unpacked torch-npu 2.13.0 wheel, like test_schemas.py): the
inventory lists exactly the aten ops torch_npu registers at PrivateUse1 / AutogradPrivateUse1
that are CompositeImplicitAutograd in torch 2.13, and every row's claim about the wheel
(yaml section, kernel symbols, autograd formula class) is true. The symbols are read from
libtorch_npu.so as torchgen names them, `wrapper_<key>_<overload>_<name>`, and recomputed
from torch's own schemas with torchgen, so a wrong row or a missing op fails.

Emulation tests (no wheel): the emulation registers exactly the rows marked emulated; each
row's effect (the NPU graph differs from the CPU trace, or not) is what tracing with the
emulation on and off shows; SDPA takes torch_npu's decision tree per SoC; nothing of it
stays registered after a compile; transformers' NPU branch, rewritten into the dynamo
graph, gives the graph the patched flag gives.
"""
from __future__ import annotations

import collections
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import compile_and_run
from npu_fx_fusion import dispatch_inventory as inventory
from npu_fx_fusion import npu_dispatch
from npu_fx_fusion.npu_ops import ensure_registered
from torchair_harness.runner import torch_npu_dir_or_skip

aten = torch.ops.aten
YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
SO = "torch_npu/lib/libtorch_npu.so"


# =====================================================================================
# The inventory against the wheel
# =====================================================================================
@pytest.fixture(scope="module")
def wheel():
    return torch_npu_dir_or_skip()


@pytest.fixture(scope="module")
def so_names(wheel):
    """The kernel wrapper and autograd node names compiled into libtorch_npu.so.

    Mangled C++ names spell an identifier as <length><identifier>: torchgen's wrappers sit in
    an anonymous namespace (`_GLOBAL__N_1`), torch_npu's generated autograd nodes in
    at_npu::autograd::generated (`N6at_npu8autograd9generated`); registration names also
    appear as plain strings."""
    with open(os.path.join(wheel, SO), "rb") as f:
        data = f.read()
    names = set()
    for length, rest in re.findall(rb"_GLOBAL__N_1(\d+)(wrapper_(?:Autograd)?NPU_\w+)", data):
        names.add(rest[:int(length)].decode())
    names.update(m.decode() for m in re.findall(rb"\x00(wrapper_(?:Autograd)?NPU_\w+)\x00", data))
    for length, rest in re.findall(rb"N6at_npu8autograd9generated(\d+)(\w+)", data):
        names.add("at_npu::autograd::generated::" + rest[:int(length)].decode())
    assert "wrapper_NPU__matmul" in names and len(names) > 1000  # the scan itself works
    return names


@pytest.fixture(scope="module")
def yaml_sections(wheel):
    """{section: {aten overload name}} of the wheel's yaml (entries are names or `func:` schemas)."""
    import yaml

    with open(os.path.join(wheel, YAML), encoding="utf-8") as f:
        data = yaml.safe_load(f)
    sections = {}
    for section in ("autograd", "custom", "quant", "supported", "symint"):
        entries = data.get(section) or []
        sections[section] = {e if isinstance(e, str) else e["func"].split("(")[0] for e in entries}
    return sections


def _aten_schemas():
    schemas = {}
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::"):
            name = schema.name[len("aten::"):]
            schemas[name + ("." + schema.overload_name if schema.overload_name else "")] = schema
    return schemas


def _wrapper_names(schema) -> tuple[str, str]:
    """torchgen's kernel wrapper names of an aten schema at NPU and AutogradNPU
    (torchgen/dest/register_dispatch_key.py: wrapper_{key}_{overload}_{dispatcher name})."""
    from torchgen.api import dispatcher
    from torchgen.model import FunctionSchema

    parsed = FunctionSchema.parse(str(schema)[len("aten::"):])
    base = dispatcher.name(parsed)
    overload = parsed.name.overload_name
    return f"wrapper_NPU_{overload}_{base}", f"wrapper_AutogradNPU_{overload}_{base}"


def _cia(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CompositeImplicitAutograd")


def test_the_inventory_is_every_composite_op_torch_npu_registers(so_names):
    registered = set()
    for op, schema in _aten_schemas().items():
        try:
            names = _wrapper_names(schema)
        except Exception:  # noqa: BLE001 - a few schemas torchgen cannot parse (RRef, complex defaults)
            continue
        if any(name in so_names for name in names) and _cia(op):
            registered.add(op)
    listed = {row.op for row in inventory.OVERRIDES}
    assert listed == registered, (f"missing from the inventory: {sorted(registered - listed)}; "
                                  f"listed but not registered: {sorted(listed - registered)}")
    assert len(inventory.OVERRIDES) == len(listed)  # one row per op


@pytest.mark.parametrize("row", inventory.OVERRIDES, ids=[r.op for r in inventory.OVERRIDES])
def test_each_rows_claims_about_the_wheel_are_true(row, so_names, yaml_sections):
    assert _cia(row.op), f"{row.op} is not CompositeImplicitAutograd in torch {torch.__version__}"
    npu_wrapper, autograd_wrapper = _wrapper_names(_aten_schemas()[row.op])
    assert row.npu_kernel == npu_wrapper and npu_wrapper in so_names
    assert row.op in yaml_sections[row.yaml], f"{row.op} is not in the yaml's {row.yaml} section"
    if row.autograd is None:
        assert autograd_wrapper not in so_names, f"{row.op} has {autograd_wrapper}"
    elif row.autograd_is_formula:
        # the autograd node of op-plugin's derivatives.yaml, and no wrapper running in its place
        assert row.autograd in so_names, row.autograd
        assert autograd_wrapper not in so_names, f"{row.op} has {autograd_wrapper} too"
    else:
        assert row.autograd == autograd_wrapper and autograd_wrapper in so_names


def test_a_dtype_conversion_is_not_overridden_so_npu_graphs_hold_to_copy(so_names, yaml_sections):
    # DTYPE_CAST: no `to` overload has an NPU kernel; _to_copy only a PrivateUse1 one, which
    # runs below aot's tracing (the graph records aten._to_copy, as on CPU)
    schemas = _aten_schemas()
    for op in [o for o in schemas if o == "to" or o.startswith("to.")]:
        assert not any(name in so_names for name in _wrapper_names(schemas[op])), op
    npu_wrapper, autograd_wrapper = _wrapper_names(schemas["_to_copy"])
    assert npu_wrapper in so_names and autograd_wrapper not in so_names
    assert "_to_copy" in yaml_sections["supported"]


def test_torchairs_python_kernels_are_what_the_emulation_registers(wheel):
    with open(os.path.join(wheel, "torch_npu/dynamo/torchair/_utils/__init__.py"), encoding="utf-8") as f:
        source = f.read()
    assert "@aten.to.other.py_impl(DispatchKey.AutogradPrivateUse1)" in source
    assert "@aten.type_as.default.py_impl(DispatchKey.AutogradPrivateUse1)" in source
    assert "@aten.matmul_backward.default.py_impl(DispatchKey.CompositeImplicitAutograd)" in source
    assert source.count("output = self.to(other.dtype)") == 2
    assert [op for op, _, _ in npu_dispatch.TORCHAIR_PY_KERNELS] == ["to.other", "type_as", "matmul_backward"]


def test_the_soc_versions_are_torch_npus(wheel):
    with open(os.path.join(wheel, "torch_npu/_inductor/config.py"), encoding="utf-8") as f:
        source = f.read()
    for name, soc in (("Ascend910B1", "Ascend910B"), ("Ascend910_9391", "Ascend910_93"), ("Ascend950", "Ascend950")):
        assert f"{name} = {npu_dispatch.SOC_VERSIONS[soc]}" in source


def test_transformers_evaluates_its_npu_flag_at_import_and_converts_float_masks():
    import inspect

    from transformers.integrations import sdpa_attention

    source = inspect.getsource(sdpa_attention)
    assert "\n_is_torch_npu_available = is_torch_npu_available()\n" in source  # module level: at import
    assert "attention_mask = torch.logical_not(attention_mask.bool()).to(query.device)" in source
    assert "if attention_mask is not None and attention_mask.dtype != torch.bool:" in source


# =====================================================================================
# The emulation against the inventory
# =====================================================================================
def test_the_emulation_registers_exactly_the_rows_marked_emulated():
    assert {r.op for r in npu_dispatch.REGISTRATIONS} - {"matmul_backward"} == inventory.emulated_ops()
    for row in inventory.OVERRIDES:
        assert row.emulated or row.effect != inventory.CHANGES or row.why_not_emulated, row.op
        if row.emulated:
            keys = {k for r in npu_dispatch.REGISTRATIONS if r.op == row.op for k in r.keys}
            # a wrapper pair -> CPU + AutogradCPU; a formula -> CPU + the formula at AutogradCPU;
            # a PrivateUse1 kernel alone (or with torch's own formula, matmul) -> CPU
            assert keys == ({"CPU", "AutogradCPU"} if row.autograd and row.op != "matmul" else {"CPU"}), row.op


def _trace(fn, args, *, emulate, grad=False, soc=None, real=False):
    """aot_autograd's graphs of fn(*args) (forward, and backward when grad): op names with
    their keyword arguments, which patterns match too."""
    from torch._functorch.aot_autograd import aot_function

    graphs = []

    def capture(gm, example_inputs):
        graphs.append([f"{n.target}{sorted(n.kwargs.items()) if n.kwargs else ''}"
                       for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    args = [a.detach().clone().requires_grad_(grad and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
            for a in args]
    scope = npu_dispatch.emulated(soc) if emulate else npu_dispatch.suspended()
    if real:  # data-dependent output shapes (nonzero) have no aot graph: record real execution
        from torch.fx.experimental.proxy_tensor import make_fx

        with scope:
            capture(make_fx(fn, tracing_mode="real")(*args), args)
        return graphs
    compiled = aot_function(fn, fw_compiler=capture, bw_compiler=capture, decompositions={})
    with scope, torch.set_grad_enabled(grad):
        out = compiled(*args)
        if grad:
            first = out[0] if isinstance(out, (tuple, list)) else out
            first.float().sum().backward()
    return graphs


_X = torch.randn(3, 4)
_BOOL_MASK = torch.rand(1, 1, 4, 4) > 0.3
_QKV = [torch.randn(1, 2, 4, 8) for _ in range(3)]
# (example, whether a backward is traced too, ops only the NPU graph holds)
EXAMPLES = {
    "scaled_dot_product_attention": ((lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), _QKV),
                                     True, ["npu.npu_fusion_attention_v3.default", "aten.triu.default",
                                            "npu.npu_fusion_attention_grad_v3.default"]),
    "softmax.int": ((lambda x: torch.softmax(x, -1, dtype=torch.float32), [_X.bfloat16()]), True,
                    ["npu._npu_dtype_cast.default", "npu._npu_dtype_cast_backward.default"]),
    "matmul": ((lambda x, w: x @ w, [torch.randn(2, 3, 4), torch.randn(4, 5)]), True,
               ["aten.matmul.default", "aten.matmul_backward.default"]),
    "repeat_interleave.self_int": ((lambda x: x.repeat_interleave(2, dim=0), [_X]), True,
                                   ["aten.repeat_interleave.self_int", "npu.repeat_interleave_backward_int.default"]),
    "repeat_interleave.self_Tensor": ((lambda x, r: x.repeat_interleave(r, dim=0, output_size=6),
                                       [_X, torch.tensor([1, 2, 3])]), True,
                                      ["aten.repeat_interleave.self_Tensor",
                                       "npu.repeat_interleave_backward_tensor.default"]),
    "one_hot": ((lambda i: F.one_hot(i, 5), [torch.randint(0, 5, (6,))]), False, []),
    "argsort": ((lambda x: torch.argsort(x, dim=-1), [torch.randn(8)]), False, []),
    "argsort.stable": ((lambda x: torch.argsort(x, stable=True), [torch.randn(8)]), False, []),
    "contiguous": ((lambda x: x.t().contiguous() * 2, [_X]), True, []),
    "where": ((lambda c: torch.where(c), [torch.rand(3, 3) > 0.5]), False, []),
    "log_sigmoid": ((lambda x: F.logsigmoid(x), [_X]), True, []),
    "_weight_norm": ((lambda v, g: torch._weight_norm(v, g, 0), [_X, torch.randn(3, 1)]), True,
                     ["aten.norm.ScalarOpt_dim"]),
    "adaptive_avg_pool2d": ((lambda x: F.adaptive_avg_pool2d(x, (1, 1)), [torch.randn(1, 2, 4, 4)]), True, []),
    "multilabel_margin_loss": ((lambda x, t: F.multilabel_margin_loss(x, t), [_X, torch.tensor([[1, -1, 0, 0]] * 3)]),
                               False, []),
    # a contiguous input: torch's Meta of _pdist_forward refuses a non-contiguous one, which
    # CPU's composite copies first and torch_npu's kernel does not (so that fails to trace)
    "pdist": ((lambda x: F.pdist(x), [torch.randn(4, 3)]), False, []),
    "fft_fftshift": ((lambda x: torch.fft.fftshift(x), [_X]), False, []),
    "fft_ifftshift": ((lambda x: torch.fft.ifftshift(x), [_X]), False, []),
    "__ior__.Tensor": ((lambda a, b: a.clone().__ior__(b), [torch.tensor([1, 2]), torch.tensor([4, 4])]), False, []),
    "__ior__.Scalar": ((lambda a: a.clone().__ior__(4), [torch.tensor([1, 2])]), False, []),
    "cdist": ((lambda a, b: torch.cdist(a, b), [torch.randn(3, 4), torch.randn(5, 4)]), True,
              ["aten.cdist.default"]),
    "inverse": ((lambda a: torch.inverse(a), [torch.randn(3, 3) + 3 * torch.eye(3)]), True,
                ["aten.inverse.default", "aten.matmul.default"]),
    "kl_div": ((lambda a, b: F.kl_div(a, b, reduction="sum"), [_X.log_softmax(-1), _X.softmax(-1)]), True,
               ["aten.kl_div.default", "npu.kl_div_backward.default", "npu.kl_div_target_backward.default"]),
    "l1_loss": ((lambda a, b: F.l1_loss(a, b), [_X, torch.randn(3, 4)]), True,
                ["aten.l1_loss.default", "npu.l1_loss_backward.default"]),
    "linalg_cholesky": ((lambda a: torch.linalg.cholesky(a @ a.mT + torch.eye(3)), [torch.randn(3, 3)]), True,
                        ["aten.linalg_cholesky.default"]),
    "stft": ((lambda x: torch.stft(x, 8, window=torch.hann_window(8), return_complex=True).abs(), [torch.randn(32)]),
             False, ["aten.stft.default"]),
    "isclose": ((lambda a, b: torch.isclose(a, b), [_X, _X + 1e-9]), False, ["aten.isclose.default"]),
    "isfinite": ((lambda a: torch.isfinite(a), [_X]), False, ["aten.isfinite.default"]),
}


REAL_TRACES = {"where"}  # where(condition) is nonzero: no fake-tensor trace


def test_every_emulated_row_has_an_example():
    assert set(EXAMPLES) == inventory.emulated_ops()


@pytest.mark.parametrize("op", sorted(EXAMPLES))
def test_each_emulated_rows_effect_is_what_tracing_shows(op):
    """A row says the NPU graph differs from the CPU trace (CHANGES) or not (SAME); tracing
    its example with the emulation on and off must agree, and the NPU graph hold the ops
    the row names."""
    ensure_registered()
    row = inventory.OVERRIDE_BY_OP[op]
    (fn, args), grad, npu_only = EXAMPLES[op]
    real = op in REAL_TRACES
    cpu = _trace(fn, args, emulate=False, grad=grad, real=real)
    npu = _trace(fn, args, emulate=True, grad=grad, real=real)
    if row.effect == inventory.SAME:
        assert npu == cpu, f"{op}: the row says the graphs are the same\n cpu: {cpu}\n npu: {npu}"
    else:
        assert npu != cpu, f"{op}: the row says the NPU graph differs, it does not: {cpu}"
    npu_ops = {entry.split("[")[0] for graph in npu for entry in graph}
    cpu_ops = {entry.split("[")[0] for graph in cpu for entry in graph}
    for name in npu_only:
        assert name in npu_ops and name not in cpu_ops, (op, name, npu_ops)


def test_emulated_kernels_compute_what_the_composites_compute():
    """Inside the emulation, eager calls run the emulated kernels: the same values as CPU's
    composites (the overrides change spellings, not results)."""
    ensure_registered()
    for op, ((fn, args), _, _) in EXAMPLES.items():
        with npu_dispatch.suspended():
            expected = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        with npu_dispatch.emulated():
            actual = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=op)


# ---- SDPA's decision tree --------------------------------------------------------------------
def _sdpa_graph(query, key, value, soc=None, attn_mask=None, **kwargs):
    if attn_mask is None:
        (graph,) = _trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs), [query, key, value],
                          emulate=True, soc=soc)
    else:  # the mask an input of the trace, as a model's is
        (graph,) = _trace(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kwargs),
                          [query, key, value, attn_mask], emulate=True, soc=soc)
    return graph


def _fa_call(graph, op="npu.npu_fusion_attention_v3.default"):
    (call,) = [entry for entry in graph if entry.startswith(op)]
    return call


def _qkv(batch=1, heads=2, queries=4, keys=4, dim=8, kv_heads=None, dtype=torch.float32):
    torch.manual_seed(0)
    return (torch.randn(batch, heads, queries, dim, dtype=dtype),
            torch.randn(batch, kv_heads or heads, keys, dim, dtype=dtype),
            torch.randn(batch, kv_heads or heads, keys, dim, dtype=dtype))


def test_sdpa_is_flash_attention_v3_on_a2_a3_with_the_mask_made_ascends():
    ensure_registered()
    q, k, v = _qkv()
    causal = _sdpa_graph(q, k, v, is_causal=True)
    assert causal[:2] == ["aten.ones.default[('device', device(type='cpu')), ('dtype', torch.bool), "
                          "('pin_memory', False)]", "aten.triu.default"]
    assert "npu.npu_fusion_attention_v3.default" in causal
    masked = _sdpa_graph(q, k, v, attn_mask=_BOOL_MASK)
    assert masked[0] == "aten.logical_not.default" and "npu.npu_fusion_attention_v3.default" in masked
    for soc in ("Ascend910B", "Ascend910_93"):
        assert "npu.npu_fusion_attention_v3.default" in _sdpa_graph(q, k, v, soc=soc, is_causal=True)


def test_sdpa_arguments_are_the_kernels():
    """is_causal: sparse_mode 2 (left-up) and next_tockens 0; a mask: sparse_mode 0 and
    inner_precise 2 over Sq > 1, 0 for one query; the scale 1/sqrt(D) in double."""
    ensure_registered()
    graphs = {}

    def capture(gm, example_inputs):
        graphs["fa"] = [n for n in gm.graph.nodes if n.target is torch.ops.npu.npu_fusion_attention_v3.default]
        return gm.forward

    from torch._functorch.aot_autograd import aot_function

    def args_of(fn, *inputs):
        """The FA-v3 call's arguments by name, defaults filled (the trace drops trailing defaults)."""
        with npu_dispatch.emulated(), torch.no_grad():
            aot_function(fn, fw_compiler=capture, decompositions={})(*inputs)
        (node,) = graphs["fa"]
        schema = node.target._schema
        bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        bound.update(zip([a.name for a in schema.arguments], node.args))
        bound.update(node.kwargs)
        return bound

    q, k, v = _qkv(dim=8)
    fixed = {"pse": None, "padding_mask": None, "keep_prob": 1.0, "pre_tockens": 2147483647, "prefix": None,
             "actual_seq_qlen": None, "actual_seq_kvlen": None, "gen_mask_parallel": True, "sync": False,
             "input_layout": "BNSD", "head_num": 2}
    causal = args_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    assert {name: causal[name] for name in fixed} == fixed
    assert causal["scale"] == 1.0 / math.sqrt(8)
    assert (causal["next_tockens"], causal["inner_precise"], causal["sparse_mode"]) == (0, 0, 2)
    masked = args_of(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3),
                     q, k, v, _BOOL_MASK)
    assert {name: masked[name] for name in fixed} == fixed and masked["scale"] == 0.3
    assert (masked["next_tockens"], masked["inner_precise"], masked["sparse_mode"]) == (2147483647, 2, 0)
    decode = args_of(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                     q[:, :, :1], k, v, _BOOL_MASK[..., :1, :])
    assert decode["inner_precise"] == 0  # a single query row: no invalid-row correction


def test_sdpa_takes_the_other_branches_where_torch_npu_does():
    ensure_registered()
    q, k, v = _qkv()
    ascend950 = _sdpa_graph(q, k, v, soc="Ascend950", is_causal=True)
    assert "npu.npu_fusion_attention.default" in ascend950 and "npu.npu_fusion_attention_v3.default" not in ascend950
    for graph in (_sdpa_graph(q, k, v, soc="Ascend310P", is_causal=True),  # below Ascend910B1
                  _sdpa_graph(*_qkv(dim=6), is_causal=True),  # fp32 with D % 4 != 0
                  _sdpa_graph(q, k, v, attn_mask=torch.zeros(4, 4)),  # a float mask
                  _sdpa_graph(q[0], k[0], v[0])):  # 3-D
        assert not any("fusion_attention" in entry for entry in graph) and "aten._safe_softmax.default" in graph
    # a bool mask on the math path is made additive first (zeros_like + masked_fill)
    math_masked = _sdpa_graph(q, k, v, soc="Ascend310P", attn_mask=_BOOL_MASK)
    assert "aten.masked_fill.Scalar" in math_masked and "aten.where.self" not in math_masked
    # GQA without enable_gqa: FlashAttention takes Nkv < Nq itself
    assert "npu.npu_fusion_attention_v3.default" in _sdpa_graph(*_qkv(heads=4, kv_heads=2), is_causal=True)


def test_a_mask_that_does_not_broadcast_as_is_is_pre_expanded():
    ensure_registered()
    q, k, v = _qkv(batch=2)
    per_query = torch.rand(2, 4, 4) > 0.3  # 3-D: broadcasts, but is none of SS / B1SS / BNSS / 11SS
    graph = _sdpa_graph(q, k, v, attn_mask=per_query)
    assert graph.index("aten.expand.default") < graph.index("aten.logical_not.default")
    assert "aten.expand.default" not in _sdpa_graph(q, k, v, attn_mask=_BOOL_MASK.expand(2, 1, 4, 4))


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950", "Ascend310P"])
@pytest.mark.parametrize("case", ["causal", "bool mask", "gqa", "fp32 odd head dim"])
def test_emulated_sdpa_computes_what_cpus_sdpa_does(soc, case):
    ensure_registered()
    torch.manual_seed(0)
    kwargs = {}
    if case == "gqa":
        q, k, v = _qkv(heads=4, kv_heads=2)
        kwargs = {"is_causal": True, "enable_gqa": True}
    elif case == "fp32 odd head dim":
        q, k, v = _qkv(dim=6)
        kwargs = {"attn_mask": _BOOL_MASK}
    else:
        q, k, v = _qkv()
        kwargs = {"is_causal": True} if case == "causal" else {"attn_mask": _BOOL_MASK}
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    with npu_dispatch.emulated(soc):
        actual = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# ---- scope -------------------------------------------------------------------------------------
def _visible_registrations():
    touched = [r.overload for r in npu_dispatch.REGISTRATIONS]
    return ({str(op): [k for k in ("CPU", "AutogradCPU") if torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), k)] for op in touched},
            {op: sorted(str(k) for k in npu_dispatch._overload(op).py_kernels)
             for op, _, _ in npu_dispatch.TORCHAIR_PY_KERNELS})


def _eager_sdpa_graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = _qkv()
    gm = make_fx(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_a_compile_leaves_no_override_behind():
    """Registered for the compile only: before and after, the same kernels (none of ours),
    and user code traces and runs as plain CPU code."""
    before = _visible_registrations()
    eager_before = _eager_sdpa_graph()
    q, k, v = _qkv()

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True) @ v.transpose(-1, -2)

    out, ref, report = compile_and_run(Attention(), q, k, v)
    assert report.graphs[0].ops_before["npu.npu_fusion_attention_v3.default"] == 1  # it was active
    assert _visible_registrations() == before
    assert npu_dispatch.active() is None
    assert _eager_sdpa_graph() == eager_before
    assert not any("fusion_attention" in op for op in eager_before)
    torch.testing.assert_close(out, ref)


def test_suspended_restores_the_emulation_it_interrupted():
    with npu_dispatch.emulated():
        assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutogradCPU")
        with npu_dispatch.suspended():
            assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutogradCPU")
            assert npu_dispatch.active() is None
        assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutogradCPU")
        with npu_dispatch.emulated("Ascend950") as inner:  # another SoC: the outer one is suspended
            assert inner.soc == "Ascend950" and npu_dispatch.active() is inner
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutogradCPU")


def test_an_unknown_soc_is_refused_before_anything_is_registered():
    with pytest.raises(ValueError, match="SocVersion"):
        npu_dispatch.NpuDispatch("Ascend910A")
    with pytest.raises(ValueError, match="unknown SoC"):
        nff.FusionConfig(soc="Ascend910A")


# ---- the backend --------------------------------------------------------------------------------
class _Projection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return torch.softmax(self.proj(x), dim=-1, dtype=torch.float32)


@pytest.mark.parametrize("npu_dispatch_on", [True, False])
def test_the_switch_and_the_report_say_which_graph_was_fused(npu_dispatch_on, tmp_path):
    config = nff.FusionConfig(npu_dispatch=npu_dispatch_on, dump_dir=str(tmp_path))
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    out, ref, report = compile_and_run(_Projection().to(torch.bfloat16), x, config=config)
    ops = report.graphs[0].ops_before
    assert (ops["aten.matmul.default"] == 1) == npu_dispatch_on
    assert (ops["npu._npu_dtype_cast.default"] == 1) == npu_dispatch_on
    assert report.graph_source.startswith("NPU graph" if npu_dispatch_on else "CPU graph")
    assert report.graph_source in report.to_markdown() and report.to_dict()["graph_source"] == report.graph_source
    (before,) = list(tmp_path.rglob("before.py"))
    assert ("torch.ops.aten.matmul.default" in before.read_text()) == npu_dispatch_on
    assert ("Ascend910B" in (tmp_path / "report.md").read_text()) == npu_dispatch_on
    torch.testing.assert_close(out, ref)


def test_training_under_npu_dispatch_runs_matmul_backward_on_cpu():
    """The backward graph holds aten.matmul_backward, which CPU has no kernel for: it runs
    through npu_dispatch.lower_for_cpu, and the gradients are eager's."""
    model = _Projection()
    x = torch.randn(2, 3, 8)
    eager = _Projection()
    out, ref, report = compile_and_run(model, x, grad=True)
    out.sum().backward()
    eager(x).sum().backward()
    backward = next(g for g in report.graphs if g.name == "backward")
    assert backward.ops_before["aten.matmul_backward.default"] == 1
    torch.testing.assert_close(model.proj.weight.grad, eager.proj.weight.grad, rtol=1e-5, atol=1e-6)


class _ProjectedAttention(torch.nn.Module):
    """q / k / v as decoder code makes them: a projection viewed (B, S, N, D) and transposed to
    BNSD, so SDPA sees non-contiguous inputs (litgpt, olmo-core, HF)."""

    def __init__(self, heads, kv_heads, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = torch.nn.Linear(16, heads * dim, bias=False)
        self.kv = torch.nn.Linear(16, 2 * kv_heads * dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = (t.view(b, s, self.kv_heads, self.dim).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return y.transpose(1, 2).reshape(b, s, -1)


@pytest.mark.parametrize("batch, seq, kv_heads", [(1, 4, 4), (2, 6, 2)], ids=["B=1 MHA", "B=2 GQA"])
def test_training_through_emulated_sdpa_on_transposed_qkv_gives_eagers_gradients(batch, seq, kv_heads):
    """The emulation's SDPA is npu_fusion_attention_v3, differentiated by its grad op: with
    transposed q / k / v the grad op's outputs must have the strides its fake promises (a
    contiguous dq, as op-plugin allocates it), or the compiled backward's `view` of dq fails."""
    x = torch.randn(batch, seq, 16)
    model, eager = _ProjectedAttention(4, kv_heads), _ProjectedAttention(4, kv_heads)
    out, ref, report = compile_and_run(model, x, grad=True)
    out.sum().backward()
    eager(x).sum().backward()
    assert report.graphs[0].ops_before["npu.npu_fusion_attention_v3.default"] == 1
    backward = next(g for g in report.graphs if g.name == "backward")
    assert backward.ops_before["npu.npu_fusion_attention_grad_v3.default"] == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, dict(eager.named_parameters())[name].grad, rtol=1e-4, atol=1e-5)


# ---- autocast -------------------------------------------------------------------------------------
def test_autocast_under_the_emulation_is_torch_npus(recwarn):
    """torch.autocast(device_type="cpu") while the emulation is active is torch_npu's autocast:
    fp32 taken (CPU autocast refuses it), fp16 by default, bf16 only from Ascend910B1, and
    torch_npu's op lists instead of CPU's (dispatch_inventory.AUTOCAST_POLICIES)."""
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    with npu_dispatch.emulated():
        with torch.autocast("cpu", dtype=torch.float32):
            assert F.linear(x, w).dtype == torch.float32  # lower_precision_fp: the autocast dtype, fp32
            assert torch.cat([x, x]).dtype == torch.bfloat16  # on CPU's promote list, not on torch_npu's
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.exp(x).dtype == torch.float32  # torch_npu's fp32 list; CPU does not cast exp
            assert torch.softmax(x, -1).dtype == torch.float32  # fp32_set_opt_dtype
            assert F.linear(x.float(), w.float()).dtype == torch.bfloat16
        with torch.autocast("cpu"):
            assert F.linear(x.float(), w.float()).dtype == torch.float16  # a PrivateUse1 autocast's default
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
    with npu_dispatch.emulated("Ascend310P"):
        with pytest.warns(UserWarning, match="In npu autocast, but the target dtype is not supported"):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # no bf16 below Ascend910B1
                assert F.linear(x.float(), w.float()).dtype == torch.float32
    # eager code after the emulation: CPU's autocast again
    with pytest.warns(UserWarning, match="In CPU autocast, but the target dtype is not supported"):
        with torch.autocast("cpu", dtype=torch.float32):
            assert F.linear(x, w).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.exp(x).dtype == torch.bfloat16 and torch.cat([x, x.float()]).dtype == torch.float32


def test_the_autocast_lists_name_torch_2_13s_ops():
    ops = [op for policy in inventory.AUTOCAST_POLICIES for op in policy.ops]
    assert len(ops) == len(set(ops)) == 104
    for op in ops:
        npu_dispatch._overload(op)  # AttributeError for an op torch 2.13 does not have
    assert {p.policy for p in inventory.AUTOCAST_POLICIES} == {
        "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned"}
    with npu_dispatch.emulated(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(3), torch.rand(3))
        assert torch.norm(torch.randn(4, dtype=torch.bfloat16)).dtype == torch.float32  # fp32_append_dtype
        a, b = torch.randn(4, dtype=torch.bfloat16), torch.randn(4)
        assert torch.dot(a, a).dtype == torch.bfloat16 and torch.addcmul(b, a, a).dtype == torch.float32  # promote


class _CapturingBackend(nff.backend.EmulationBackend):
    """The emulation backend, recording each graph's nodes before the passes run."""

    def __init__(self, config):
        super().__init__(config)
        self.graphs = []

    def _compile(self, phase, gm, example_inputs):
        self.graphs.append([(n.target, n.args) for n in gm.graph.nodes if n.op == "call_function"])
        return super()._compile(phase, gm, example_inputs)


def _router_score_dtypes(graph):
    """The dtypes the routers' softmax reads (every _softmax of these models is a router's:
    their attention is SDPA)."""
    return [node_args[0].meta["val"].dtype for target, node_args in graph if target is torch.ops.aten._softmax.default]


@pytest.mark.slow
@pytest.mark.parametrize("name, layers", [("deepseek_v3", 2), ("qwen3_moe", 1)])  # one MoE layer each
def test_torchtitan_bf16_routers_trace_fp32_as_on_an_npu(name, layers):
    """torchtitan's router computes its gate under torch.autocast(dtype=float32): on an NPU an
    fp32 gate, under the emulation too; the plain CPU trace has a bf16 one (autocast disabled)."""
    from npu_fx_fusion.tiny_models import build_torchtitan

    tiny = build_torchtitan(name, dtype=torch.bfloat16, num_layers=layers)
    dtypes = {}
    for npu_dispatch_on in (True, False):
        backend = _CapturingBackend(nff.FusionConfig(npu_dispatch=npu_dispatch_on))
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(tiny.model, backend=backend)(*tiny.example_inputs)
        dtypes[npu_dispatch_on] = _router_score_dtypes(backend.graphs[0])
        gating = backend.report.counts["moe_gating"]
        reasons = [m.reason for m in backend.report.near_misses if m.pass_name == "moe_gating"]
        if name == "deepseek_v3":  # its router form fuses once the logits are fp32
            assert gating == (1 if npu_dispatch_on else 0), reasons
            assert npu_dispatch_on or any("bfloat16 logits" in r for r in reasons), reasons
    assert dtypes == {True: [torch.float32], False: [torch.bfloat16]}


# ---- transformers' NPU branch -------------------------------------------------------------------
class _TransformersSdpa(torch.nn.Module):
    """transformers' sdpa_attention_forward with a float (additive) mask."""

    is_causal = False
    num_key_value_groups = 1

    def forward(self, q, k, v, mask):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(self, q, k, v, mask, scaling=0.5)[0]


def _float_mask():
    visible = torch.rand(1, 1, 4, 4) > 0.3
    return torch.zeros(1, 1, 4, 4).masked_fill(~visible, torch.finfo(torch.float32).min)


def test_transformers_npu_branch_is_the_one_the_flag_gives(monkeypatch):
    """The dynamo-graph rewrite gives the aot graph that tracing with transformers'
    `_is_torch_npu_available` patched to True gives (the flag can only be patched before
    dynamo traces, which no backend sees)."""
    from transformers.integrations import sdpa_attention

    q, k, v = _qkv()
    mask = _float_mask()
    _, ref, rewritten = compile_and_run(_TransformersSdpa(), q, k, v, mask)
    torch._dynamo.reset()
    monkeypatch.setattr(sdpa_attention, "_is_torch_npu_available", True)
    out, _, flagged = compile_and_run(_TransformersSdpa(), q, k, v, mask)
    monkeypatch.undo()
    assert rewritten.graphs[0].ops_before == flagged.graphs[0].ops_before
    ops = rewritten.graphs[0].ops_before
    # bool(), logical_not (transformers), logical_not (torch_npu's SDPA) -> FA-v3
    assert ops["aten.logical_not.default"] == 2 and ops["npu.npu_fusion_attention_v3.default"] == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_without_npu_dispatch_the_float_mask_stays():
    q, k, v = _qkv()
    _, _, report = compile_and_run(_TransformersSdpa(), q, k, v, _float_mask(),
                                   config=nff.FusionConfig(npu_dispatch=False))
    ops = report.graphs[0].ops_before
    assert ops["aten.logical_not.default"] == 0 and ops["npu.npu_fusion_attention_v3.default"] == 0


def test_sdpa_outside_transformers_keeps_its_float_mask():
    # the branch belongs to transformers' sdpa_attention_forward only: plain user SDPA with a
    # float mask takes torch_npu's math path
    class Plain(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = _qkv()
    _, _, report = compile_and_run(Plain(), q, k, v, _float_mask())
    ops = report.graphs[0].ops_before
    assert ops["npu.npu_fusion_attention_v3.default"] == 0 and ops["aten._safe_softmax.default"] == 1


def test_the_inventorys_counts_are_what_the_docs_say():
    effects = collections.Counter(row.effect for row in inventory.OVERRIDES)
    assert sum(effects.values()) == len(inventory.OVERRIDES) == 47
    docs = os.path.join(os.path.dirname(__file__), "..", "docs", "npu-graph.md")
    with open(docs, encoding="utf-8") as f:
        text = f.read()
    for row in inventory.OVERRIDES:
        assert f"`{row.op}`" in text, f"docs/npu-graph.md does not list {row.op}"


@pytest.mark.parametrize("shapes", [((4,), (4,)), ((3, 4), (4,)), ((4,), (4, 5)), ((3, 4), (4, 5)),
                                    ((2, 3, 4), (4, 5)), ((2, 3, 4), (4,)), ((3, 4), (2, 4, 5)),
                                    ((2, 1, 3, 4), (5, 4, 6)), ((2, 3, 4), (2, 4, 5))], ids=str)
def test_matmul_backward_rounds_as_cpus_autograd(shapes):
    """The CPU kernel of aten.matmul_backward (an NPU graph's training op) gives CPU autograd's
    gradients bit for bit: the same folded mm / bmm products, summed the same way."""
    a = torch.randn(shapes[0], requires_grad=True)
    b = torch.randn(shapes[1], requires_grad=True)
    out = torch.matmul(a, b)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(out, (a, b), grad)
    actual = npu_dispatch.matmul_backward(grad, a.detach(), b.detach(), [True, True])
    assert all(torch.equal(x, y) for x, y in zip(actual, expected))
    assert npu_dispatch.matmul_backward(grad, a.detach(), b.detach(), [False, True])[0] is None
