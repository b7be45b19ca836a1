"""A seeded differential fuzz of the passes (issue 15, "How to know it generalizes").

`make_case(seed)` builds one random small nn.Module from Python source it writes itself: an
RMSNorm, add + RMSNorm, RoPE (rotate_half / every-two / complex), SwiGLU or MoE router, in one
of the spellings, shapes, layouts and dtypes model code uses, static or `dynamic=True`,
inference or training, sometimes with two sites returned together, or a look-alike that
computes something else. Each case declares what it expects (`Case.kind`):

  positive  the named passes fuse it (`expect`: {pass: sites});
  limit     a positive spelling outside what the fused op takes (a real limit of the op, a
            dtype, a training mode): it must not fuse and must leave a near miss of
            `expect_pass` whose reason matches `limit`;
  negative  a look-alike: it must not fuse (a near miss is welcome, not required);
  either    equal math in a spelling the passes need not know (cos/sin swapped with their
            roles, a top-k of the logits instead of the probabilities): fusing or not are
            both right, the numerics decide.

`run_case(case)` is the oracle: eager, a float64 truth (tests/helpers.KeepFloat64) and the
emulation backend's compile, outputs and (training) gradients compared, the report read.
Each case gets exactly one class (OUTCOMES). A compile that raises is run again through
plain `aot_eager`: if that fails too it is torch's own failure, not ours.

KNOWN_GAPS lists positives that are known not to fuse yet, each with the near-miss reason
it must leave: a gap is never skipped silently. tests/test_fuzz.py runs a fixed slice;
benchmarks/fuzz.py the larger run with its figures.
"""
from __future__ import annotations

import copy
import dataclasses
import linecache
import math
import random
import re
import traceback
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import KeepFloat64, ulp
from npu_fx_fusion.backend import EmulationBackend

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
FAMILIES = ("rms_norm", "add_rms_norm", "rope", "rope_complex", "swiglu", "router")
# Families only made when asked for by name (make_case(seed, family)), so that adding one
# leaves every seed's case of FAMILIES as it was: attention_block, a decoder block around SDPA
# (issue 29's training crash: q / k / v made non-contiguous by .view().transpose(), GQA, B=1 and
# B>1), which every pass meets at once; library, model code of other codebases
# (tests/fuzz_library.py); mhc_post and mhc_pre, DeepSeek-V4's residual mix of n streams and its
# hyper-connection mappings, in their spellings; experts_loop, MoE experts run one by one
LIBRARY = "library"
NAMED_FAMILIES = ("attention_block", "mhc_post", "mhc_pre", "experts_loop", LIBRARY)

# Outcome classes. OK_OUTCOMES are the right answers; the others are failures.
FUSED = "fused"  # a positive fused its sites, numerics within tolerance
REFUSED = "refused"  # a limit case or look-alike left unfused (limits: with the declared near miss)
KNOWN_GAP = "known gap"  # a positive listed in KNOWN_GAPS, unfused with its listed near miss
EITHER_FUSED = "either: fused"
EITHER_UNFUSED = "either: unfused"
REFUSED_POSITIVE = "refused positive"  # a positive (or limit) with a near miss of another reason
SILENT_MISS = "silent miss"  # a positive / limit that neither fused nor left a near miss
WRONG_FUSION = "wrong fusion"  # a look-alike or limit case that fused
MISCOMPILE = "miscompile"  # fused, and outputs or gradients off beyond tolerance
COMPILE_FAILURE = "compile failure"  # our compile raised, plain aot_eager does not
TORCH_FAILURE = "torch failure"  # plain aot_eager raises too: not ours (reported, not counted)
PASS_REVERTED = "pass reverted"  # a pass raised and was reverted (report.errors)
OK_OUTCOMES = (FUSED, REFUSED, KNOWN_GAP, EITHER_FUSED, EITHER_UNFUSED, TORCH_FAILURE)
BAD_OUTCOMES = (MISCOMPILE, WRONG_FUSION, COMPILE_FAILURE, PASS_REVERTED, SILENT_MISS, REFUSED_POSITIVE)
OUTCOMES = OK_OUTCOMES[:-1] + BAD_OUTCOMES + (TORCH_FAILURE,)

# Tolerance for a fused result: its error against the float64 truth, in ulp of the output
# dtype at the largest |truth| (helpers.errors_at_scale), may exceed the eager program's
# own error by this much (and by a factor 2, for chains whose eager error is itself large).
# The fused ops compute in fp32 and round once where eager rounds each step (bf16/fp16:
# within 1 ulp of exact, the eager chain up to ~3); in fp32 both are exact formulas evaluated
# in another order, a few ulp apart at scale; gradients are sums (rms_norm's weight gradient
# over every row), hence the larger fp32 allowance. A wrong fusion (another eps placement,
# swapped halves, a wrong table) is off by O(1) relative: 2^7 bf16 ulps, 2^23 fp32 ulps.
SLACK_ULPS = {torch.float32: 16.0, torch.bfloat16: 4.0, torch.float16: 4.0}
GRAD_SLACK_ULPS = {torch.float32: 64.0, torch.bfloat16: 8.0, torch.float16: 8.0}


@dataclasses.dataclass
class Case:
    seed: int
    family: str
    choices: dict  # the random choices, by name (what KNOWN_GAPS and the figures read)
    source: str  # the module's forward (and helpers), as Python
    kind: str  # positive / limit / negative / either
    expect: dict  # {pass: fused sites} (positive)
    expect_pass: str  # the pass whose near miss a limit / negative leaves
    limit: str = ""  # limit: a regex the near miss must match
    dtype: torch.dtype = torch.float32
    dynamic: bool = False
    training: bool = False
    build: Callable[[], tuple[nn.Module, tuple]] = None  # -> (module, inputs), deterministic
    # ids outputs (router experts): compared exactly with eager, per token as a set
    index_outputs: tuple = ()
    # training: the inputs that need a gradient (None: every float input). RoPE tables and
    # freqs_cis are buffers in every model: no gradient, as the rope pass declares
    grad_inputs: Optional[tuple] = None
    # an "either" case: the passes besides expect_pass that may fuse it (each family's own
    # cases judge whether they should; here the numerics decide)
    allowed: tuple = ()

    @property
    def name(self) -> str:
        return f"{self.family}#{self.seed}"

    def describe(self) -> str:
        mode = ("training" if self.training else "inference") + (", dynamic=True" if self.dynamic else "")
        shapes = self.choices.get("shapes", "")
        lines = [f"case {self.name}: {self.kind} ({', '.join(f'{k}={v}' for k, v in self.choices.items() if k != 'shapes')})",
                 f"  {SHORT[self.dtype]}, {mode}, inputs {shapes}; expects "
                 + (", ".join(f"{p} x{n}" for p, n in self.expect.items()) if self.kind == "positive"
                    else f"{self.expect_pass} {self.kind}" + (f" /{self.limit}/" if self.limit else "")),
                 "  reproduce: make_case(%d) in tests/fuzz_cases.py; the module's source:" % self.seed]
        lines += ["    " + line for line in self.source.strip().splitlines()]
        return "\n".join(lines)


# ---- source building --------------------------------------------------------------------
class FuzzModule(nn.Module):
    """A module whose forward is a case's source (exec'd once per case)."""


def _module_from_source(source: str, filename: str, init: Callable[[nn.Module], None]) -> nn.Module:
    namespace = {"torch": torch, "F": F, "nn": nn, "math": math}
    # linecache: stack traces, the report's source locations and dynamo's messages show the line
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    cls = type(f"Fuzz_{abs(hash(filename)) % 10**8}", (FuzzModule,), {"forward": namespace["forward"]})
    module = cls()
    init(module)
    return module


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _leading(rng, rank, low=1, high=4):
    return [rng.randint(low, high) for _ in range(rank - 1)]


# ---- RMSNorm ------------------------------------------------------------------------------
SQUARES = {"pow": "{h}.pow(2)", "mul": "{h} * {h}", "square": "{h}.square()", "pow_op": "{h} ** 2"}
MEANS = {"mean": "{sq}.mean(-1, keepdim=True)", "mean_kw": "{sq}.mean(dim=-1, keepdim=True)",
         "torch_mean_pos": "torch.mean({sq}, dim={last}, keepdim=True)", "sum_div": "{sq}.sum(-1, keepdim=True) / {D}"}
EPS_ADDS = {"attr": "{ms} + self.eps", "literal": "{ms} + {eps!r}", "radd": "self.eps + {ms}"}
NORMALISE = {"rsqrt": "{h} * torch.rsqrt({v})", "rsqrt_first": "torch.rsqrt({v}) * {h}",
             "method_rsqrt": "{h} * ({v}).rsqrt()", "pow_neg_half": "{h} * ({v}) ** -0.5",
             "torch_pow": "{h} * torch.pow({v}, -0.5)", "div_sqrt": "{h} / torch.sqrt({v})",
             "recip_sqrt": "{h} * (1 / torch.sqrt({v}))"}
WEIGHTS = {"w_first": "self.weight * {n}.to({dt})", "w_last": "{n}.to({dt}) * self.weight",
           "before_cast": "({n} * self.weight).to({dt})", "type_as": "self.weight * {n}.type_as(x)",
           "gemma": "({n} * (1.0 + self.weight.float())).type_as(x)", "none": "{n}.to({dt})"}
# look-alikes: not an RMSNorm over the last dim
RMS_LOOKALIKES = {
    "eps_outside_sqrt": "    return ({h} / (torch.sqrt({h}.pow(2).mean(-1, keepdim=True)) + self.eps)).to(x.dtype)",
    "other_dim": "    return ({h} * torch.rsqrt({h}.pow(2).mean({dim}, keepdim=True) + self.eps)).to(x.dtype)",
    "no_keepdim": "    return ({h} * torch.rsqrt({h}.pow(2).mean(-1) + self.eps)).to(x.dtype)",
    "times_sqrt": "    return ({h} * torch.sqrt({h}.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)",
    "mean_abs": "    return ({h} * torch.rsqrt({h}.abs().mean(-1, keepdim=True) + self.eps)).to(x.dtype)",
    "weight_2d": "    return self.weight2d * ({h} * torch.rsqrt({h}.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)",
    "square_of_other": "    return ({h} * torch.rsqrt((x.float() * 2).pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)",
}


def _rms_norm_body(rng, choices, D, rank, dtype, eps, dynamic):
    """(lines of `def norm(self, x)` computing a positive RMSNorm, kind, limit regex)."""
    style = rng.choices(["hand", "functional", "module"], weights=[6, 2, 2])[0]
    choices["style"] = style
    if style == "functional":
        weight = rng.choice([True, False])
        dims = rng.choice(["literal", "shape"])
        choices.update(weight=weight, dims=dims)
        normalized = f"({D},)" if dims == "literal" else "x.shape[-1:]"
        return [f"    return F.rms_norm(x, {normalized}, {'self.weight' if weight else 'None'}, self.eps)"], "positive", ""
    if style == "module":
        affine = rng.choice([True, False])
        choices["elementwise_affine"] = affine
        return ["    return self.rms(x)"], "positive", ""
    upcast = rng.choice(["float", "to_float32", "none"])
    square, mean, eps_add, normalise = (rng.choice(list(t)) for t in (SQUARES, MEANS, EPS_ADDS, NORMALISE))
    weight = rng.choice(list(WEIGHTS))
    dt = rng.choice(["x.dtype", "dtype"])
    choices.update(upcast=upcast, square=square, mean=mean, eps_add=eps_add, normalise=normalise, weight=weight)
    lines = ["    dtype = x.dtype"]
    h = "h"
    lines.append({"float": "    h = x.float()", "to_float32": "    h = x.to(torch.float32)", "none": "    h = x"}[upcast])
    sq = SQUARES[square].format(h=h)
    ms = MEANS[mean].format(sq=f"({sq})" if " " in sq else sq, last=rank - 1, D=D)
    lines.append(f"    ms = {ms}")
    lines.append(f"    v = {EPS_ADDS[eps_add].format(ms='ms', eps=eps)}")
    lines.append(f"    n = {NORMALISE[normalise].format(h=h, v='v')}")
    lines.append(f"    return {WEIGHTS[weight].format(n='n' if ' ' not in 'n' else '(n)', dt=dt)}")
    if dynamic and mean == "sum_div" and weight == "none":
        # dynamic=True makes the normalised dim symbolic (a weight of D elements would pin it
        # to D), and the code divides by the number D it was written for: the mean only
        # where the two are equal, which nothing proves
        return lines, "limit", r"divides by \d+ where the normalised dim is s\d+"
    return lines, "positive", ""


def _rms_init(module, D, dtype, eps, choices, gen, lead):
    module.eps = eps
    gemma = choices.get("weight") == "gemma"
    w = _randn(gen, D, scale=0.1) if gemma else torch.rand(D, generator=gen) + 0.5
    module.weight = nn.Parameter(w.to(dtype))
    if choices.get("style") == "module":
        module.rms = nn.RMSNorm(D, eps=eps, elementwise_affine=choices["elementwise_affine"], dtype=dtype)
        if choices["elementwise_affine"]:
            with torch.no_grad():
                module.rms.weight.copy_(w)
    if choices.get("lookalike") == "weight_2d":
        module.weight2d = nn.Parameter((torch.rand(lead[-1], D, generator=gen) + 0.5).to(dtype))


def _make_rms(rng, seed, case_kw, add=False):
    dtype, dynamic, training = case_kw["dtype"], case_kw["dynamic"], case_kw["training"]
    D = rng.choice([8, 16, 32, 64])
    rank = rng.choice([1, 2, 3, 4]) if not add else rng.choice([2, 3])
    lead = _leading(rng, rank)
    eps = rng.choice([1e-6, 1e-5, 3.7e-4])
    choices: dict[str, Any] = {}
    lookalike = None
    if not add and rng.random() < 0.3:
        lookalike = rng.choice(list(RMS_LOOKALIKES))
        if lookalike in ("other_dim", "weight_2d") and rank < 2:
            rank, lead = 2, _leading(rng, 2)
        if lookalike == "no_keepdim":  # (D, D): the mean broadcasts, over the wrong axis
            rank, lead = 2, [D]
        if lookalike == "weight_2d":
            lead[-1] = max(lead[-1], 2)
        choices["lookalike"] = lookalike
        dim = rng.choice([0, -2]) if rank >= 2 else 0
        h = rng.choice(["x.float()", "x"])
        body = [RMS_LOOKALIKES[lookalike].format(h=f"({h})" if h == "x.float()" else h, dim=dim)]
        kind, limit = "negative", ""
    else:
        body, kind, limit = _rms_norm_body(rng, choices, D, rank, dtype, eps, dynamic)
    sites = 1 if add else rng.choice([1, 1, 2])
    shape = lead + [D]
    choices["rank"] = rank
    choices["sites"] = sites
    choices["shapes"] = f"{shape}" + (f" x{sites}" if sites > 1 else "")
    source = ["def norm(self, x):", *body, "", ""]
    if add:
        spelling = rng.choice(["x + residual", "residual + x", "torch.add(x, residual)"])
        alpha = rng.random() < 0.15
        if alpha:  # the norm is still one (rms_norm fuses it), the add is not a residual add
            spelling = "torch.add(x, residual, alpha=2)"
            kind = "negative" if kind == "positive" else kind  # (a norm's limit stays the outcome)
            choices["lookalike"] = "alpha"
        # (a scaled add's chain would add a real residual add after it: not a look-alike)
        returns = rng.choice(["both", "norm_only"] if alpha else ["both", "norm_only", "chain"])
        choices.update(add=spelling, returns=returns)
        source += ["def forward(self, x, residual):", f"    h = {spelling}", "    y = norm(self, h)"]
        if returns == "both":
            source.append("    return y, h")
        elif returns == "norm_only":
            source.append("    return y")
        else:  # the next layer's residual add and norm: two sites
            source += ["    h2 = h + y * 0.5", "    return norm(self, h2), h2"]
            sites = 2
        n_inputs = 2
    else:
        if sites == 2:
            source += ["def forward(self, x, y):", "    return norm(self, x), norm(self, y)"]
        else:
            source += ["def forward(self, x):", "    return norm(self, x)"]
        n_inputs = sites
    expect = {"rms_norm": sites} if not add else {"rms_norm": sites, "add_rms_norm": sites}
    if add and kind == "negative":
        expect = {"rms_norm": sites}
    if choices.get("lookalike") == "weight_2d":  # the weightless norm inside it is a norm
        kind = "either"
    scale = rng.choice([3.0, 1e-2])  # small activations make eps matter
    choices["scale"] = scale

    def build():
        gen = torch.Generator().manual_seed(seed)
        inputs = tuple(_randn(gen, *shape, scale=scale).to(dtype) for _ in range(n_inputs))

        def init(module):
            _rms_init(module, D, dtype, eps, choices, gen, lead)
        return _module_from_source("\n".join(source), f"<fuzz {seed}>", init), inputs

    if kind == "limit":  # the norm's own limit: nothing fuses, rms_norm says why
        expect, expect_pass = {}, "rms_norm"
    else:
        expect = expect if kind == "positive" or add else {}
        expect_pass = "add_rms_norm" if add else "rms_norm"
    return Case(seed, "add_rms_norm" if add else "rms_norm", choices, "\n".join(source), kind,
                expect, expect_pass, limit, dtype, dynamic, training, build)


# ---- RoPE ---------------------------------------------------------------------------------
ROTATIONS = {
    "sliced": ["def rotate(x):", "    half = x.shape[-1] // 2", "    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)"],
    "chunked": ["def rotate(x):", "    x1, x2 = x.chunk(2, dim=-1)", "    return torch.cat((-x2, x1), dim=-1)"],
    "split": ["def rotate(x):", "    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)", "    return torch.cat([-x2, x1], -1)"],
    "every_two": ["def rotate(x):", "    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)"],
    "every_two_reshape": ["def rotate(x):", "    x1 = x[..., ::2]", "    x2 = x[..., 1::2]",
                          "    return torch.stack((-x2, x1), dim=-1).reshape(x.shape)"],
}
ROPE_LOOKALIKES = {  # not a rotation by +theta of the pairs the tables hold (no_negation: see _make_rope)
    "both_second_half": ["def rotate(x):", "    half = x.shape[-1] // 2",
                         "    return torch.cat((-x[..., half:], x[..., half:]), dim=-1)"],
    "no_negation": ["def rotate(x):", "    x1, x2 = x.chunk(2, dim=-1)", "    return torch.cat((x2, x1), dim=-1)"],
    "every_two_wrong_pair": ["def rotate(x):",
                             "    return torch.stack((-x[..., ::2], x[..., 1::2]), dim=-1).flatten(-2)"],
    "halves_swapped_in_cat": ["def rotate(x):", "    x1, x2 = x.chunk(2, dim=-1)", "    return torch.cat((x1, -x2), dim=-1)"],
}
TERMS = {"x_cos_first": "{x} * cos + rotate({x}) * sin", "cos_x": "cos * {x} + sin * rotate({x})",
         "sin_term_first": "rotate({x}) * sin + {x} * cos", "parenthesised": "({x} * cos) + (rotate({x}) * sin)"}


def _tables(gen, positions, dim, interleaved, batch=None):
    """cos, sin (.., S, D) of angles pos * inv_freq: halves repeated (rotate_half) or pairs (every-two)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    pos = positions.double()
    freqs = pos[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def _make_rope(rng, seed, case_kw):
    dtype, dynamic, training = case_kw["dtype"], case_kw["dynamic"], case_kw["training"]
    B, N, S = rng.randint(1, 3), rng.choice([1, 2, 4]), rng.choice([3, 4, 5, 8])
    D = rng.choice([8, 16, 32, 64])
    if rng.random() < 0.2:
        S = N = rng.choice([2, 4])  # equal sizes: a layout must not be guessed from them
    layout = rng.choice(["BNSD", "BSND"])
    choices: dict[str, Any] = {"layout": layout}
    lookalike = None
    if rng.random() < 0.25:
        lookalike = rng.choice(list(ROPE_LOOKALIKES) + ["cos_sin_swapped", "minus_sin"])
        choices["lookalike"] = lookalike
    rotation = rng.choice(list(ROTATIONS))
    if lookalike in ROPE_LOOKALIKES:
        rotation = lookalike
    interleaved = rotation.startswith("every_two")
    choices["rotation"] = rotation
    table = rng.choice(["per_batch", "shared", "shared_2d"])
    choices["table"] = table
    terms = rng.choice(list(TERMS))
    choices["terms"] = terms
    both = rng.random() < 0.6
    kv_heads = rng.choice([1, N]) if both else N
    choices["sites"] = 2 if both else 1
    # fp32 tables with a narrower x: the code computes in fp32, and so does the fusion
    # (x cast up, one npu_rotary_mul in fp32): a positive
    tables_fp32 = dtype != torch.float32 and rng.random() < 0.15
    choices["tables_fp32"] = tables_fp32
    unsqueeze = {("BNSD", "per_batch"): "cos = cos.unsqueeze(1)\n    sin = sin.unsqueeze(1)",
                 ("BSND", "per_batch"): "cos = cos.unsqueeze(2)\n    sin = sin.unsqueeze(2)",
                 ("BNSD", "shared"): "cos = cos[None, None]\n    sin = sin[None, None]",
                 ("BSND", "shared"): "cos = cos.unsqueeze(1)\n    sin = sin.unsqueeze(1)",
                 ("BNSD", "shared_2d"): "", ("BSND", "shared_2d"): None}[(layout, table)]
    if unsqueeze is None:  # (S, D) tables broadcast over BSND only as (S, 1, D)
        unsqueeze = "cos = cos[:, None]\n    sin = sin[:, None]"
    term = TERMS[terms]
    if lookalike == "cos_sin_swapped":  # x * sin + rotate(x) * cos: the op with the tables' roles swapped
        term = term.replace("cos", "@").replace("sin", "cos").replace("@", "sin")
    if lookalike == "minus_sin":
        term = "{x} * cos - rotate({x}) * sin"
    rotate_src = ROTATIONS.get(rotation) or ROPE_LOOKALIKES[rotation]
    source = [*rotate_src, "", "",
              "def forward(self, q, k, cos, sin):" if both else "def forward(self, q, cos, sin):",
              "    " + unsqueeze if unsqueeze else "    # cos, sin: (S, D), broadcast as they are",
              f"    q_embed = {term.format(x='q')}"]
    if both:
        source += [f"    k_embed = {term.format(x='k')}", "    return q_embed, k_embed"]
    else:
        source.append("    return q_embed")
    source = "\n".join(source).replace("\n    cos = cos", "\n    cos = cos")
    if layout == "BNSD":
        q_shape, k_shape = (B, N, S, D), (B, kv_heads, S, D)
    else:
        q_shape, k_shape = (B, S, N, D), (B, S, kv_heads, D)
    table_shape = (B, S, D) if table == "per_batch" else (S, D)
    choices["shapes"] = f"q {list(q_shape)}" + (f" k {list(k_shape)}" if both else "") + f" cos {list(table_shape)}"
    kind, limit, expect = "positive", "", {"rope": 2 if both else 1}
    if lookalike in ROPE_LOOKALIKES and lookalike != "no_negation":
        kind = "negative"
    elif lookalike in ("cos_sin_swapped", "minus_sin", "no_negation"):
        # each is npu_rotary_mul's formula with other tables (roles swapped, sin negated, or
        # sin negated on the first half of the channels: code that bakes rotate_half's sign
        # into its sin table writes exactly this), so fusing it is exact: fused or not, both right
        kind = "either"
    elif dynamic and rotation == "chunked":
        # dynamic=True on q makes its head dim s symbolic: chunk splits it at (s + 1) // 2,
        # the half only for an even s, which nothing in these graphs proves
        kind, limit = "limit", r"x is split at .+, not provably the half of its head dim"

    def build():
        gen = torch.Generator().manual_seed(seed)
        positions = (torch.arange(S)[None] + torch.randint(0, 7, (B, 1), generator=gen)) if table == "per_batch" \
            else torch.arange(S)
        cos, sin = _tables(gen, positions, D, interleaved)
        if not tables_fp32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        q = _randn(gen, *q_shape).to(dtype)
        inputs = (q, _randn(gen, *k_shape).to(dtype), cos, sin) if both else (q, cos, sin)
        return _module_from_source(source, f"<fuzz {seed}>", lambda m: None), inputs

    return Case(seed, "rope", choices, source, kind, expect if kind == "positive" else {}, "rope", limit,
                dtype, dynamic, training, build, grad_inputs=(0, 1) if both else (0,))


def _make_rope_complex(rng, seed, case_kw):
    """torchtitan / Meta Llama apply_rotary_emb: complex pairs times freqs_cis."""
    dtype, dynamic, training = case_kw["dtype"], case_kw["dynamic"], case_kw["training"]
    B, N, S, D = rng.randint(1, 3), rng.choice([1, 2, 4]), rng.choice([3, 4, 5]), rng.choice([8, 16, 32])
    if rng.random() < 0.25:
        S = N = rng.choice([2, 4])
    layout = rng.choice(["BSND", "BNSD"])
    view = rng.choice(["reshape", "view"])
    order = rng.choice(["pairs_freqs", "freqs_pairs"])
    flatten = rng.choice(["flatten(3)", "flatten(-2)"])
    back = rng.choice(["type_as", "to_dtype"])
    both = rng.random() < 0.6
    lookalike = "conj" if rng.random() < 0.15 else None
    choices = {"layout": layout, "view": view, "order": order, "flatten": flatten, "back": back,
               "sites": 2 if both else 1}
    if lookalike:
        choices["lookalike"] = lookalike
    freqs_view = "freqs_cis.view(1, x.shape[1], 1, -1)" if layout == "BSND" else "freqs_cis.view(1, 1, x.shape[2], -1)"
    pairs = f"torch.view_as_complex(x.float().{view}(*x.shape[:-1], -1, 2))"
    product = "pairs * freqs" if order == "pairs_freqs" else "freqs * pairs"
    if lookalike:
        product = "pairs * freqs.conj()"
    back_src = "out.type_as(x)" if back == "type_as" else "out.to(x.dtype)"
    source = ["def rotary(x, freqs_cis):", f"    pairs = {pairs}", f"    freqs = {freqs_view}",
              f"    out = torch.view_as_real({product}).{flatten}", f"    return {back_src}", "", ""]
    if both:
        source += ["def forward(self, xq, xk, freqs_cis):", "    return rotary(xq, freqs_cis), rotary(xk, freqs_cis)"]
    else:
        source += ["def forward(self, xq, freqs_cis):", "    return rotary(xq, freqs_cis)"]
    source = "\n".join(source)
    shape = (B, S, N, D) if layout == "BSND" else (B, N, S, D)
    choices["shapes"] = f"x {list(shape)} freqs_cis [{S}, {D // 2}] complex64"
    kind = "either" if lookalike else "positive"

    def build():
        gen = torch.Generator().manual_seed(seed)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        angles = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq
        freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
        xs = [_randn(gen, *shape).to(dtype) for _ in range(2 if both else 1)]
        return _module_from_source(source, f"<fuzz {seed}>", lambda m: None), (*xs, freqs_cis)

    return Case(seed, "rope_complex", choices, source, kind, {"rope": 2 if both else 1} if kind == "positive" else {},
                "rope", "", dtype, dynamic, training, build, grad_inputs=(0, 1) if both else (0,))


# ---- SwiGLU -------------------------------------------------------------------------------
HALVES = {
    "chunk": "    gate, up = gu.chunk(2, dim=-1)",
    "torch_chunk": "    gate, up = torch.chunk(gu, 2, -1)",
    "split": "    gate, up = gu.split(gu.shape[-1] // 2, dim=-1)",
    "split_sizes": "    gate, up = torch.split(gu, [{H}, {H}], dim=-1)",
    "slice": "    gate, up = gu[..., :{H}], gu[..., {H}:]",
    "slice_shape": "    half = gu.shape[-1] // 2\n    gate, up = gu[..., :half], gu[..., half:]",
    "narrow": "    gate, up = gu.narrow(-1, 0, {H}), gu.narrow(-1, {H}, {H})",
}
ACTS = {"F.silu": "F.silu(gate)", "silu_method": "torch.nn.functional.silu(gate)",
        "g_sigmoid": "gate * torch.sigmoid(gate)", "sigmoid_g": "torch.sigmoid(gate) * gate",
        "g_method_sigmoid": "gate * gate.sigmoid()"}
SWIGLU_LOOKALIKES = {
    "silu_on_up": "F.silu(up) * gate",
    "sigmoid_glu": "torch.sigmoid(gate) * up",
    "gelu": "F.gelu(gate) * up",
    "sigmoid_of_up": "gate * torch.sigmoid(up) * up",
    "silu_times_gate": "F.silu(gate) * gate",
    "silu_plus_up": "F.silu(gate) + up",
}


def _make_swiglu(rng, seed, case_kw):
    dtype, dynamic, training = case_kw["dtype"], case_kw["dynamic"], case_kw["training"]
    H = rng.choice([4, 8, 16, 32])
    rank = rng.choice([2, 3, 4])
    lead = _leading(rng, rank)
    D = rng.choice([8, 16])
    source_of = rng.choice(["projection", "input"])
    halves = rng.choice(list(HALVES))
    act = rng.choice(list(ACTS))
    order = rng.choice(["act_up", "up_act"])
    choices = {"source": source_of, "halves": halves, "act": act, "order": order}
    lookalike = None
    if rng.random() < 0.25:
        lookalike = rng.choice(list(SWIGLU_LOOKALIKES) + ["separate_projections"])
        choices["lookalike"] = lookalike
    if lookalike == "separate_projections":
        source = ["def forward(self, x):", "    gate = self.gate(x)", "    up = self.up(x)",
                  f"    return {ACTS[act]} * up"]
        source_of = "projection"
    else:
        product = f"({ACTS[act]}) * up" if order == "act_up" else f"up * ({ACTS[act]})"
        if lookalike:
            product = SWIGLU_LOOKALIKES[lookalike]
        source = ["def forward(self, x):", "    gu = self.gate_up(x)" if source_of == "projection" else "    gu = x",
                  HALVES[halves].format(H=H), f"    return {product}"]
    source = "\n".join(source)
    in_shape = lead + [D if source_of == "projection" else 2 * H]
    choices["shapes"] = f"{in_shape}" + (f" -> gate_up [{2 * H}]" if source_of == "projection" else "")
    # gate and up from two linears of one input are a SwiGLU once merged_projections has merged
    # them (the backend does, in inference and in training): a positive, not a look-alike
    kind, limit = ("negative" if lookalike and lookalike != "separate_projections" else "positive"), ""
    if kind == "positive" and dynamic and source_of == "input" and halves in ("chunk", "torch_chunk", "narrow"):
        # dynamic=True on the gate_up tensor makes its width s symbolic: chunk splits it at
        # (s + 1) // 2, npu_swiglu's half only for an even s, which nothing here proves; narrow
        # at the literal H it was written with, the half only for s == 2H (a literal slice
        # gu[..., :H] * gu[..., H:] makes dynamo pin s, a split into [H, H] too: those fuse)
        kind, limit = "limit", r"the gate_up dim \S+ is split at .+, not provably its half"

    def build():
        gen = torch.Generator().manual_seed(seed)

        def init(module):
            if lookalike == "separate_projections":
                module.gate = nn.Linear(D, H, bias=False).to(dtype)
                module.up = nn.Linear(D, H, bias=False).to(dtype)
            elif source_of == "projection":
                module.gate_up = nn.Linear(D, 2 * H, bias=False).to(dtype)
            with torch.no_grad():
                for p in module.parameters():
                    p.copy_(_randn(gen, *p.shape, scale=D ** -0.5))
        x = _randn(gen, *in_shape, scale=2.0).to(dtype)
        torch.manual_seed(seed)
        return _module_from_source(source, f"<fuzz {seed}>", init), (x,)

    return Case(seed, "swiglu", choices, source, kind, {"swiglu": 1} if kind == "positive" else {}, "swiglu", limit,
                dtype, dynamic, training, build)


# ---- routers --------------------------------------------------------------------------------
def _make_router(rng, seed, case_kw):
    dtype, dynamic, training = case_kw["dtype"], case_kw["dynamic"], case_kw["training"]
    T, E = rng.choice([3, 5, 8, 12]), rng.choice([4, 8, 16])
    k = rng.randint(1, min(4, E))
    from_gate = rng.random() < 0.5
    D = 8
    score = rng.choice(["softmax", "softmax", "softmax_dtype", "sigmoid"])
    dim = rng.choice(["-1", "1"])
    topk_dim = rng.choice(["-1", "1"])
    sorted_ = rng.choice([True, True, False])
    renorm = rng.choice([True, False])
    one_hot = rng.random() < 0.2
    choices = {"score": score, "softmax_dim": dim, "topk_dim": topk_dim, "sorted": sorted_, "renorm": renorm,
               "gate": from_gate, "one_hot": one_hot}
    lookalike = None
    if rng.random() < 0.25:
        lookalike = rng.choice(["smallest_k", "softmax_dim0", "log_softmax", "topk_of_logits", "argmax_one_hot"])
        choices["lookalike"] = lookalike
    lines = ["def forward(self, x):"]
    lines.append("    logits = self.gate(x)" if from_gate else "    logits = x")
    scores = {"softmax": f"torch.softmax(logits, dim={dim})",
              "softmax_dtype": f"F.softmax(logits, dim={dim}, dtype=torch.float)",
              "sigmoid": "torch.sigmoid(logits)"}[score]
    if lookalike == "softmax_dim0":
        scores = "torch.softmax(logits, dim=0)"
    if lookalike == "log_softmax":
        scores = f"torch.log_softmax(logits, dim={dim})"
    index_outputs: tuple = ()
    if lookalike == "argmax_one_hot":
        lines += [f"    probs = {scores}", f"    return F.one_hot(logits.argmax(-1), {E}), probs"]
        index_outputs = (0,)
    else:
        lines.append(f"    probs = {scores}")
        largest = ", largest=False" if lookalike == "smallest_k" else ""
        if lookalike == "topk_of_logits":  # softmax is monotonic: the same experts
            # (drawn last: the cases drawn before keep their seeds' spellings)
            gather = rng.choice([f"probs.gather({topk_dim}, ids)", f"torch.take_along_dim(probs, ids, dim={topk_dim})"])
            choices["gather"] = gather.split("(")[0]
            lines += [f"    ids = torch.topk(logits, {k}, dim={topk_dim}{largest}, sorted={sorted_})[1]",
                      f"    weights = {gather}"]
        else:
            lines.append(f"    weights, ids = torch.topk(probs, {k}, dim={topk_dim}{largest}, sorted={sorted_})")
        if renorm:
            lines.append("    weights = weights / weights.sum(dim=-1, keepdim=True)")
        if sorted_:
            returns = "weights.to(x.dtype), ids"
            index_outputs = (1,)
            if one_hot:
                lines.append(f"    expert_mask = F.one_hot(ids, num_classes={E}).permute(2, 1, 0)")
                returns += ", expert_mask"
                index_outputs = (1, 2)
        else:  # uses indifferent to the order of the k experts: a routing map and per-token sums
            lines.append(f"    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)")
            returns = "routing_map, weights.sum(dim=-1, keepdim=True).to(x.dtype)"
            index_outputs = (0,)
        lines.append(f"    return {returns}")
    source = "\n".join(lines)
    choices["shapes"] = f"[{T}, {D if from_gate else E}]" + (f" -> logits [{T}, {E}]" if from_gate else "")
    kind, limit = "positive", ""
    if lookalike in ("smallest_k", "softmax_dim0", "log_softmax"):
        kind = "negative"
    elif lookalike in ("topk_of_logits", "argmax_one_hot"):
        kind = "either"
    elif score == "sigmoid" and dynamic and not from_gate:  # the logits are the input: E is symbolic,
        # the first check that fails (renormalised or not: seeds 543, 662, 767)
        kind, limit = "limit", r"symbolic expert count"
    elif score == "sigmoid" and not renorm:
        kind, limit = "limit", r"sigmoid router without renormalisation"
    elif score == "sigmoid" and training:  # the joint graph's forms: the scores' own gradient
        kind, limit = "limit", r"gradient"
    elif score == "sigmoid" and dtype != torch.float32:
        kind, limit = "limit", r"scores over .* logits"
    elif score == "sigmoid":
        pass  # npu_moe_gating_top_k's sigmoid mode, renormalised (in training: the partitioned forward)
    elif training:
        kind, limit = "limit", r"softmax router in training"
    elif dtype != torch.float32 and score != "softmax_dtype":
        kind, limit = "limit", r"softmax over .* logits"

    def build():
        gen = torch.Generator().manual_seed(seed)

        def init(module):
            if from_gate:
                module.gate = nn.Linear(D, E, bias=False).to(dtype)
                with torch.no_grad():
                    module.gate.weight.copy_(_randn(gen, E, D))
        x = _randn(gen, T, D if from_gate else E, scale=2.0).to(dtype)
        return _module_from_source(source, f"<fuzz {seed}>", init), (x,)

    return Case(seed, "router", choices, source, kind, {"moe_gating": 1} if kind == "positive" else {},
                "moe_gating", limit, dtype, dynamic, training, build, index_outputs)


def _make_library(rng, seed, case_kw):
    """Model code of other codebases (tests/fuzz_library.py; not in FAMILIES' rotation)."""
    import fuzz_library

    return fuzz_library.make(rng, seed, case_kw)



# ---- a decoder block around SDPA ------------------------------------------------------------
def _make_attention_block(rng, seed, case_kw):
    """HF-style pre-norm block: RMSNorm, q / k / v projections viewed (B, S, N, D) and transposed
    to BNSD (non-contiguous, as decoder code makes them), half-split RoPE, causal SDPA (GQA by
    enable_gqa or repeat_kv), o projection and residual, RMSNorm, SwiGLU MLP (separate or fused
    gate / up) and residual. Mostly training: the backward through the emulated SDPA (issue 29)."""
    dtype, dynamic = case_kw["dtype"], case_kw["dynamic"] and rng.random() < 0.5
    training = rng.random() < 0.8
    B, S, NH, D = rng.choice([1, 2]), rng.choice([4, 6]), 4, rng.choice([8, 16])
    KV = rng.choice([4, 2, 1])
    H, I = rng.choice([16, 32]), rng.choice([16, 32])
    gqa = rng.choice(["enable_gqa", "repeat_kv"]) if KV < NH else "none"
    mlp = rng.choice(["separate", "fused"])
    choices = {"gqa": gqa, "mlp": mlp, "kv_heads": KV,
               "shapes": f"x [{B}, {S}, {H}], q / k / v [{B}, {NH} / {KV}, {S}, {D}], cos [{B}, {S}, {D}]"}
    kv = "k, v"
    if gqa == "repeat_kv":
        kv = (f"k[:, :, None].expand(B, {KV}, {NH // KV}, S, {D}).reshape(B, {NH}, S, {D}), "
              f"v[:, :, None].expand(B, {KV}, {NH // KV}, S, {D}).reshape(B, {NH}, S, {D})")
    mlp_src = (["    m = self.down(F.silu(self.gate(h)) * self.up(h))"] if mlp == "separate" else
               ["    g, u = self.gate_up(h).chunk(2, dim=-1)", "    m = self.down(F.silu(g) * u)"])
    source = "\n".join([
        "def rotate_half(x):", "    x1, x2 = x.chunk(2, dim=-1)", "    return torch.cat((-x2, x1), dim=-1)", "", "",
        "def norm(x, weight):", "    h = x.float()", "    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)",
        "    return weight * h.to(x.dtype)", "", "",
        "def forward(self, x, cos, sin):",
        "    B, S, _ = x.shape",
        "    h = norm(x, self.norm1)",
        f"    q = self.q(h).view(B, S, {NH}, {D}).transpose(1, 2)",
        f"    k = self.k(h).view(B, S, {KV}, {D}).transpose(1, 2)",
        f"    v = self.v(h).view(B, S, {KV}, {D}).transpose(1, 2)",
        "    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)",
        "    q = q * cos + rotate_half(q) * sin",
        "    k = k * cos + rotate_half(k) * sin",
        f"    k, v = {kv}",
        "    a = F.scaled_dot_product_attention(q, k, v, is_causal=True"
        + (", enable_gqa=True)" if gqa == "enable_gqa" else ")"),
        f"    x = x + self.o(a.transpose(1, 2).reshape(B, S, {NH * D}))",
        "    h = norm(x, self.norm2)",
        *mlp_src,
        "    return x + m",
    ])

    def build():
        gen = torch.Generator().manual_seed(seed)

        def linear(fan_in, fan_out):
            layer = nn.Linear(fan_in, fan_out, bias=False, dtype=dtype)
            with torch.no_grad():
                layer.weight.copy_(_randn(gen, fan_out, fan_in, scale=fan_in ** -0.5))
            return layer

        def init(module):
            module.norm1 = nn.Parameter((torch.rand(H, generator=gen) + 0.5).to(dtype))
            module.norm2 = nn.Parameter((torch.rand(H, generator=gen) + 0.5).to(dtype))
            module.q, module.k, module.v = linear(H, NH * D), linear(H, KV * D), linear(H, KV * D)
            module.o = linear(NH * D, H)
            if mlp == "separate":
                module.gate, module.up = linear(H, I), linear(H, I)
            else:
                module.gate_up = linear(H, 2 * I)
            module.down = linear(I, H)

        module = _module_from_source(source, f"<fuzz {seed}>", init)
        positions = torch.arange(S)[None] + torch.randint(0, 7, (B, 1), generator=gen)
        cos, sin = _tables(gen, positions, D, interleaved=False)
        return module, (_randn(gen, B, S, H).to(dtype), cos.to(dtype), sin.to(dtype))

    return Case(seed, "attention_block", choices, source, "either", {}, "rope", "", dtype, dynamic, training, build,
                grad_inputs=(0,), allowed=("rms_norm", "add_rms_norm", "swiglu", "attention"))


# ---- the hyper-connection residual mix (mhc_post) ----------------------------------------------
# Y[k] = post[k] * o + sum_j comb[j, k] * X[j], X (B, S, n, D), o (B, S, D), post (B, S, n),
# comb (B, S, n, n) fp32 (mhc_pre's outputs). `comb` is read [j, k] unless the spelling says
# it stores comb [k, j] (then the module's comb input is that one, and its mix reads it so).
MIXES = {
    "matmul_t": "torch.matmul({c}.transpose(-1, -2), {x})",
    "matmul_kj": "torch.matmul({c}, {x})",  # comb stored [k, j]
    "sum_product": "torch.sum({c}.unsqueeze(-1) * {x}.unsqueeze(-2), dim=2)",
    "sum_product_neg_dim": "({c}[..., None] * {x}[..., None, :]).sum(-3)",
    "einsum": 'torch.einsum("bsjk,bsjd->bskd", {c}, {x})',
    "einsum_kj": 'torch.einsum("bskj,bsjd->bskd", {c}, {x})',  # comb stored [k, j]
    "bmm_tokens": "torch.bmm({c}.reshape(-1, {n}, {n}).transpose(1, 2), {x}.reshape(-1, {n}, {D})).view(B, S, {n}, {D})",
}
OUTER = {"unsqueeze": "{p}.unsqueeze(-1) * {o}.unsqueeze(-2)", "index": "{p}[..., None] * {o}[..., None, :]",
         "einsum": 'torch.einsum("bsk,bsd->bskd", {p}, {o})'}
# how the model rounds: the mix in fp32 (post and comb are) and cast once to x's dtype, as
# torchtitan-npu's HcPost does; or post and comb cast to x's dtype first, as transformers does
ROUNDING = {"fp32_once": ("{t}", "({e}).to(x.dtype)"), "in_dtype": ("{t}.to(x.dtype)", "{e}")}
MIX_LOOKALIKES = {
    # summed over comb's other index: each stream scaled by a row sum, no mix of streams
    "other_index": "torch.sum({c}.unsqueeze(-1) * {x}.unsqueeze(-2), dim=3)",
    # the streams themselves times post: no one block output broadcast over the streams
    "per_stream_output": None,
    "difference": None,  # post * o - the mix
}


def _make_mhc_post(rng, seed, case_kw):
    dtype, dynamic, training = case_kw["dtype"], case_kw["dynamic"], case_kw["training"]
    B, S, n, D = rng.choice([1, 2]), rng.choice([3, 5]), rng.choice([4, 6, 8]), rng.choice([8, 16, 32])
    mix, outer, rounding = rng.choice(sorted(MIXES)), rng.choice(sorted(OUTER)), rng.choice(sorted(ROUNDING))
    order = rng.choice(["outer_first", "mix_first"])
    choices = {"mix": mix, "outer": outer, "rounding": rounding, "order": order,
               "shapes": f"x [{B}, {S}, {n}, {D}], o [{B}, {S}, {D}]"}
    lookalike = rng.choice(sorted(MIX_LOOKALIKES)) if rng.random() < 0.25 else None
    if lookalike:
        choices["lookalike"] = lookalike
    weight, result = ROUNDING[rounding]
    c, p = weight.format(t="comb"), weight.format(t="post")
    # matmul, bmm and einsum do not promote: an fp32 mix of half-dtype streams casts them
    contracts = rounding == "fp32_once" and not mix.startswith("sum_product")
    mixed = (MIX_LOOKALIKES[lookalike] if lookalike == "other_index" else MIXES[mix]).format(
        c=c, x="x.float()" if contracts else "x", n=n, D=D)
    product = OUTER[outer].format(p=p, o="o.float()" if rounding == "fp32_once" and outer == "einsum" else "o")
    if lookalike == "per_stream_output":
        product = f"{p}.unsqueeze(-1) * x.flip(2)"
    sign = " - " if lookalike == "difference" else " + "
    terms = f"{product}{sign}{mixed}" if order == "outer_first" or lookalike == "difference" else f"{mixed} + {product}"
    source = "\n".join(["def forward(self, x, o, post, comb):", "    B, S = x.shape[0], x.shape[1]",
                        "    return " + result.format(e=terms)])
    kind = "negative" if lookalike else "positive"

    def build():
        gen = torch.Generator().manual_seed(seed)
        x, o = _randn(gen, B, S, n, D).to(dtype), _randn(gen, B, S, D).to(dtype)
        post = 2 * torch.rand(B, S, n, generator=gen)
        comb = torch.softmax(_randn(gen, B, S, n, n), -1)
        return _module_from_source(source, f"<fuzz {seed}>", lambda module: None), (x, o, post, comb)

    return Case(seed, "mhc_post", choices, source, kind, {"mhc_post": 1} if kind == "positive" else {}, "mhc_post",
                "", dtype, dynamic, training, build)


# ---- the hyper-connection mappings (mhc_pre) -----------------------------------------------------
# transformers' DeepseekV4HyperConnection in other spellings: where the rms scales (the streams
# before the projection, or the projection after it), how base and scale are cut (split /
# unbind, slices / indexing), how the streams are flattened and collapsed, the Sinkhorn length.
# In inference every spelling fuses (the form, or identified on random inputs); in training only
# the form (transformers' spelling, 20 iterations) does, the rest are near misses saying so.
PRE_NORM = {
    "before": ["    h = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + {norm_eps})",
               "    mixes = F.linear(h, self.fn)"],
    "after": ["    mixes = F.linear(flat, self.fn) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + {norm_eps})"],
}
PRE_CUTS = {
    "split": ["    pre_w, post_w, comb_w = mixes.split([{n}, {n}, {n} * {n}], dim=-1)",
              "    pre_b, post_b, comb_b = self.base.split([{n}, {n}, {n} * {n}])",
              "    pre_s, post_s, comb_s = self.scale.unbind(0)"],
    "slices": ["    pre_w, post_w, comb_w = mixes[..., :{n}], mixes[..., {n}:2 * {n}], mixes[..., 2 * {n}:]",
               "    pre_b, post_b, comb_b = self.base[:{n}], self.base[{n}:2 * {n}], self.base[2 * {n}:]",
               "    pre_s, post_s, comb_s = self.scale[0], self.scale[1], self.scale[2]"],
}
FLATTEN = {"view": "x.view(x.shape[0], x.shape[1], -1).float()", "flatten": "x.flatten(2).float()"}
COLLAPSE = {"streams": "(pre.unsqueeze(-1) * x).sum(dim=2)",
            "flat_view": "torch.sum(pre.unsqueeze(-1) * flat.view(x.shape), dim=2)"}
PRE_LOOKALIKES = {  # each changes the function
    "post_without_2": ("    post = 2 * torch.sigmoid(", "    post = torch.sigmoid("),
    "collapse_by_post": ("pre.unsqueeze(-1)", "post.unsqueeze(-1)"),
    "pre_eps_twice": ("+ {hc_eps}\n    post", "+ 2 * {hc_eps}\n    post"),
    "rows_first": ("comb = comb / (comb.sum(-2, keepdim=True) + {hc_eps})\n    for",
                   "comb = comb / (comb.sum(-1, keepdim=True) + {hc_eps})\n    for"),
}


def _make_mhc_pre(rng, seed, case_kw):
    dtype, dynamic, training = rng.choice([torch.float32, torch.bfloat16]), case_kw["dynamic"], case_kw["training"]
    B, S, n, D = rng.choice([1, 2]), rng.choice([3, 5]), 4, rng.choice([16, 32, 64])
    norm, cuts, flatten, collapse = (rng.choice(sorted(PRE_NORM)), rng.choice(sorted(PRE_CUTS)),
                                     rng.choice(sorted(FLATTEN)), rng.choice(sorted(COLLAPSE)))
    iterations = rng.choice([20, 20, 7, 3])
    norm_eps, hc_eps = rng.choice([1e-6, 2.0 ** -10]), rng.choice([1e-6, 2.0 ** -12])
    choices = {"norm": norm, "cuts": cuts, "flatten": flatten, "collapse": collapse, "iterations": iterations,
               "shapes": f"x [{B}, {S}, {n}, {D}]"}
    lookalike = rng.choice(sorted(PRE_LOOKALIKES)) if rng.random() < 0.25 else None
    if lookalike:
        choices["lookalike"] = lookalike
    lines = ["def forward(self, x):", f"    flat = {FLATTEN[flatten]}",
             *[line.format(norm_eps=norm_eps) for line in PRE_NORM[norm]],
             *[line.format(n=n) for line in PRE_CUTS[cuts]],
             f"    comb_w = comb_w.view(*comb_w.shape[:-1], {n}, {n})",
             f"    pre = torch.sigmoid(pre_w * pre_s + pre_b) + {hc_eps}",
             "    post = 2 * torch.sigmoid(post_w * post_s + post_b)",
             f"    comb = torch.softmax(comb_w * comb_s + comb_b.view({n}, {n}), dim=-1) + {hc_eps}",
             f"    comb = comb / (comb.sum(-2, keepdim=True) + {hc_eps})",
             f"    for _ in range({iterations - 1}):",
             f"        comb = comb / (comb.sum(-1, keepdim=True) + {hc_eps})",
             f"        comb = comb / (comb.sum(-2, keepdim=True) + {hc_eps})",
             f"    return post, comb, {COLLAPSE[collapse]}.to(x.dtype)"]
    source = "\n".join(lines)
    if lookalike:
        old, new = (part.format(hc_eps=hc_eps) for part in PRE_LOOKALIKES[lookalike])
        assert old in source, (lookalike, old)
        source = source.replace(old, new, 1)
    # in training only the form fuses, and which respellings of it still match the form is the
    # form's business: a training case is judged by its outputs and gradients ("either")
    kind = "negative" if lookalike else "either" if training else "positive"

    def build():
        gen = torch.Generator().manual_seed(seed)
        width = (2 + n) * n

        def init(module):
            module.fn = nn.Parameter(_randn(gen, width, n * D, scale=(n * D) ** -0.5))
            module.base = nn.Parameter(_randn(gen, width, scale=0.1))
            module.scale = nn.Parameter(torch.rand(3, generator=gen) + 0.5)

        return _module_from_source(source, f"<fuzz {seed}>", init), (_randn(gen, B, S, n, D).to(dtype),)

    # the unweighted RMSNorm of the streams is an rms_norm site of its own where mhc_pre does not
    # take the region (training, a look-alike)
    return Case(seed, "mhc_pre", choices, source, kind, {"mhc_pre": 1} if kind == "positive" else {}, "mhc_pre",
                "", dtype, dynamic, training, build, allowed=("rms_norm",))


# ---- MoE experts run one by one (grouped_matmul) ---------------------------------------------
# torchtitan's _run_experts_for_loop and its respellings: the rows cut per expert (a split, or
# slices at a running offset), each expert's MLP on its rows (weights stacked (E, out, in) and
# read transposed, or stored (E, in, out); or each expert's weight a parameter of its own, an
# nn.ParameterList read the same way), the results put back together. The counts are the
# module's (static) or read off the token count (symbolic under dynamic=True).
EXPERT_ROWS = {
    "torch_split": ["    for e, rows in enumerate(torch.split(x, counts)):"],
    "method_split": ["    for e, rows in enumerate(x.split(counts, dim=0)):"],
    "offsets": ["    start = 0", "    for e, count in enumerate(counts):", "        rows = x[start:start + count]",
                "        start = start + count"],
    "narrow": ["    start = 0", "    for e in range(len(counts)):", "        rows = x.narrow(0, start, counts[e])",
               "        start += counts[e]"],
}
EXPERT_GEMMS = {  # {a} @ expert e of weight {w}
    "matmul_t": "{a} @ self.{w}[e].transpose(-2, -1)",
    "matmul_T": "torch.matmul({a}, self.{w}[e].T)",
    "mm_stored_in_out": "torch.mm({a}, self.{w}[e])",  # weights stored (E, in, out)
}
EXPERT_MLPS = {  # (the hidden, from {g1} / {g3}; the weights; a line computing the halves first)
    "silu_gated": ("F.silu({g1}) * {g3}", ("w1", "w3"), None),
    "gelu_gated": ('F.gelu({g1}, approximate="tanh") * {g3}', ("w1", "w3"), None),
    "silu": ("F.silu({g1})", ("w1",), None),
    # one merged gate_up weight (E, 2N, K), its product {h13} cut along the columns
    "merged_chunk": ("F.silu(g) * u", ("w13",), "g, u = {h13}.chunk(2, dim=-1)"),
    "merged_split": ("F.silu(g) * u", ("w13",), "g, u = torch.split({h13}, {N}, dim=-1)"),
    "merged_slices": ("F.silu(h13[..., :{N}]) * h13[..., {N}:]", ("w13",), "h13 = {h13}"),
}
EXPERT_COMBINE = {"cat": "torch.cat(outs)", "cat_dim0": "torch.cat(outs, dim=0)", "vstack": "torch.vstack(outs)"}
EXPERT_LOOKALIKES = {
    "reversed": "len(counts) - 1 - e",  # chunk e meets another expert's weights
    "rotated": "(e + 1) % len(counts)",
    "per_expert_scale": None,  # each expert's hidden scaled by its own factor
}


def _make_experts_loop(rng, seed, case_kw):
    dtype, dynamic, training = case_kw["dtype"], case_kw["dynamic"], case_kw["training"]
    E, K, N = rng.choice([2, 4, 8]), rng.choice([8, 16]), rng.choice([16, 32])
    precision = rng.choice(["params", "params", "autocast"]) if dtype != torch.float32 else "params"
    rows, gemm, mlp, combine = (rng.choice(sorted(EXPERT_ROWS)), rng.choice(sorted(EXPERT_GEMMS)),
                                rng.choice(sorted(EXPERT_MLPS)), rng.choice(sorted(EXPERT_COMBINE)))
    counted = rng.choice(["constant", "from_tokens"])
    storage = rng.choice(["stacked", "stacked", "own"])
    counts = [rng.choice([0, 1, 2, 3, 5]) for _ in range(E)]
    counts[-1] += 2  # a few rows at least
    tokens = sum(counts) if counted == "constant" else 4 * E + 2
    choices = {"rows": rows, "gemm": gemm, "mlp": mlp, "combine": combine, "counts": counted, "precision": precision,
               "storage": storage, "shapes": f"x [{tokens}, {K}], {E} experts of ({K} -> {N} -> {K})"}
    lookalike = rng.choice(sorted(EXPERT_LOOKALIKES)) if rng.random() < 0.25 else None
    if lookalike:
        choices["lookalike"] = lookalike
    expert = EXPERT_LOOKALIKES[lookalike] if lookalike in ("reversed", "rotated") else "e"
    stored = "in_out" if gemm == "mm_stored_in_out" else "out_in"

    def product(a, w):
        return "(" + EXPERT_GEMMS[gemm].format(a=a, w=w).replace("[e]", f"[{expert}]") + ")"

    activation, up, halves = EXPERT_MLPS[mlp]
    hidden = activation.format(g1=product("rows", "w1"), g3=product("rows", "w3") if "w3" in up else "", N=N)
    halves = [f"        {halves.format(h13=product('rows', 'w13'), N=N)}"] if halves else []
    if lookalike == "per_expert_scale":
        hidden = f"({hidden}) * (e + 1.0)"
    lines = ["def forward(self, x):"]
    if counted == "constant":
        lines.append(f"    counts = {counts}")
    else:  # the token count split evenly, the last expert the rest: symbolic with dynamic shapes
        lines += ["    n = x.shape[0]", f"    counts = [n // {E}] * {E - 1} + [n - {E - 1} * (n // {E})]"]
    lines += ["    outs = []", *EXPERT_ROWS[rows], *halves, f"        h = {hidden}", f"        outs.append({product('h', 'w2')})",
              f"    return {EXPERT_COMBINE[combine]}"]
    if precision == "autocast":  # torchtitan's mixed precision: fp32 weights, the body under autocast
        lines = [lines[0], "    with torch.autocast('cpu', dtype=torch.bfloat16):", *("    " + line for line in lines[1:])]
    source = "\n".join(lines)
    # a per-expert scale between the GEMMs leaves w1 / w3 a grouped GEMM each; w2's rows are not.
    # Chunks that meet the experts' weights in another order are one grouped GEMM over a weight
    # list in that order, but not over a stacked weight (which would need its experts permuted)
    kind = "negative" if lookalike in ("reversed", "rotated") and storage == "stacked" else "positive"
    param_dtype = torch.float32 if precision == "autocast" else dtype

    def build():
        gen = torch.Generator().manual_seed(seed)

        def weight(fan_in, fan_out):
            shape = (E, fan_in, fan_out) if stored == "in_out" else (E, fan_out, fan_in)
            stacked = _randn(gen, *shape, scale=fan_in ** -0.5).to(param_dtype)
            if storage == "own":
                return nn.ParameterList(nn.Parameter(w.clone()) for w in stacked)
            return nn.Parameter(stacked)

        def init(module):
            module.w2 = weight(N, K)
            for name in up:
                setattr(module, name, weight(K, 2 * N if name == "w13" else N))

        return _module_from_source(source, f"<fuzz {seed}>", init), (_randn(gen, tokens, K).to(param_dtype),)

    weights = len(up) + (lookalike != "per_expert_scale")
    return Case(seed, "experts_loop", choices, source, kind, {"grouped_matmul": weights} if kind == "positive" else {},
                "grouped_matmul", "", dtype, dynamic, training, build, allowed=("swiglu",))


MAKERS = {"rms_norm": _make_rms, "add_rms_norm": lambda rng, seed, kw: _make_rms(rng, seed, kw, add=True),
          "rope": _make_rope, "rope_complex": _make_rope_complex, "swiglu": _make_swiglu, "router": _make_router,
          "attention_block": _make_attention_block, "mhc_post": _make_mhc_post, "mhc_pre": _make_mhc_pre,
          "experts_loop": _make_experts_loop, LIBRARY: _make_library}


def make_case(seed: int, family: Optional[str] = None) -> Case:
    """The case of `seed`: the same module, inputs and expectation on every run."""
    rng = random.Random(seed)
    family = family or rng.choice(FAMILIES)
    case_kw = {"dtype": rng.choice(DTYPES), "dynamic": rng.random() < 0.35, "training": rng.random() < 0.35}
    if family == "rope_complex":
        case_kw["dtype"] = rng.choice([torch.float32, torch.float32, torch.bfloat16])
    return MAKERS[family](rng, seed, case_kw)


# ---- known gaps ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Gap:
    """Positives known not to fuse yet: `applies(case)`, and the near miss they must leave."""

    name: str
    pass_name: str  # the pass that does not fuse it (the case's other expected passes still must)
    applies: Callable[[Case], bool]
    reason: str  # regex over that pass's near-miss reasons
    evidence: str = ""


def _c(case, **wanted):
    return all(case.choices.get(k) == v for k, v in wanted.items())


# Each entry: found by this fuzz, with the near miss the pass leaves (so a gap never hides as
# a silent miss), and why it is not fixed here. Order matters: the first that applies is used.
def _respelled_norm(case):
    """A hand-written norm whose training graph keeps a spelling with a backward of its own.
    canonical.autograd_spellings respells x * x, x.square() and v ** -0.5 before autograd (the
    same bits), and an fp32 sum / n of static n as a mean; not 1 / sqrt(v) (two roundings
    where rsqrt has one), nor a sum / n of a half dtype (mean rounds once), nor one of a
    symbolic dim (n is a constant there, the dim's size only at the example)."""
    if not _c(case, style="hand"):
        return False
    if _c(case, normalise="recip_sqrt"):
        return True
    if _c(case, mean="sum_div") and (case.dynamic or (case.dtype != torch.float32 and _c(case, upcast="none"))):
        return True
    # x / sqrt(v) is traced by divide_by_sqrt, a form with the fp32 upcast: a half-dtype norm
    # without it respells in_input_dtype (add_rms_norm seed 81: fp16, training)
    return _c(case, normalise="div_sqrt", upcast="none") and case.dtype != torch.float32


NORMS = ("rms_norm", "add_rms_norm")
KNOWN_GAPS: list[Gap] = [
    Gap("training: respellings with no exact respelling before autograd", "rms_norm",
        lambda c: c.training and c.family in NORMS and _respelled_norm(c),
        r"is also used by|matches none of the forms",
        "spellings.py respells the forward patterns; in a joint graph x * x, sum / n or "
        "(v + eps) ** -0.5 also have their own backward (x * x sums two products), which no "
        "joint pattern holds"),
    Gap("a symbolic head dim with tables in another dtype than x", "rope",
        lambda c: c.family == "rope" and c.dynamic and c.choices.get("tables_fp32") and c.dtype != torch.float32,
        r"takes one dtype; the head dim \S+ is symbolic",
        "dynamic=True on q itself makes its head dim symbolic (in a model it comes from a weight: static); "
        "the channel algebra that fuses mixed dtypes reads the rotation channel by channel (seed 124)"),
    Gap("a Gemma weight on a norm computed in the half dtype", "rms_norm",
        lambda c: c.family in NORMS and c.dtype != torch.float32 and _c(c, style="hand", upcast="none", weight="gemma"),
        r"would give .* where the model computes float32",
        "(n * (1 + w.float())).type_as(x) with n in bf16 / fp16: the product is fp32, no form has "
        "that structure, and the half-dtype norm under it is refused by its output dtype (seed 21, "
        "which the x * x gap hid before x * x matched)"),
]


def known_gap(case: Case, pass_name: Optional[str] = None) -> Optional[Gap]:
    """The first gap that applies to `case` (for `pass_name`, when given)."""
    return next((g for g in KNOWN_GAPS if (case.kind in ("positive", "limit") or case.expect) and g.applies(case)
                 and pass_name in (None, g.pass_name)), None)


# ---- the oracle ---------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    case: Case
    outcome: str
    detail: str = ""
    fused: dict = dataclasses.field(default_factory=dict)
    near_misses: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    worst: dict = dataclasses.field(default_factory=dict)  # {output: (fused ulps, eager ulps)}
    seconds: float = 0.0


def _flatten(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _cotangents(outputs, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=gen).to(o.dtype) if o.is_floating_point() else None for o in outputs]


def _run(module, inputs, training, cotangents=None, seed=0, grad_inputs=None):
    """(outputs, gradients of inputs and parameters), all detached."""
    inputs = [i.detach().clone().requires_grad_(training and i.is_floating_point()
                                                and (grad_inputs is None or n in grad_inputs))
              for n, i in enumerate(inputs)]
    for p in module.parameters():
        p.grad = None
        p.requires_grad_(training)
    with torch.set_grad_enabled(training):
        outputs = _flatten(module(*inputs))
    grads = []
    if training:
        if cotangents is None:
            cotangents = _cotangents(outputs, seed)
        terms = [(o * c.to(o.dtype)).sum() for o, c in zip(outputs, cotangents)
                 if c is not None and o.requires_grad]
        if terms:
            sum(terms).backward()
        grads = [t.grad for t in [*inputs, *module.parameters()] if t.requires_grad]
    return [o.detach() for o in outputs], [g.detach() if g is not None else None for g in grads], cotangents


def _truth(module, inputs, training, cotangents, grad_inputs=None):
    """The float64 run: the module and inputs in float64, its own fp32 casts kept float64."""
    exact = copy.deepcopy(module).double()
    inputs = [i.double() if i.is_floating_point() else (i.to(torch.complex128) if i.is_complex() else i)
              for i in inputs]
    with KeepFloat64():
        return _run(exact, inputs, training, [c.double() if c is not None else None for c in cotangents or []]
                    or None, grad_inputs=grad_inputs)


def _ulps_at_scale(actual, exact, dtype):
    unit = ulp(exact.abs().max().reshape(1).to(dtype)).double().item() if exact.numel() else 0.0
    if unit == 0:
        return 0.0
    return (actual.double() - exact.double()).abs().max().item() / unit


def _sorted_rows(ids):
    return ids.sort(dim=-1).values if ids.dim() else ids


def _compare(case, fused, eager, exact, slack, what):
    """(worst excess, detail, {name: (fused, eager) ulps}) for float outputs; exact ids for index outputs."""
    report, bad = {}, []
    for i, (f, e, t) in enumerate(zip(fused, eager, exact)):
        name = f"{what}{i}"
        if f is None and e is None:
            continue
        if f is None or e is None or f.shape != e.shape or f.dtype != e.dtype:
            bad.append(f"{name}: {None if f is None else (f.dtype, tuple(f.shape))} vs eager "
                       f"{None if e is None else (e.dtype, tuple(e.shape))}")
            continue
        if not f.is_floating_point() or (what == "out" and i in case.index_outputs):
            if not torch.equal(_sorted_rows(f.long()) if f.dim() == 2 else f, _sorted_rows(e.long()) if e.dim() == 2 else e):
                bad.append(f"{name}: integer / index output differs from eager")
            continue
        dtype = e.dtype if e.dtype in SLACK_ULPS else torch.float32
        if dtype == torch.float32 and case.choices.get("precision") == "autocast":
            # fp32 parameters and inputs computed under bf16 / fp16 autocast: every product is
            # rounded to the case's dtype, so that is the precision their values (the fp32
            # weights' gradients among them) carry, in eager and fused alike. Counted in fp32
            # ulps, eager's own error is thousands of them and varies from one tensor to the
            # next by more than 2x (an expert's weight with few rows)
            dtype = case.dtype
        fu, eu = _ulps_at_scale(f, t, dtype), _ulps_at_scale(e, t, dtype)
        report[name] = (round(fu, 2), round(eu, 2))
        if not math.isfinite(fu) and math.isfinite(eu) or fu > max(2 * eu, eu + slack[dtype]):
            bad.append(f"{name}: {fu:.3g} ulp from float64 at scale, eager {eu:.3g} (allowed {max(2 * eu, eu + slack[dtype]):.3g})")
    return bad, report


def _aot_eager_fails(case) -> Optional[str]:
    """The plain aot_eager compile of the case: None if it runs, else its error in one line."""
    torch._dynamo.reset()
    module, inputs = case.build()
    try:
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=case.dynamic or None)
        _run(compiled, inputs, case.training, seed=case.seed, grad_inputs=case.grad_inputs)
    except Exception as exc:  # noqa: BLE001 - classified, not hidden
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _reverted(report) -> list[str]:
    errors = [f"{p}: {e}" for p, e in report.errors]
    errors += [f"{m.pass_name}: {m.reason}" for m in report.near_misses if "reverted" in m.reason]
    return errors


def run_case(case: Case, config: Optional[nff.FusionConfig] = None) -> Outcome:
    import time

    start = time.perf_counter()
    torch._dynamo.reset()
    module, inputs = case.build()
    eager_out, eager_grads, cotangents = _run(module, inputs, case.training, seed=case.seed,
                                              grad_inputs=case.grad_inputs)
    exact_out, exact_grads, _ = _truth(module, inputs, case.training, cotangents, case.grad_inputs)
    backend = EmulationBackend(config or nff.FusionConfig())
    try:
        compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=case.dynamic or None)
        fused_out, fused_grads, _ = _run(compiled, inputs, case.training, cotangents,
                                         grad_inputs=case.grad_inputs)
    except Exception as exc:  # noqa: BLE001 - every failure is classified
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        theirs = _aot_eager_fails(case)
        outcome = TORCH_FAILURE if theirs else COMPILE_FAILURE
        detail = f"{error}" + (f" (plain aot_eager fails too: {theirs})" if theirs else
                               f"\n{traceback.format_exc(limit=-6)}")
        return Outcome(case, outcome, detail, seconds=time.perf_counter() - start)
    report = backend.report
    counts = {p: n for p, n in report.counts.items() if n}
    misses = [(m.pass_name, m.reason) for m in report.near_misses]
    result = Outcome(case, "", fused=counts, near_misses=misses, errors=_reverted(report))
    bad, result.worst = _compare(case, fused_out, eager_out, exact_out, SLACK_ULPS, "out")
    if case.training:
        bad_grads, worst_grads = _compare(case, fused_grads, eager_grads, exact_grads, GRAD_SLACK_ULPS, "grad")
        bad += bad_grads
        result.worst.update(worst_grads)
    result.seconds = time.perf_counter() - start
    result.outcome, result.detail = _classify(case, counts, misses, result.errors, bad)
    return result


def _classify(case, counts, misses, errors, bad):
    if bad and counts:
        return MISCOMPILE, "; ".join(bad)
    if bad:  # nothing fused and still different: the harness's own problem, never hidden
        return MISCOMPILE, "unfused, yet differs from eager: " + "; ".join(bad)
    if errors:
        return PASS_REVERTED, "; ".join(errors)
    target = case.expect_pass
    # passes that must fuse: a positive's, and those a look-alike of a later pass still has
    # (add + RMSNorm with a scaled add: the norm is still one)
    expected = dict(case.expect)
    # merged_projections merges linears of one input ahead of the passes: no spelling's site,
    # and the outputs are compared whatever it did
    allowed = set(expected) | set(case.allowed) | {"merged_projections"} | ({target} if case.kind == "either" else set())
    extra = {p: n for p, n in counts.items() if p not in allowed}
    if extra:
        return WRONG_FUSION, f"fused {counts}, expected {expected or 'none'}"
    if case.kind in ("negative", "limit") and counts.get(target, 0):
        return WRONG_FUSION, f"{target} fused a {case.kind} case: {counts}"
    unfused = [p for p, n in expected.items() if counts.get(p, 0) < n]
    if not unfused:
        gap = known_gap(case)
        if case.kind == "either":
            return (EITHER_FUSED if counts.get(target, 0) else EITHER_UNFUSED), ""
        if case.kind == "negative":
            return REFUSED, "; ".join(r for p, r in misses if p == target)
        if case.kind == "positive":
            # a gap's predicate is broader than the gap (it names the spelling, not every
            # reason): the benchmark lists the gaps that fused cases matched, to narrow them
            return FUSED, (f"fused, though known gap {gap.name!r} applies" if gap is not None else "")
    # the first pass that should have fused and did not (rms_norm before add_rms_norm: the
    # residual fusion needs the norm fused first) is the one judged
    judged = unfused[0] if unfused else target
    own = [reason for name, reason in misses if name == judged]
    gap = known_gap(case, judged)
    if gap is not None and any(re.search(gap.reason, r) for r in own):
        return KNOWN_GAP, "; ".join(own)
    if case.kind == "limit" and judged == target and case.limit and any(re.search(case.limit, r) for r in own):
        return REFUSED, "; ".join(own)
    if not own:
        partly = f" ({counts.get(judged, 0)}/{expected[judged]} sites fused)" if judged in expected else ""
        return SILENT_MISS, f"no near miss of {judged}{partly}; fused {counts or 'nothing'}" + (
            f"; other near misses: {misses}" if misses else "")
    return REFUSED_POSITIVE, f"{judged}: " + "; ".join(own)
