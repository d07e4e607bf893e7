"""cProfile of whole 1000-token prefill steps (scheduling, inputs, launch, collect) run synchronously on
this thread: where a prefill step's host time goes (2B shape, one GPU). Prints the steps' host and wall
ms from the engine's step log, then the profile by own time and by cumulative time.

    python3 benchmarks/llm_prefill_host_profile.py
"""

import cProfile
import io
import pstats
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.checkpoints.model_builder import build_tokenizer, load_preset  # noqa: E402
from app.llm.engine import Engine  # noqa: E402
from app.llm.sampling import SamplingParams  # noqa: E402
from app.llm.sequence import GenerationRequest  # noqa: E402


def main() -> None:
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    cfg = AutoConfig.for_model(**load_preset("qwen3-vl-2b"))
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16).eval()
    model.model.visual = None
    eng = Engine.from_model(model, build_tokenizer(), "cuda", max_model_len=4096, max_num_seqs=256,
                            gpu_memory_utilization=0.5, overlap_steps=False)
    eng.shutdown()  # its thread stops: the steps run here, under the profiler
    rng = np.random.default_rng(0)

    def one():
        ids = rng.integers(0, 150000, 1000).tolist()
        seq = eng.submit(GenerationRequest(ids, [0] * 1000, [], SamplingParams(max_tokens=1, temperature=0,
                                                                               ignore_eos=True)), sink=lambda d: None)
        eng._inbox.clear()
        eng.scheduler.add(seq)
        with torch.inference_mode():
            while eng.scheduler.has_work():
                eng._step()

    for _ in range(5):
        one()
    eng.step_log.clear()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(30):
        one()
    pr.disable()
    print("steps host/wall ms", [(round(1e3 * r[3], 2), round(1e3 * r[4], 2)) for r in list(eng.step_log)[:8]])
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30)
        print(s.getvalue())


if __name__ == "__main__":
    main()
