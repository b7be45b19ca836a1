"""What the three tensor-parallel passes check alike (matmul_all_reduce, all_gather_matmul,
matmul_reduce_scatter): the limits their ops (MC2 kernels: one collective overlapped with
one matmul) share, read from each op's capability row.

Not a pass (no PASS): the catalog skips modules whose name starts with "_". It holds checks
only; the forms each pass matches are written out in its own module.
"""
import torch

from npu_fx_fusion.capabilities import CAPABILITIES
from npu_fx_fusion.matching import group_size, is_call, is_training_graph, no_communicator_reason

# the ops of this family: on Atlas A2 every one of them in a model must run on one
# communication domain (each op's doc: 一个模型中的通算融合算子(AllGatherMatmul、MatmulReduceScatter、
# MatmulAllReduce)，仅支持相同通信域)
MC2_MATMUL_OPS = ("npu.npu_mm_all_reduce_base", "npu.npu_all_gather_base_mm", "npu.npu_mm_reduce_scatter_base")
ONE_DOMAIN_SOC = "Ascend910B"


def world_sizes(op, soc):
    """The rank counts `op` takes on `soc` (None: any SoC it supports, the union)."""
    sizes = CAPABILITIES[op].limits["world_sizes"]
    if not isinstance(sizes, dict):
        return tuple(sizes)
    if soc in sizes:
        return tuple(sizes[soc])
    return tuple(sorted({n for per_soc in sizes.values() for n in per_soc}))


def group_reason(op, group_name, soc, world_size=None):
    """Why `op` cannot run on the c10d group `group_name`, or None: the group must exist here
    (and be an HCCL group where torch_npu's real op runs), with a rank count the op takes, the
    collective's `world_size` if it names one (world_size必须等于实际通信域中的rank总数)."""
    reason = no_communicator_reason(group_name)
    if reason:
        return reason
    ranks, allowed = group_size(group_name), world_sizes(op, soc)
    if world_size is not None and world_size != ranks:
        return f"the collective names {world_size} ranks, its group has {ranks}"
    if ranks not in allowed:
        where = f" on {soc}" if soc else ""
        return f"the group has {ranks} ranks: {op} takes {', '.join(map(str, allowed))}{where}"
    return None


def k_range_reason(op, k):
    """The contracted dim k against the op's documented [low, high) range, or None."""
    low, high = CAPABILITIES[op].limits["k_range"]
    if not low <= k < high:
        return f"k = {k} (the contracted dim, local to the rank) is outside {op}'s [{low}, {high})"
    return None


def same_dtype_reason(op, x, weight):
    if weight.dtype != x.dtype:
        return f"{op} takes x1 and x2 of one dtype, got {str(x.dtype)[6:]} and {str(weight.dtype)[6:]}"
    return None


def training_only_reason(op):
    return (f"{op} is documented for inference only (该接口支持推理场景下使用) and has no backward: "
            "this is a training graph")


def scenario_choice(site, op, mode_argument_form):
    """Which of a training / inference pair of replacements fits the graph: the op's default
    communication mode (ai_cpu) is documented for training, comm_mode="aiv" for training and
    inference; torchair 2.13's GE converters (max-autotune) refuse any comm_mode on A2/A3.
    `mode_argument_form`: whether this site's form emits comm_mode="aiv" (the passes try it
    first: where both refuse, an inference graph in max-autotune, its reason is reported).
    None, or why not."""
    limits = CAPABILITIES[op].limits
    training = is_training_graph(site.nodes[0].graph)
    if not mode_argument_form:
        if training:
            return None
        return (f"{op} in its default communication mode (ai_cpu) is documented for training only "
                "(comm_mode为ai_cpu时：该接口仅在训练场景下使用): this is an inference graph")
    if training:
        return "a training graph takes the default communication mode (ai_cpu, documented for training)"
    if site.mode == "max-autotune" and not limits["ge_comm_mode"]:
        return (f"an inference graph needs {op}(comm_mode='aiv'), and torchair 2.13's GE converter refuses "
                "comm_mode on Atlas A2/A3: max-autotune cannot lower it")
    if site.mode is None:
        site.notes.append("comm_mode='aiv' (the mode documented for inference): max-autotune on Atlas A2/A3 "
                          "cannot lower it (torchair 2.13's GE converter refuses comm_mode there)")
    return None


def one_domain_reason(site, hcom):
    """Atlas A2: every MC2 matmul op of a model on one communication domain. A graph shows its
    own sites only (other graphs of the model are not seen): one already fused here on another
    group refuses this one on A2; in emulation the site fuses and says so."""
    others = {str(node.args[2]) for op in MC2_MATMUL_OPS
              for node in site.nodes[0].graph.find_nodes(op="call_function", target=_target(op))
              if len(node.args) > 2 and node.args[2] != hcom}
    if not others:
        if site.soc in (None, ONE_DOMAIN_SOC):
            site.notes.append("on Atlas A2 every MC2 op of a model must use one communication domain "
                              "(the ops' docs); this graph's use one")
        return None
    reason = (f"this graph already fuses an MC2 op on the communication domain(s) {sorted(others)}: on Atlas A2 "
              "all of a model's MC2 ops must share one")
    return site.hardware_limits([reason]) if site.soc in (None, ONE_DOMAIN_SOC) else None


def _target(op):
    namespace, name = op.split(".")
    return getattr(getattr(torch.ops, namespace), name).default


# ---- near misses: what a functional collective is fed by, or feeds ------------------------------
C10D = torch.ops._c10d_functional
WAIT = C10D.wait_tensor.default


def waited(node):
    """The wait_tensor that completes the functional collective `node`, or None."""
    return next((user for user in node.users if is_call(user, WAIT)), None)


def describe(node):
    return f"{node.name} ({node.target})" if isinstance(node, torch.fx.Node) else repr(node)
