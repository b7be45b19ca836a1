"""What a pattern module (npu_fx_fusion.patterns.<name>) may use of the engine.

A fusion declares a FusionPass: its unfused forms as plain PyTorch functions (Form), the
fused replacement, a check that returns the first reason not to fuse a Site (or None), and
an anchor predicate that finds candidate sites so that the ones left unfused are reported
as near misses (docs/adding-a-pattern.md). The helpers below read nodes in those checks.
Registration (registry.py) and matching (accept.py) happen behind this surface, on first
use: importing a pattern module traces and registers nothing.
"""
# what a region of contractions, reductions and elementwise ops computes, whatever its layouts
from .axis_algebra import (AxisEvaluation, Expr, MaskedScores, MaskUse, atom_sizes, atoms_of, read_masked_scores,
                           rearrange, rearrange_gradient, scale_and_rest, strip_casts)
from .canonical import is_backward, is_joint_graph, same_shape
# what a region computes over its tensors' last dims, whatever its spelling (recognize=)
from .channel_algebra import (ChannelGather, ChannelValue, Factor, NotEvaluable, channel_gather, channels_of,
                              SHAPE_ONLY_OPS, evaluate_around, evaluate_slice, modelled, real_tensors, region_around,
                              single_terms)
from .forms import (FinishOptions, Form, FusionPass, Reason, Recognized, Site, is_training_graph, records_gradient,
                    with_arguments)
from .nodes import (MOVES, RESHAPES, constant_on_a_size_range, first_refused_use, hashable, is_call, is_cast, known_equal, normalized_dims, plain_cast, tensor_meta,
                    uneven_halves, users_outside)
# F.scaled_dot_product_attention as torch_npu's kernel records it for a SoC (the emulation's
# own kernel): a form whose search means the NPU's SDPA calls it instead of spelling the
# FlashAttention call out again (the pattern tracers leave SDPA to the forms, its spelling
# depends on the SoC: npu_dispatch.traced_as_on_npu)
from .npu_dispatch import make_sdpa as sdpa_as_on_npu
# the int a torch_npu op's dtype argument (output_dtype, dst_type ...) takes for a torch dtype
from .npu_ops.spec import dtype_argument
# the communicator (`hcom`) a collective op takes for a c10d process group, and that group's facts
from .npu_ops._groups import group_backend, group_size, hcom_of, no_communicator_reason
from .regions import BackwardRegion, backward_nodes_by_seq, backward_region, enclosed_region, region_between
# masks and index tensors computed from sizes (and one two-valued leaf), decided for every size
from .symbolic_values import (decided_nonnegative, formula_of, index_list_members, index_symbol, mask_mode_with_leaf,
                              never, size_expr)
from .spellings import sum_over_count
# a region's function identified on random inputs against the fused call (Recognized sites)
from .verify import same_function

__all__ = ["MOVES", "RESHAPES", "SHAPE_ONLY_OPS", "AxisEvaluation", "BackwardRegion", "ChannelGather", "ChannelValue", "Expr", "Factor", "FinishOptions", "Form", "FusionPass",
           "MaskUse", "MaskedScores", "NotEvaluable", "Reason", "Recognized", "Site", "atom_sizes", "atoms_of",
           "backward_nodes_by_seq", "backward_region", "channel_gather", "channels_of", "constant_on_a_size_range", "dtype_argument", "enclosed_region", "evaluate_around", "evaluate_slice", "first_refused_use",
           "decided_nonnegative", "formula_of", "index_list_members", "index_symbol", "mask_mode_with_leaf", "never",
           "size_expr",
           "group_backend", "group_size", "hashable", "hcom_of", "is_backward", "is_call", "is_cast", "is_joint_graph", "is_training_graph", "records_gradient",
           "known_equal", "modelled", "no_communicator_reason", "normalized_dims", "plain_cast", "read_masked_scores", "real_tensors", "region_around", "same_shape",
           "rearrange", "rearrange_gradient", "region_between", "scale_and_rest", "sdpa_as_on_npu", "strip_casts", "sum_over_count", "tensor_meta",
           "same_function", "single_terms", "uneven_halves", "users_outside", "with_arguments"]
