"""``python -m support.sglang_server_launch <sglang.launch_server arguments>``: SGLang's
server with the CPU stream fix of ``support.sglang_cpu`` in every process.

SGLang starts its scheduler processes with ``spawn``; a spawned child imports the
parent's ``__main__`` module again (as ``__mp_main__``), which stays this one (SGLang's
launcher runs without ``alter_sys``), so the fix is installed there too before SGLang
builds its tree cache.
"""

from __future__ import annotations

import runpy

from support import sglang_cpu

sglang_cpu.install()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__")
