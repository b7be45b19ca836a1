"""Module float attributes that dynamo lifted into graph inputs, made constants again.

Under `torch.compile(..., dynamic=True)` dynamo does not specialise Python floats
(torch._dynamo.config.specialize_float is False): a float attribute of a module, such as
an RMSNorm's `self.variance_epsilon`, reaches the graph as a 0-d float64 tensor input read
by `.item()`. The fused ops take such values as attributes (npu_rms_norm's epsilon), and a
value read from a tensor at run time cannot be one.

What dynamo does without dynamic=True is the model here: it specialises a float on the
first compile (a constant in the graph and a guard on its value, so that a new value
recompiles), and lifts it into an input only once the value has changed (automatic
dynamic). `specialize_module_floats` does the same for module attributes, in the dynamo
graph before aot_autograd traces it: each `.item()` of such an input becomes the value
dynamo passed, and a CONSTANT_MATCH guard on the attribute is added to the frame being
compiled (the guards are built after the backend returns), so a changed value compiles
again instead of running with the old constant. An attribute seen with another value
before stays an input from then on, as dynamo's automatic dynamic would leave it.
Function arguments are never specialised: they are the inputs a dynamic compile is for.
"""
from __future__ import annotations

import logging
from typing import Any, MutableMapping, Sequence

import torch
import torch.fx

log = logging.getLogger("npu_fx_fusion")


def specialize_module_floats(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                             seen: MutableMapping[str, float]) -> list[str]:
    """Make the lifted module floats of a dynamo graph constants again, guarded; returns
    their sources' names. `seen`: each attribute's value at its earlier specialisations
    (one mapping per backend, kept across its compiles)."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource, NNModuleSource
    from torch._guards import TracingContext

    if TracingContext.try_get() is None:  # not inside a dynamo compile: nothing to guard with
        return []
    specialized = []
    for node, example in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        if not (getattr(arg, "pass_arg_as_tensor", False) and isinstance(source, AttrSource)
                and isinstance(source.base, NNModuleSource)):
            continue
        if not (isinstance(example, torch.Tensor) and example.dim() == 0 and example.is_floating_point()):
            continue
        reads = list(node.users)
        if not reads or any(u.op != "call_method" or u.target != "item" for u in reads):
            continue  # used as a tensor too: leave it
        name, value = source.name, float(example.item())
        if name in seen and seen[name] != value:
            continue  # it changed since: a runtime input from now on
        for read in reads:
            for user in list(read.users):
                user.args = torch.fx.node.map_aggregate(user.args, lambda a: value if a is read else a)
                user.kwargs = torch.fx.node.map_aggregate(user.kwargs, lambda a: value if a is read else a)
            gm.graph.erase_node(read)
        install_guard(source.make_guard(GuardBuilder.CONSTANT_MATCH))
        seen[name] = value
        specialized.append(name)
    if specialized:
        gm.recompile()
        log.info("module floats made constants (guarded): %s", ", ".join(specialized))
    return specialized
