"""Generated: each pass's patterns, precompiled (npu_fx_fusion/registry.py explains the format
and when a file is used). Regenerate with `python scripts/precompile_patterns.py`."""
