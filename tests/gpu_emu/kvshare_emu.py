"""`kvshare` on the CPU emulator of CuPy: `python tests/gpu_emu/kvshare_emu.py serve --device
cuda ...` installs fakecupy as `cupy`, then runs kvshare's command line, so a real
`kvshare serve --device cuda` process runs the GPU path on the CPU (tests/test_server_gpu.py
starts its GPU servers with it where the tests themselves run on the emulator)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emu_plugin  # noqa: E402, F401 - installs fakecupy as `cupy`, as pytest's -p emu_plugin

from kvshare.server.cli import main  # noqa: E402

sys.exit(main())
