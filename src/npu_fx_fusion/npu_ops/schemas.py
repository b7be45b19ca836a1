"""The torch_npu schema strings of every op npu-fx-fusion emits or calls.

Copied character for character from torch_npu 2.13.0
(`torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`); tests/test_schemas.py
compares each one with the wheel. The stand-in library registers exactly these, so a
graph rewritten on CPU is op-for-op the graph that runs on an NPU.
"""

# namespace -> {op name -> schema}
SCHEMAS: dict[str, dict[str, str]] = {
    "npu": {
        # ---- MoE (npu_ops/moe.py; op_semantics sections 5-7) ----
    },
}

# ---- DeepSeek-V3.2 sparse attention (npu_ops/attention.py; op_semantics sections 8 and 10) ----
# Appended as a block of its own. The npu ops are torch_npu 2.13.0's (yaml lines 489 and
# 978, their grads 491 and 980), compared with the wheel by tests/test_schemas.py like every other npu schema.
SCHEMAS["npu"].update({
    "npu_lightning_indexer": (
        "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, "
        "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, "
        "Tensor? block_table=None, str layout_query=\"BSND\", str layout_key=\"BSND\", "
        "int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
        "int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, Tensor)"
    ),
    "npu_sparse_flash_attention": (
        "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, "
        "float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, "
        "int sparse_block_size=1, str layout_query=\"BSND\", str layout_kv=\"BSND\", int sparse_mode=3, "
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, int attention_mode=0, "
        "bool return_softmax_lse=False, Tensor? sinks=None) -> (Tensor, Tensor, Tensor)"
    ),
    # their backward ops (yaml lines 491 and 980), which torch_npu's derivatives call
    "npu_lightning_indexer_grad": (
        "npu_lightning_indexer_grad(Tensor query, Tensor key, Tensor dy, Tensor sparse_indices, Tensor weights, "
        "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, str? layout=\"BSND\", "
        "int? sparse_mode=3, int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "npu_sparse_flash_attention_grad": (
        "npu_sparse_flash_attention_grad(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, "
        "Tensor d_out, Tensor out, Tensor softmax_max, Tensor softmax_sum, float scale_value, "
        "int sparse_block_size, Tensor? query_rope=None, Tensor? key_rope=None, Tensor? actual_seq_qlen=None, "
        "Tensor? actual_seq_kvlen=None, str? layout=\"BSND\", int? sparse_mode=3, "
        "int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807, int? attention_mode=0) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
})

# Not torch_npu ops: the CANN ops-transformer PyTorch extension (package cann_ops_transformer,
# Ascend 950 only) registers them as torch.ops.cann_ops_transformer.*. Copied character for
# character from its OpBuilder.schema() (hicann/ops-transformer,
# torch_extension/cann_ops_transformer/ops/sparse_flash_mla_softmax_l1_norm.py; also
# shared/reference/op_schemas.yaml). The wheel cannot check them: tests/test_schemas.py checks
# them against the installed package when there is one, and skips saying so otherwise.
SCHEMAS["cann_ops_transformer"] = {
    "sparse_flash_mla_softmax_l1_norm_metadata": (
        "sparse_flash_mla_softmax_l1_norm_metadata(int num_heads_q, int num_heads_k, int head_dim, *, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, "
        "Tensor? seqused_k=None, Tensor? cmp_residual_k=None, Tensor? topk_length=None, "
        "int? batch_size=None, int? max_seqlen_q=None, int? max_seqlen_k=None, int? topk=None, "
        "str? layout_q=None, str? layout_k=None, int? mask_mode=None, int? cmp_ratio=None) -> Tensor"
    ),
    "sparse_flash_mla_softmax_l1_norm": (
        "sparse_flash_mla_softmax_l1_norm(Tensor q, Tensor k, Tensor softmax_lse, *, "
        "Tensor? sparse_indices=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
        "Tensor? seqused_q=None, Tensor? seqused_k=None, Tensor? cmp_residual_k=None, "
        "Tensor? topk_length=None, Tensor? metadata=None, float softmax_scale=1.0, int max_seqlen_k=0, "
        "int cmp_ratio=1, int mask_mode=0, str layout_q=\"BSND\", str layout_k=\"BSND\") -> Tensor"
    ),
}
# ---- end of the DeepSeek-V3.2 sparse attention block ----

# ---- DeepSeek-V4 (shared/reference/deepseek_v4.md; npu_ops/mhc.py, rope.py, activation.py,
# attention.py) ------------------------------------------------------------------------------
# Appended as a block of its own. The npu ops are torch_npu 2.13.0's (yaml lines 46 / 49
# mhc_pre and its backward, 557 / 560 mhc_post and its backward, 832 clipped_swiglu, 878 / 880
# mhc_sinkhorn and its backward), compared with the wheel by tests/test_schemas.py.
SCHEMAS["npu"].update({
})

# cann_ops_transformer (CANN ops-transformer PyTorch extension; not on the package index):
# copied character for character from each op's OpBuilder.schema() in
# torch_extension/cann_ops_transformer/ops/{mhc_pre_sinkhorn, mhc_pre_sinkhorn_backward, mhc_post,
# mhc_post_backward, inplace_partial_rotary_mul, inplace_partial_rotary_mul_backward, sparse_flash_mla,
# sparse_flash_mla_grad, lightning_indexer}.py of mirror-cann/ops-transformer at 3a280bc (2026-07-21),
# spaces (and their absence) included.
SCHEMAS["cann_ops_transformer"].update({
    "sparse_flash_mla_metadata": (
        "sparse_flash_mla_metadata(int num_heads_q, int num_heads_kv, int head_dim, *, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
        "Tensor? seqused_q=None, Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, "
        "Tensor? cmp_residual_kv=None, Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, "
        "int? batch_size=None, int? max_seqlen_q=None, int? max_seqlen_ori_kv=None, int? max_seqlen_cmp_kv=None,"
        "int? ori_topk=None, int? cmp_topk=None, int? cmp_ratio=None, int? ori_mask_mode=None,"
        "int? cmp_mask_mode=None, int? ori_win_left=None, int? ori_win_right=None, str? layout_q=None,"
        "str? layout_kv=None, bool? has_ori_kv=None, bool? has_cmp_kv=None) -> Tensor"
    ),
    "sparse_flash_mla": (
        "sparse_flash_mla(Tensor q, *,"
        "Tensor? ori_kv=None, Tensor? cmp_kv=None, "
        "Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, "
        "Tensor? ori_block_table=None, Tensor? cmp_block_table=None, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, "
        "Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, "
        "Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, "
        "Tensor? cmp_residual_kv=None, "
        "Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, "
        "Tensor? sinks=None, Tensor? metadata=None, "
        "float softmax_scale=1.0, int cmp_ratio=1, "
        "int ori_mask_mode=4, int cmp_mask_mode=3, "
        "int ori_win_left=127, int ori_win_right=0, "
        'str layout_q="BSND", str layout_kv="BSND", '
        "int topk_value_mode=1, bool return_softmax_lse=False) -> (Tensor, Tensor)"
    ),
    "sparse_flash_mla_grad_metadata": (
        "sparse_flash_mla_grad_metadata(int num_heads_q, int num_heads_kv, int head_dim, *, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
        "Tensor? seqused_q=None, Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, "
        "Tensor? cmp_residual_kv=None, Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, "
        "int? batch_size=None, int? max_seqlen_q=None, int? max_seqlen_ori_kv=None, int? max_seqlen_cmp_kv=None,"
        "int? ori_topk=None, int? cmp_topk=None, int? cmp_ratio=None, int? ori_mask_mode=None,"
        "int? cmp_mask_mode=None, int? ori_win_left=None, int? ori_win_right=None, str? layout_q=None,"
        "str? layout_kv=None, bool? has_ori_kv=None, bool? has_cmp_kv=None) -> Tensor"
    ),
    # all positional (no `*`), as the extension declares it
    "sparse_flash_mla_grad": (
        "sparse_flash_mla_grad(Tensor q, Tensor dout, Tensor attn_out, Tensor softmax_lse,"
        "Tensor? ori_kv=None, Tensor? cmp_kv=None, Tensor? ori_sparse_indices=None, "
        "Tensor? cmp_sparse_indices=None, Tensor?cu_seqlens_q=None,"
        "Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None,"
        "Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, Tensor? cmp_residual_kv=None,"
        "Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, Tensor? sinks=None,"
        "Tensor? metadata=None,"
        "float softmax_scale=None, int cmp_ratio=None, int ori_mask_mode=0, int cmp_mask_mode=0,"
        "int ori_win_left=-1, int ori_win_right=-1,"
        'str layout_q="BSND", str layout_kv="BSND")->'
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "lightning_indexer_metadata": (
        "lightning_indexer_metadata(int num_heads_q, int num_heads_k, int head_dim, int topk, *, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, "
        "Tensor? cmp_residual_k=None, int? batch_size=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
        "str? layout_q=None, str? layout_k=None, int? mask_mode=None, int? cmp_ratio=None) -> Tensor"
    ),
    "lightning_indexer": (
        "lightning_indexer(Tensor q, Tensor k, Tensor w, "
        "int topk, *, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None,"
        "Tensor? seqused_q=None, Tensor? seqused_k=None, "
        "Tensor? cmp_residual_k=None, Tensor? block_table=None, "
        "Tensor? output_idx_offset=None, Tensor? metadata=None, int max_seqlen_q=-1,"
        'str layout_q="BSND", str layout_k="BSND", int mask_mode=0, '
        "int cmp_ratio=1,"
        "int return_value=0) -> (Tensor, Tensor)"
    ),
})

# cann_ops_nn (CANN ops-nn PyTorch extension; not on the package index): the OpBuilder.schema() of
# hicann/ops-nn activation/swiglu_group/torch_extension/swiglu_group.py (at 3caf360) and
# torch_extension/cann_ops_nn/ops/activation/swiglu_group_backward/swiglu_group_backward.py (at 0188283,
# the revision whose clamp_limit default is 0.0, "no clamp", and whose weight is (.., 1); an older one
# defaults it to -1.0).
SCHEMAS["cann_ops_nn"] = {
}
# ---- end of the DeepSeek-V4 block ----

# ---- NPU dispatch (npu_dispatch.py): the ops torch_npu's own aten kernels call ----
# Appended as a block of its own. What an NPU aot graph holds where CPU's holds a
# decomposition: scaled_dot_product_attention's FlashAttention (npu_ops/fusion_attention.py,
# yaml lines 390, 397, 404, 407) and the backward ops op-plugin's derivatives.yaml
# gives the aten ops torch_npu differentiates itself (npu_ops/dispatch_backward.py, lines
# 893, 895, 109, 111, 113). Compared with the wheel by tests/test_schemas.py.
SCHEMAS["npu"].update({
})
# ---- end of the NPU dispatch block ----

# ---- Inference attention and KV-cache writes (npu_ops/infer_attention.py, npu_ops/kv_cache.py;
# shared/reference/attention_inference.md sections 3-5) ----
# Appended as a block of its own; torch_npu 2.13.0 yaml lines 349 (FIA), 898 / 901 (scatter_update and
# its in-place twin, which torchair's recover_view_inplace_pattern substitutes for the functional one)
# and 187 (the functional latent-cache op the pass emits; v1 at 183 hides its in-place write).
SCHEMAS["npu"].update({
})
# ---- end of the inference attention block ----


# ---- Expert parallel (npu_ops/moe.py, the re_routing block; op_semantics 6.5) ----
# torch_npu 2.13.0 yaml line 625. Appended as a block of its own.
SCHEMAS["npu"].update({
})
# ---- end of the expert-parallel block ----
