"""Programmatic dependent launch for the engine's Triton kernels (app/llm/pdl.py): the switch, the rule
that keeps the chain of early launches sound (every taking-part kernel waits first, and every launch of
it passes the switch), and on a Hopper GPU an engine with it on answering as with it off."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from app.llm import pdl
from helpers import collect

ROOT = Path(__file__).resolve().parent.parent
KERNEL_FILES = ("kernels.py", "moe_routing.py", "fused_moe.py", "gemv.py", "attention.py")


def test_the_switch_stays_off_without_a_hopper_gpu():
    assert pdl.enable(True, torch.device("cpu")) is False and pdl.on() is False
    assert pdl.enable(True, None) is False
    assert pdl.args() == {"PDL": False}


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Every function under a `triton.jit` decorator (called with options or not)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith("triton.jit")
                for d in node.decorator_list):
            out[node.name] = node
    return out


def _launches(tree: ast.Module, names) -> list[tuple[str, ast.Call]]:
    """Calls of the form `name[grid](...)`: the launches of those jit functions."""
    return [(ast.unparse(n.func.value), n) for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Subscript) and ast.unparse(n.func.value) in names]


def _jit_kernels(tree: ast.Module) -> list[ast.FunctionDef]:
    """The jit functions launched as kernels in the same file (the others are helpers they call)."""
    fns = _jit_functions(tree)
    launched = {name for name, _ in _launches(tree, fns)}
    return [fn for name, fn in fns.items() if name in launched]


def _first_statement(fn: ast.FunctionDef) -> str:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # a docstring
        body = body[1:]
    return ast.unparse(body[0])


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_every_engine_kernel_waits_first_and_every_launch_passes_the_switch(name):
    """A kernel launched early must wait for the one before it before it reads anything, and every program
    must wait before it may return (else its grid could end before the grid it depends on, and the next
    kernel's wait would cover neither): `enter(PDL)` first. A launch without `pdl.args()` would compile the
    kernel without the wait while the switch says on."""
    tree = ast.parse((ROOT / "app" / "llm" / name).read_text())
    kernels = _jit_kernels(tree)
    assert kernels
    for fn in kernels:
        assert "PDL" in [a.arg for a in fn.args.args], fn.name
        assert _first_statement(fn) == "enter(PDL)", fn.name
    for target, call in _launches(tree, {fn.name for fn in kernels}):
        assert any(k.arg is None and ast.unparse(k.value) == "pdl.args()" for k in call.keywords), target


def test_kernels_that_take_part_live_only_in_the_checked_files():
    """Kernels elsewhere in app/llm (the sampler's, the log-probabilities') do not take part: launched
    without the attribute, they wait for the whole grid before them, which keeps the chain. A file that
    starts launching with the switch must join KERNEL_FILES, so that the rule above checks it."""
    for path in sorted((ROOT / "app" / "llm").glob("*.py")):
        if path.name in (*KERNEL_FILES, "pdl.py"):
            continue
        assert "launch_pdl" not in path.read_text() and "pdl.args()" not in path.read_text(), path.name


def test_the_check_sees_a_kernel_that_reads_before_it_waits():
    tree = ast.parse('''
@triton.jit(do_not_specialize=["n"])
def add_one(x_ptr, n, PDL: tl.constexpr):
    v = tl.load(x_ptr)
    enter(PDL)

def launch(x):
    add_one[(1,)](x, 1, **pdl.args())
''')
    (fn,) = _jit_kernels(tree)  # found by its launch, whatever its name and decorator form
    assert fn.name == "add_one" and _first_statement(fn) != "enter(PDL)"


needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                  reason="needs a Hopper GPU (compute capability 9 or later)")


@pytest.mark.gpu
@needs_hopper
def test_an_engine_with_pdl_answers_as_without(tmp_path):
    """The tiny MoE engine in float32 on CUDA, decode and step graphs on, greedy: the same tokens with the
    kernels launched early as without, for single streams (the one- and two-token paths) and a batch."""
    from app.checkpoints.model_builder import resolve_model
    from app.llm.engine import Engine
    from app.llm.sampling import SamplingParams
    from app.llm.sequence import GenerationRequest

    path = str(resolve_model("embedded:tiny-qwen3-vl-moe", str(tmp_path)))

    def reqs(n):
        return [GenerationRequest(list(range(5 + i, 60 + i)), [0] * 55, [],
                                  SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for i in range(n)]

    answers = {}
    try:
        for on in (True, False):
            engine = Engine(path, "cuda", dtype="float32", pdl=on, max_num_seqs=8)
            try:
                assert pdl.on() is on
                single = [[t for c in engine.generate(r) for t in c.token_ids] for r in reqs(2)]
                batch = [collect(s)[0] for s in [engine.submit(r) for r in reqs(6)]]
                answers[on] = (single, batch)
                assert engine.graph_steps > 0
            finally:
                engine.shutdown()
    finally:
        pdl.enable(False)
    assert answers[True] == answers[False]
