"""Sum py-spy's collapsed stacks (`py-spy record --format raw --threads`) per process: where the CPU goes.

For each file: samples per thread, the functions with the most samples of their own (self), and the
functions with the most samples anywhere in the stack (inclusive), each as a share of the process's
samples. `benchmarks/pyspy_sampler.py` (goodput.py --pyspy, gpu_profile_serving.sh) writes one file per
serving process.

    python3 benchmarks/pyspy_summary.py DIR_OR_FILES... [--top 15]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def short(frame: str) -> str:
    """`func (path/to/module.py:123)` -> `func (module.py)`: lines merged, so a function counts once."""
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    return f"{m['func']} ({Path(m['file']).name})"


def summarise(path: Path, top: int) -> str:
    threads, self_c, incl = Counter(), Counter(), Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else "?"
        body = [short(f) for f in frames if not f.startswith(("thread", "process"))]
        total += n
        threads[thread] += n
        if body:
            self_c[body[-1]] += n
        for f in set(body):
            incl[f] += n
    if not total:
        return f"## {path.name}: no samples\n"
    out = [f"## {path.name}: {total} samples"]
    out += ["| thread | share |", "|---|---|"]
    out += [f"| {t[:60]} | {n / total:.2f} |" for t, n in threads.most_common(6)]
    for title, c in (("self", self_c), ("inclusive", incl)):
        out += ["", f"| {title} | share |", "|---|---|"]
        out += [f"| {f[:110]} | {n / total:.3f} |" for f, n in c.most_common(top)]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    files = [f for p in args.paths for f in (sorted(p.glob("*.txt")) if p.is_dir() else [p])]
    for f in files:
        if f.name in ("processes.txt", "serve.txt"):
            continue
        print(summarise(f, args.top))


if __name__ == "__main__":
    main()
