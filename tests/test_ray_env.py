"""deployments/ray_env.py: the variables Ray must start with, without overriding the user's."""

import os
import subprocess
import sys

from deployments.ray_env import SERVE_ENV


def run(env: dict) -> str:
    return subprocess.run([sys.executable, "-m", "deployments.ray_env"], env=env, capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()


def test_defaults_are_set_and_explicit_values_win():
    base = {k: v for k, v in os.environ.items() if k not in SERVE_ENV}
    assert run(base) == [f"{k}={v}" for k, v in SERVE_ENV.items()]
    off = run(base | {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"})
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED=0" in off and "RAY_SERVE_ENABLE_DIRECT_INGRESS=0" in off
