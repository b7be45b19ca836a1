"""paged_attention: attention over keys gathered out of a paged KV cache -> FIA reading the
cache in place through a block table.

A paged cache holds its tokens in blocks, (num_blocks, block_size, N, D); each sequence
owns the blocks its row of a block table names. Code without a paged kernel gathers a
sequence's history before attending (vLLM's reference paths, a user's own paged cache, a
plain-PyTorch flash_attn_with_kvcache):

    keys = key_cache[block_table]                      (B, M, block_size, N, D)
    keys = keys.view(B, M * block_size, N, D).transpose(1, 2)
    out = scaled_dot_product_attention(query, keys, values, attn_mask=lengths_mask)

or gathers slots out of the (num_blocks * block_size, N, D) view, at slots the graph computes
as block_table[b, p // block_size] * block_size + p % block_size for p = 0 .. L - 1:

    positions = torch.arange(L)
    slots = block_table[:, positions // block_size] * block_size + positions % block_size
    keys = key_rows[slots].transpose(1, 2)            key_rows = key_cache.view(-1, N, D)

That gather copies the whole history of every sequence, per layer and step. The attention
pass runs first and makes the attention FIA over the gathered keys (any spelling it takes:
SDPA on CPU or as an NPU records it, eager attention, GQA through repeat_kv); this pass
matches FIA whose key and value are such a gather and makes FIA read the cache itself:

    FIA(query, key_cache.view(num_blocks, block_size, N * D), value_cache.view(...),
        block_table=table (int32), block_size=block_size, actual_seq_lengths_kv=[M * block_size],
        atten_mask=<the same mask>, ...)

The kernel reads, for each batch row, the M * block_size positions of its table row in table
order: the gathered keys exactly, in the same order, under the same mask. So the rewrite
needs no proof about the mask or the lengths: it keeps both. actual_seq_lengths_kv, which
page attention requires ("page attention场景下, 必须传入actual_seq_lengths_kv"), is the span
of the table for every row; the per-sequence lengths live on the device (a host int list is
what the op takes) and stay in the mask, so the kernel reads every block the table names
(as the gather did, without the copy). Table entries the mask hides must still be blocks
the kernel may read: eager indexing wraps a negative entry (transformers and vLLM fill
unused entries with -1) to block num_blocks - 1, FIA checks nothing ("不会对blockid的合法性
进行校验"), so the table is passed as `table % num_blocks` (equal on every entry eager
accepts; an entry eager would refuse is read modulo the cache instead).

For the slot form the arithmetic is matched op for op, one block_size in all three places
(floor division, product, remainder), positions an arange from 0: that is the proof that
slot p of row b is offset p % block_size of block table[b, p // block_size]. Slots handed in
as a graph input (transformers' PagedAttentionCache passes read_index, computed on the host)
prove nothing: those sites are near misses that say so.

Hardware limits (capability table): fp16/bf16, block_size 16-aligned and <= 512 in decode
(Q_S = 1), a multiple of 128 in 128..512 with Q_S > 1, N_kv * D <= 65535 in the (num_blocks,
block_size, N * D) layout; in emulation (no SoC) a site outside them fuses with a note.
"""
import torch

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, known_equal, tensor_meta

aten = torch.ops.aten
FIA_OP = "npu.npu_fused_infer_attention_score"
FIA = CAPABILITIES[FIA_OP]


def _fia(*args, **kwargs):
    # looked up at call time: importing a pattern module registers no op
    return torch.ops.npu.npu_fused_infer_attention_score(*args, **kwargs)


def _fia_target():
    return torch.ops.npu.npu_fused_infer_attention_score.default


# ---- the unfused forms: FIA (the attention pass's) over gathered keys ----------------------------
def _blocks(cache, block_table):
    """The blocks of each table row, as (B, M * block_size, N, D) keys in BNSD."""
    batch, count = block_table.shape
    _, block_size, heads, dim = cache.shape
    return cache[block_table].view(batch, count * block_size, heads, dim).transpose(1, 2).contiguous()


def _slots(block_table, positions, block_size):
    return block_table[:, positions // block_size] * block_size + positions % block_size


def _at(rows, slots):
    return rows[slots].transpose(1, 2).contiguous()


def block_gather_decode(query, key_cache, value_cache, block_table, atten_mask, scale):
    return _fia(query, _blocks(key_cache, block_table), _blocks(value_cache, block_table), atten_mask=atten_mask,
                num_heads=query.shape[1], scale=scale, input_layout="BNSD",
                num_key_value_heads=key_cache.shape[2])[0]


def block_gather_prefill(query, key_cache, value_cache, block_table, atten_mask, scale):
    # an explicit mask with S_q > 1: the attention pass adds the invalid-row correction
    return _fia(query, _blocks(key_cache, block_table), _blocks(value_cache, block_table), atten_mask=atten_mask,
                num_heads=query.shape[1], scale=scale, input_layout="BNSD", num_key_value_heads=key_cache.shape[2],
                inner_precise=2)[0]


def slot_gather_decode(query, key_rows, value_rows, block_table, positions, atten_mask, block_size, scale):
    slots = _slots(block_table, positions, block_size)  # one slot tensor for the keys and the values
    return _fia(query, _at(key_rows, slots), _at(value_rows, slots), atten_mask=atten_mask, num_heads=query.shape[1],
                scale=scale, input_layout="BNSD", num_key_value_heads=key_rows.shape[1])[0]


def slot_gather_prefill(query, key_rows, value_rows, block_table, positions, atten_mask, block_size, scale):
    slots = _slots(block_table, positions, block_size)
    return _fia(query, _at(key_rows, slots), _at(value_rows, slots), atten_mask=atten_mask, num_heads=query.shape[1],
                scale=scale, input_layout="BNSD", num_key_value_heads=key_rows.shape[1], inner_precise=2)[0]


def slot_gathers_decode(query, key_rows, value_rows, block_table, positions, value_positions, atten_mask, block_size,
                        scale):
    """The slots computed once for the keys and once for the values."""
    keys = _at(key_rows, _slots(block_table, positions, block_size))
    values = _at(value_rows, _slots(block_table, value_positions, block_size))
    return _fia(query, keys, values, atten_mask=atten_mask, num_heads=query.shape[1], scale=scale,
                input_layout="BNSD", num_key_value_heads=key_rows.shape[1])[0]


def slot_gathers_prefill(query, key_rows, value_rows, block_table, positions, value_positions, atten_mask,
                         block_size, scale):
    keys = _at(key_rows, _slots(block_table, positions, block_size))
    values = _at(value_rows, _slots(block_table, value_positions, block_size))
    return _fia(query, keys, values, atten_mask=atten_mask, num_heads=query.shape[1], scale=scale,
                input_layout="BNSD", num_key_value_heads=key_rows.shape[1], inner_precise=2)[0]


# ---- the fused calls ---------------------------------------------------------------------------
def _paged_fia(query, key_cache, value_cache, block_table, atten_mask, scale, inner_precise=0):
    """FIA reading (num_blocks, block_size, N, D) caches through the table, (B, M) entries."""
    blocks, block_size, heads, dim = key_cache.shape
    table = block_table.remainder(blocks).to(torch.int32)  # eager indexing's wrap of -1 (see above)
    out, _ = _fia(query, key_cache.view(blocks, block_size, heads * dim),
                  value_cache.view(blocks, block_size, heads * value_cache.shape[-1]), atten_mask=atten_mask,
                  actual_seq_lengths_kv=[block_table.shape[1] * block_size], block_table=table,
                  num_heads=query.shape[1], scale=scale, input_layout="BNSD", num_key_value_heads=heads,
                  inner_precise=inner_precise, block_size=block_size)
    return out


def fia_paged_decode(query, key_cache, value_cache, block_table, atten_mask, scale):
    return _paged_fia(query, key_cache, value_cache, block_table, atten_mask, scale)


def fia_paged_prefill(query, key_cache, value_cache, block_table, atten_mask, scale):
    return _paged_fia(query, key_cache, value_cache, block_table, atten_mask, scale, inner_precise=2)


def _as_blocks(rows, block_size):
    return rows.view(-1, block_size, *rows.shape[1:])


def fia_paged_slots_decode(query, key_rows, value_rows, block_table, positions, atten_mask, block_size, scale):
    return _paged_fia(query, _as_blocks(key_rows, block_size), _as_blocks(value_rows, block_size), block_table,
                      atten_mask, scale)


def fia_paged_slots_prefill(query, key_rows, value_rows, block_table, positions, atten_mask, block_size, scale):
    return _paged_fia(query, _as_blocks(key_rows, block_size), _as_blocks(value_rows, block_size), block_table,
                      atten_mask, scale, inner_precise=2)


def fia_paged_slot_pairs_decode(query, key_rows, value_rows, block_table, positions, value_positions, atten_mask,
                                block_size, scale):
    return fia_paged_slots_decode(query, key_rows, value_rows, block_table, positions, atten_mask, block_size, scale)


def fia_paged_slot_pairs_prefill(query, key_rows, value_rows, block_table, positions, value_positions, atten_mask,
                                 block_size, scale):
    return fia_paged_slots_prefill(query, key_rows, value_rows, block_table, positions, atten_mask, block_size, scale)


FORMS = [
    Form(block_gather_decode, fia_paged_decode, dtypes=(torch.float32,)),  # no casts: one trace
    Form(block_gather_prefill, fia_paged_prefill, dtypes=(torch.float32,)),
    Form(slot_gather_decode, fia_paged_slots_decode, dtypes=(torch.float32,)),
    Form(slot_gather_prefill, fia_paged_slots_prefill, dtypes=(torch.float32,)),
    Form(slot_gathers_decode, fia_paged_slot_pairs_decode, dtypes=(torch.float32,)),
    Form(slot_gathers_prefill, fia_paged_slot_pairs_prefill, dtypes=(torch.float32,)),
]


# ---- checks ------------------------------------------------------------------------------------
def check(site):
    query = site["query"]
    if "key_cache" in site.args:
        key_cache, value_cache = site["key_cache"], site["value_cache"]
        reason = _cache_reason(key_cache, value_cache)
    else:
        key_cache, value_cache, reason = _slot_caches(site)
    if reason:
        return reason
    table = site["block_table"]
    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64):
        return f"the block table is a {str(table.dtype)[6:]}{list(table.shape)} tensor, not (B, blocks) integers"
    _, block_size, kv_heads, dim = key_cache.shape
    return site.hardware_limits(_hardware_reasons(site, query, key_cache, block_size, kv_heads, dim)) or _notes(
        site, table, block_size)


def _cache_reason(key_cache, value_cache):
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        return (f"the caches {list(key_cache.shape)}, {list(value_cache.shape)} are not (num_blocks, block_size, N, "
                "D): FIA's page attention reads blocks")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return "a paged cache is not contiguous (FIA takes no strided tensor)"
    if not all(known_equal(a, b) for a, b in zip(key_cache.shape[:3], value_cache.shape[:3])):
        return f"the key cache {list(key_cache.shape)} and the value cache {list(value_cache.shape)} differ in blocks"
    return None


def _slot_caches(site):
    """(key cache, value cache) as blocks of the matched block_size, or the reason not."""
    key_rows, value_rows, block_size = site["key_rows"], site["value_rows"], site["block_size"]
    positions = site.arg_nodes["positions"]
    for node in (positions, site.arg_nodes.get("value_positions", positions)):
        if not (is_call(node, aten.arange.default) and len(node.args) == 1):
            return None, None, (f"the positions of the slot arithmetic are {getattr(node, 'target', node)}, not "
                                "arange(L) from 0: slot p is not proven to be position p of the sequence")
    if not known_equal(tensor_meta(site.arg_nodes.get("value_positions", positions)).shape[0],
                       tensor_meta(positions).shape[0]):
        return None, None, "the keys and the values are gathered at different numbers of positions"
    if not isinstance(block_size, int) or block_size <= 0:
        return None, None, f"the block size {block_size} is not a positive constant"
    if key_rows.dim() != 3 or value_rows.dim() != 3:
        return None, None, f"the slot rows {list(key_rows.shape)} are not (slots, N, D)"
    for rows in (key_rows, value_rows):
        if not known_equal(rows.shape[0] % block_size, 0):
            return None, None, (f"the cache's {rows.shape[0]} slots are not whole blocks of {block_size}: it cannot "
                                "be read as (num_blocks, block_size, N, D)")
    length, table = tensor_meta(positions).shape[0], site["block_table"]
    if not known_equal(length, table.shape[1] * block_size):
        return None, None, (f"the gather reads {length} positions of a {table.shape[1]}-block table of {block_size}: "
                            "FIA reads every slot of the table, and the mask would not span them")
    key_cache = key_rows.view(-1, block_size, *key_rows.shape[1:])
    value_cache = value_rows.view(-1, block_size, *value_rows.shape[1:])
    return key_cache, value_cache, _cache_reason(key_cache, value_cache)


def _hardware_reasons(site, query, key_cache, block_size, kv_heads, dim):
    limits = FIA.limits
    queries = query.shape[2]
    aligned = limits["paged_decode_block_multiple"] if queries == 1 else limits["paged_prefill_block_multiple"]
    return [
        unsupported(FIA_OP, site.soc, x=query),
        f"block_size {block_size} is not a multiple of {aligned}" if block_size % aligned else None,
        f"block_size {block_size} > {limits['paged_max_block_size']}"
        if block_size > limits["paged_max_block_size"] else None,
        f"block_size {block_size} < {limits['paged_min_prefill_block_size']} with {queries} queries"
        if queries != 1 and block_size < limits["paged_min_prefill_block_size"] else None,
        f"N_kv * D = {kv_heads * dim} > {limits['paged_max_hidden']} in the (num_blocks, block_size, N * D) layout"
        if kv_heads * dim > limits["paged_max_hidden"] else None,
    ]


def _notes(site, table, block_size):
    site.notes.append(f"reads the cache in place through a ({table.shape[0]}, {table.shape[1]}) block table of "
                      f"{block_size}-slot blocks: every slot the table names, under the model's mask "
                      "(actual_seq_lengths_kv is the table's span: the per-sequence lengths are device values)")
    site.notes.append("the table is passed modulo num_blocks: entries eager indexing wraps (-1) read the block it "
                      "reads; FIA checks no block id")
    return None


# ---- near misses: FIA over gathered keys that no form took ----------------------------------------
_PASS_THROUGH = (aten.clone.default, aten.transpose.int, aten.view.default, aten.reshape.default,
                 aten._unsafe_view.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
                 aten.permute.default, aten.slice.Tensor)


def _gather_under(node):
    """The index / index_select / gather the key of an FIA reads through views, or None."""
    for _ in range(12):
        if is_call(node, aten.index.Tensor, aten.index_select.default, aten.gather.default):
            return node
        if not is_call(node, *_PASS_THROUGH):
            return None
        node = node.args[0]
    return None


def anchor(node):
    return is_call(node, _fia_target()) and node.kwargs.get("block_table") is None and \
        _gather_under(node.args[1]) is not None


def explain(node):
    gather = _gather_under(node.args[1])
    cache = tensor_meta(gather.args[0])
    if is_call(gather, aten.index.Tensor) and cache is not None and cache.dim() == 4:
        return ("the keys are gathered block by block from a paged cache, but not as the forms read it: key and "
                "value through one block table, each viewed (B, blocks * block_size, N, D) and transposed to BNSD")
    indices = gather.args[2] if is_call(gather, aten.index_select.default, aten.gather.default) else gather.args[1]
    if isinstance(indices, (list, tuple)):
        indices = next((i for i in indices if i is not None), None)
    while is_call(indices, aten._to_copy.default, aten.view.default, aten.reshape.default, aten.flatten.using_ints):
        indices = indices.args[0]
    if isinstance(indices, torch.fx.Node) and indices.op == "placeholder":
        return ("the keys are gathered at slots that are a graph input (transformers' PagedAttentionCache passes "
                "read_index, computed on the host): nothing in the graph proves slot = block_table[b, p // "
                "block_size] * block_size + p % block_size, so FIA cannot read the cache through a block table")
    return ("the keys are gathered at slots the graph computes, but not as block_table[b, p // block_size] * "
            "block_size + p % block_size with one block size and p = arange(L): the layout is not proven")


PASS = FusionPass(
    name="paged_attention",
    fused_op=FIA_OP,
    forms=FORMS,
    example={
        # B=2 sequences of M=3 blocks of 5 slots, 4 blocks in the cache; N=4 query heads over N_kv=2, D=8.
        # The block size 5 marks the scalar in the slot arithmetic: no other size of the trace is 5
        "query": lambda dtype: torch.empty(2, 4, 1, 8, dtype=dtype),
        "key_cache": lambda dtype: torch.empty(4, 5, 2, 8, dtype=dtype),
        "value_cache": lambda dtype: torch.empty(4, 5, 2, 8, dtype=dtype),
        "key_rows": lambda dtype: torch.empty(20, 2, 8, dtype=dtype),
        "value_rows": lambda dtype: torch.empty(20, 2, 8, dtype=dtype),
        "block_table": lambda dtype: torch.tensor([[0, 3, 1], [2, 0, 1]]),
        "positions": lambda dtype: torch.arange(15),
        "value_positions": lambda dtype: torch.arange(15),
        "block_size": 5,
        "atten_mask": lambda dtype: torch.zeros(2, 1, 1, 15, dtype=torch.bool),
        "scale": 2.0**-3,
    },
    example_variants=[
        # prefill: 3 queries
        {"query": lambda dtype: torch.empty(2, 4, 3, 8, dtype=dtype),
         "atten_mask": lambda dtype: torch.zeros(2, 1, 3, 15, dtype=torch.bool)},
        # one key head (MQA): the transposed gather is contiguous, no copy before FIA
        {"key_cache": lambda dtype: torch.empty(4, 5, 1, 8, dtype=dtype),
         "value_cache": lambda dtype: torch.empty(4, 5, 1, 8, dtype=dtype),
         "key_rows": lambda dtype: torch.empty(20, 1, 8, dtype=dtype),
         "value_rows": lambda dtype: torch.empty(20, 1, 8, dtype=dtype)},
    ],
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (_fia_target(),),
    explain=explain,
    verify_input=lambda name, args: _verification_input(name, args),
    # it rewrites the FIA the attention pass makes of the gathered keys
    after=("attention",),
)


def _verification_input(name, args):
    """For FusionConfig(verify=True): a table of block ids inside the cache, and the arange."""
    if name == "block_table":
        cache = args.get("key_cache")
        blocks = int(cache.shape[0]) if cache is not None else int(args["key_rows"].shape[0]) // args["block_size"]
        shape = [int(s) for s in args["block_table"].shape]
        return torch.randint(0, blocks, shape, dtype=args["block_table"].dtype)
    if name in ("positions", "value_positions"):
        return torch.arange(int(args[name].shape[0]))
    return None
