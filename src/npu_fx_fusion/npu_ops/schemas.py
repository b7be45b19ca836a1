"""The torch_npu schema strings of every op npu-fx-fusion emits or calls.

Copied character for character from torch_npu 2.13.0
(`torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`); tests/test_schemas.py
compares each one with the wheel. The stand-in library registers exactly these, so a
graph rewritten on CPU is op-for-op the graph that runs on an NPU.
"""

# namespace -> {op name -> schema}
SCHEMAS: dict[str, dict[str, str]] = {
    "npu": {
        # What torch_npu records for `.to(dtype)` in aot graphs, where CPU records
        # aten._to_copy: patterns with casts are registered in both spellings.
        "_npu_dtype_cast": "_npu_dtype_cast(Tensor self, ScalarType dtype) -> Tensor",
        "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
        "npu_rms_norm_backward": (
            "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)"
        ),
        "npu_add_rms_norm": (
            "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)"
        ),
        "npu_rotary_mul": (
            "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor"
        ),
        "npu_rotary_mul_backward": (
            "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') "
            "-> (Tensor, Tensor, Tensor)"
        ),
        "npu_interleave_rope": "npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor",
        "npu_swiglu": "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
        "npu_swiglu_backward": "npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor",
        # not emitted by us: torchair's own pattern pass makes it from npu_add_rms_norm + cast
        "npu_add_rms_norm_cast": (
            "npu_add_rms_norm_cast(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
            "-> (Tensor, Tensor, Tensor, Tensor)"
        ),
    },
}
