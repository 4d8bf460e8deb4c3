"""The HTTP layer never imports MLX: only the engine thread touches it."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_server_leaves_mlx_out():
    code = ("import sys, mlx_serve.server, mlx_serve.server.http, mlx_serve.commands.serve, mlx_serve.commands.chat;"
            "assert not [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')], 'mlx was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
