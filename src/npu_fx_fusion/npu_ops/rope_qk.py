"""RoPE of q and k in one call: npu_apply_rotary_pos_emb.

torch_npu 2.13.0: `npu_apply_rotary_pos_emb(query, key, cos, sin, layout='BSND',
rotary_mode='half') -> (Tensor, Tensor)` (csrc/aten/npu_native_functions_by_codegen.yaml),
documented in the wheel's _op_plugin_docs.py and the CANN page of aclnnApplyRotaryPosEmb:

    q_embed = q * cos + rotate(q) * sin,   k_embed = k * cos + rotate(k) * sin
    rotate (half):  cat(-x[..., D/2:], x[..., :D/2])

in one kernel, "计算结果执行原地更新": the kernel writes its results into query and key, and
op-plugin returns them (op_api/ApplyRotaryPosEmbKernelNpuOpApi.cpp: `return std::tie(query,
key)`), although the schema marks nothing as mutated and torch_npu's Meta function returns
new tensors (`torch.empty_like(query)`, `torch.empty_like(key)`). torchair's GE converter
therefore moves both inputs first (custom/apply_rotary_pos_emb.py: TensorMove(q),
TensorMove(k), ApplyRotaryPosEmb): two copies under max-autotune. The stand-in follows the
schema and the Meta function (new tensors, the inputs unchanged); a pass that emits the op
must make sure nothing reads q or k afterwards, since on an NPU they are overwritten
(patterns/rope_qk.py).

Limits (the docs): A2/A3 and Atlas inference (310P): layout BSND (4-D) or TND (3-D), half
mode only, D of q, k, cos and sin 64 or 128, cos/sin (B, S, 1, D) with B and S those of q
(TND: (T, 1, D)), one dtype for the four inputs, no bf16 on 310P, no empty tensors, and on
A2/A3 the UB bound of the CANN page; Ascend950: BSND, SBND, BNSD, TND, half / interleave /
quarter, D <= 1024, cos's batch may be 1.

Precision: the UB formula of the CANN page computes bf16 in fp32 (cast = 1, castSize 4)
and fp16 / fp32 in their own dtype (cast = 0): the stand-in rounds bf16 once, fp16 at each
step [inferred from the UB formula].
"""
from __future__ import annotations

import torch

from .spec import FLOAT_DTYPES, OpCapability, Sample, SocLimits, in_layout_of, op_spec, tensor_bytes

# layout -> the dims of cos/sin that are 1 (broadcast over the heads): BSND (B, S, 1, D)
_HEAD_DIM_OF = {"BSND": 2, "SBND": 2, "BNSD": 1, "TND": 1}
_RANK_OF = {"BSND": 4, "SBND": 4, "BNSD": 4, "TND": 3}


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    if mode == "interleave":  # Ascend950 only: pairs (x0, x1) -> (-x1, x0)
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    raise NotImplementedError(f"npu_apply_rotary_pos_emb: rotary_mode {mode!r} (quarter: Ascend950 only) "
                              "is not implemented by the stand-in")


def _embed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    if x.dtype == torch.bfloat16:  # computed in fp32, rounded once
        x32, cos32, sin32 = x.float(), cos.float(), sin.float()
        return (x32 * cos32 + _rotate(x32, mode) * sin32).to(x.dtype)
    return x * cos + _rotate(x, mode) * sin  # fp16 / fp32: in their own dtype


def _check(query, key, cos, sin, layout, rotary_mode):
    if layout not in _RANK_OF:
        raise RuntimeError(f"npu_apply_rotary_pos_emb: layout {layout!r} is not BSND, SBND, BNSD or TND")
    rank = _RANK_OF[layout]
    if any(t.dim() != rank for t in (query, key, cos, sin)):
        raise RuntimeError(f"npu_apply_rotary_pos_emb: layout {layout} takes {rank}-d query, key, cos and sin")
    if len({t.dtype for t in (query, key, cos, sin)}) != 1:
        raise RuntimeError("npu_apply_rotary_pos_emb: query, key, cos and sin must have one dtype")
    if query.shape[-1] != key.shape[-1] or cos.shape != sin.shape or cos.shape[-1] != query.shape[-1]:
        raise RuntimeError("npu_apply_rotary_pos_emb: query and key share D; cos and sin share their shape and D")
    heads = _HEAD_DIM_OF[layout]
    if cos.shape[heads] != 1:
        raise RuntimeError(f"npu_apply_rotary_pos_emb: cos/sin broadcast over the heads (dim {heads} is 1)")
    for d in range(rank - 1):
        if d != heads and not (query.shape[d] == key.shape[d] and cos.shape[d] in (1, query.shape[d])):
            raise RuntimeError(f"npu_apply_rotary_pos_emb: query {tuple(query.shape)}, key {tuple(key.shape)} and "
                               f"cos {tuple(cos.shape)} differ in dim {d}")


def _apply_rotary_pos_emb_fake(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    # torch_npu's Meta: torch.empty_like(query), torch.empty_like(key)
    return torch.empty_like(query), torch.empty_like(key)


def _samples(dtype):
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=generator).to(dtype)

    # BSND: GQA (4 q heads, 2 k heads), D 64 (A2/A3 take 64 or 128), per-batch tables; a
    # decode step (S 1) with D 128
    yield Sample((randn(2, 3, 4, 64), randn(2, 3, 2, 64), randn(2, 3, 1, 64), randn(2, 3, 1, 64)))
    yield Sample((randn(3, 1, 2, 128), randn(3, 1, 1, 128), randn(3, 1, 1, 128), randn(3, 1, 1, 128)),
                 {"layout": "BSND", "rotary_mode": "half"})
    # TND (T tokens of every sequence)
    yield Sample((randn(5, 4, 64), randn(5, 2, 64), randn(5, 1, 64), randn(5, 1, 64)), {"layout": "TND"})


def _work(call):
    """The kernel reads q, k, cos and sin and writes q and k in place; max-autotune's GE
    converter first copies q and k (TensorMove), two more kernels."""
    q, k = call.args["query"], call.args["key"]
    qk = tensor_bytes(q) + tensor_bytes(k)
    moved = 2 * qk + tensor_bytes(call.args["cos"]) + tensor_bytes(call.args["sin"])
    if call.mode == "max-autotune":
        return {"launches": 3, "bytes": moved + 2 * qk}
    return {"launches": 1, "bytes": moved}


@op_spec("npu::npu_apply_rotary_pos_emb",
         schema="npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSND', "
                "str rotary_mode='half') -> (Tensor, Tensor)",
         fake=_apply_rotary_pos_emb_fake,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES, min_rank=3, max_rank=4, backward=None, ge_converter=True,
             socs={"Ascend310P": SocLimits(dtypes=frozenset({torch.float32, torch.float16}))},
             limits={
                 "head_dims": (64, 128),  # A2/A3/310P: D of query, key, cos, sin
                 "head_dims_socs": ("Ascend910B", "Ascend910_93", "Ascend310P"),
                 "max_head_dim_950": 1024,
                 "layouts": ("BSND", "TND"),  # A2/A3/310P
                 "layouts_950": ("BSND", "SBND", "BNSD", "TND"),
                 "rotary_modes": ("half",),  # A2/A3/310P
                 "rotary_modes_950": ("half", "interleave", "quarter"),
                 # A2/A3 UB bound (CANN aclnnApplyRotaryPosEmb, 8.3.RC1), per q/k head count and
                 # dtype: (qn + kn) * 128 * c * 2 + 128 * s * 4 + (qn + kn) * 128 * c
                 # + (qn + kn) * 128 * c * 2 + cast * 128 * 4 * 2 <= UB (c = 4 for bf16, else s;
                 # s the element size; cast 1 for bf16)
                 "ub_bytes_a2_a3": 196608,
                 # the kernel writes query and key in place (op-plugin returns them)
                 "overwrites_inputs": ("query", "key"),
             },
             doc="torch_npu docs (_op_plugin_docs.py) and CANN aclnnApplyRotaryPosEmb: A2/A3/310P BSND or TND, "
                 "half mode, D 64 or 128, cos/sin (B, S, 1, D), one dtype, 310P without bf16, results written "
                 "into query and key (op-plugin returns them); Ascend950 BSND/SBND/BNSD/TND, "
                 "half/interleave/quarter, D <= 1024. GE: TensorMove of q and k, then ApplyRotaryPosEmb "
                 "(torchair custom/apply_rotary_pos_emb.py). No autograd (inference graphs only)",
             work=_work),
         samples=_samples)
def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    _check(query, key, cos, sin, layout, rotary_mode)
    q = _embed(query, cos, sin, rotary_mode)
    k = _embed(key, cos, sin, rotary_mode)
    return in_layout_of(q, query), in_layout_of(k, key)
