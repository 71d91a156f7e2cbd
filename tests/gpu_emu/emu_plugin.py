"""pytest plugin (`-p emu_plugin`, with tests/gpu_emu on PYTHONPATH): installs the CPU
emulation of CuPy (fakecupy) as `cupy` before any test module imports it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fakecupy  # noqa: E402

fakecupy.install()
