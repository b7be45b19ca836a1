"""Test helpers that run torchair's real Python pipeline on CPU (no NPU, no CANN).

- stubs.bootstrap(dir): make torchair / npugraph_ex importable from the torch-npu wheel
  that scripts/fetch_torch_npu.sh unpacked into `dir`;
- runner.run_scenario(fn, **kwargs): run `fn` in a fresh subprocess behind those stubs and
  return its JSON result (skips the test when the wheel folder is missing, unless
  NPU_FX_FUSION_REQUIRE_WHEEL is set).

Importing this package imports neither torch nor torchair: the stubs must be in place
before torch is imported.
"""
