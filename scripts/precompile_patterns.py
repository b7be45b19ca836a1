"""Write patterns/_precompiled/<pass>.py for every pass (or the ones named), from the
current forms and engine: see npu_fx_fusion/registry.py. tests/test_precompiled.py fails
when a file is out of date.

    .venv/bin/python scripts/precompile_patterns.py [PASS ...]

Run it where every library a pass has forms for is importable (transformers and
torchtitan: scripts/test.sh installs both), so that every form is written.
"""
import argparse
import pathlib
import sys
import time

from npu_fx_fusion.catalog import load_pass, pass_names
from npu_fx_fusion.registry import import_optional_form_libraries, precompiled_source

OUT = pathlib.Path(__file__).resolve().parent.parent / "patterns" / "_precompiled"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("passes", nargs="*", help="pass names (default: all)")
    args = parser.parse_args()
    import_optional_form_libraries()
    for name in args.passes or pass_names():
        start = time.perf_counter()
        text = precompiled_source(load_pass(name))
        (OUT / f"{name}.py").write_text(text)
        print(f"{name}: {text.count('def _p')} patterns, {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
