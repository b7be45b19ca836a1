"""The catalog: one module per fusion, named after its pass (npu_fx_fusion.config.PASS_NAMES).

Each module defines `PASS`, a npu_fx_fusion.matching.FusionPass: the unfused forms as
plain PyTorch functions, the fused call that replaces them, the check that says why a
match must not be fused, and the anchor that finds candidate sites for near misses.
The pipeline imports a module only when its pass runs. docs/adding-a-pattern.md walks
through writing one.
"""
