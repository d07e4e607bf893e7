"""What an LLM replica's start pays for reading its checkpoint's settings: our readers against transformers'.

Each variant runs in a fresh process, after the imports a replica makes before its constructor
(`deployments.llm`, which imports torch):
- `ours`: the tower's settings from config.json (app/vision/qwen3_config.py) and the tokenizer through
  the class it declares (app/checkpoints/tokenizer_loader.py), as replicas do since 2026-12-02;
- `transformers`: `AutoConfig.from_pretrained` and `AutoTokenizer.from_pretrained`, as they did before.

`config_s` is the tower's settings (with transformers, `AutoConfig`'s import and call), `tokenizer_s` the
tokenizer (its import included), `settings_s` both: the figure to compare. The variants alternate, each
first in turn.

On the GPU image (transformers 5.17) `AutoConfig.from_pretrained` took 6.9-7.5 s and imported
`torch._dynamo` and sympy. Prints one line per run and writes them as JSON with --out.

    python3 benchmarks/replica_imports.py [--checkpoint DIR] [--runs 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.time()
import torch  # noqa: F401
import deployments.llm  # noqa: F401
t1 = time.time()
path, variant = sys.argv[1], sys.argv[2]
if variant == "ours":
    from app.checkpoints.tokenizer_loader import load_tokenizer
    from app.vision.qwen3_config import Qwen3VisionConfig
    cfg = Qwen3VisionConfig.from_checkpoint(path)
    t2 = time.time()
    tok = load_tokenizer(path)
else:
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path).vision_config
    t2 = time.time()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
t3 = time.time()
import transformers
print(json.dumps({"variant": variant, "transformers": transformers.__version__,
                  "replica_imports_s": round(t1 - t0, 2), "config_s": round(t2 - t1, 2), "tokenizer_s": round(t3 - t2, 2),
                  "settings_s": round(t3 - t1, 2), "dynamo_imported": "torch._dynamo" in sys.modules,
                  "modules": len(sys.modules), "tokenizer_class": type(tok).__name__, "depth": cfg.depth}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="a Qwen3-VL checkpoint folder (default: the 2B preset's config)")
    p.add_argument("--runs", type=int, default=2, help="fresh processes per variant, alternating")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    root = Path(__file__).resolve().parent.parent
    path = a.checkpoint
    if path is None:
        from app.checkpoints.model_builder import build_checkpoint

        path = tempfile.mkdtemp(prefix="replica-imports-")
        build_checkpoint(path, preset="qwen3-vl-2b", with_weights=False)
    rows = []
    try:
        for i in range(a.runs):  # alternating, each side first in turn
            for variant in (("ours", "transformers") if i % 2 == 0 else ("transformers", "ours")):
                out = subprocess.run([sys.executable, "-c", CHILD, str(path), variant], capture_output=True,
                                     text=True, cwd=root)
                if out.returncode != 0:
                    raise SystemExit(f"{variant}: exit {out.returncode}\n{out.stderr[-4000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if a.checkpoint is None:
            shutil.rmtree(path, ignore_errors=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
