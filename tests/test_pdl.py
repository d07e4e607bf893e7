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


# Before its wait a kernel may compute offsets, and read only through these helpers, each of which loads a
# tensor that no kernel writes (a projection's weight: gemv.py's prefetch of its first tile)
READS_BEFORE_WAIT = {"_gemv_load_w"}
PURE_BEFORE_WAIT = {"tl.program_id", "tl.arange", "tl.minimum", "tl.maximum", "tl.cdiv", "tl.zeros", "tl.full"}


def _is_enter(stmt: ast.stmt) -> bool:
    return ast.unparse(stmt) == "enter(PDL)"


def _waits(stmt: ast.stmt) -> bool:
    """`enter(PDL)`, or an `if` that reaches it on both branches."""
    if _is_enter(stmt):
        return True
    return (isinstance(stmt, ast.If) and bool(stmt.orelse) and any(_waits(s) for s in stmt.body)
            and any(_waits(s) for s in stmt.orelse))


def _before_wait_breaks_the_rule(fn: ast.FunctionDef) -> str | None:
    """What the kernel does before its wait that it may not (a read of anything a kernel may write, a
    return, an atomic, a store), or that it never waits on some path; None where it keeps the rule."""
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # a docstring
        body = body[1:]
    before = []
    for stmt in body:
        if _waits(stmt):
            if isinstance(stmt, ast.If):  # what each branch does before its own wait
                for branch in (stmt.body, stmt.orelse):
                    before += branch[:next(i for i, s in enumerate(branch) if _waits(s))]
            break
        before.append(stmt)
    else:
        return "never waits"
    for node in (n for stmt in before for n in ast.walk(stmt)):
        if isinstance(node, ast.Return):
            return "returns before it waits"
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if not (name in PURE_BEFORE_WAIT or name in READS_BEFORE_WAIT or name.endswith(".to")):
                return f"calls {name} before it waits"
    return None


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_every_engine_kernel_waits_first_and_every_launch_passes_the_switch(name):
    """A kernel launched early must wait for the one before it before it reads anything a kernel may have
    written, and every program must wait before it may return (else its grid could end before the grid it
    depends on, and the next kernel's wait would cover neither): `enter(PDL)` first, or after offsets and
    weight reads only (READS_BEFORE_WAIT). A launch without `pdl.args()` would compile the kernel without
    the wait while the switch says on."""
    tree = ast.parse((ROOT / "app" / "llm" / name).read_text())
    kernels = _jit_kernels(tree)
    assert kernels
    for fn in kernels:
        assert "PDL" in [a.arg for a in fn.args.args], fn.name
        assert _before_wait_breaks_the_rule(fn) is None, (fn.name, _before_wait_breaks_the_rule(fn))
    for target, call in _launches(tree, {fn.name for fn in kernels}):
        assert any(k.arg is None and ast.unparse(k.value) == "pdl.args()" for k in call.keywords), target


def test_the_weight_prefetch_reads_only_weights():
    """gemv's pre-wait helper loads from the pointer it is given; the kernel gives it the weight's."""
    kernel = list(ast.walk(_jit_functions(ast.parse((ROOT / "app" / "llm" / "gemv.py").read_text()))["_gemv_kernel"]))
    calls = [n for n in kernel if isinstance(n, ast.Call) and ast.unparse(n.func) in READS_BEFORE_WAIT]
    assert calls and all(ast.unparse(c.args[0]) == "w_ptrs" for c in calls)
    w_ptrs = [n for n in kernel if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "w_ptrs"]
    assert len(w_ptrs) == 1 and ast.unparse(w_ptrs[0].value).startswith("w_ptr +")


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

@triton.jit
def half_waits(x_ptr, W: tl.constexpr, PDL: tl.constexpr):
    i = tl.program_id(0)
    if W:
        enter(PDL)
    v = tl.load(x_ptr + i)

@triton.jit
def leaves_early(x_ptr, w_ptrs, PDL: tl.constexpr):
    if tl.program_id(0) > 3:
        return
    enter(PDL)

@triton.jit
def prefetches(w_ptr, PDL: tl.constexpr):
    w_ptrs = w_ptr + tl.arange(0, 16)
    if PDL:
        w = _gemv_load_w(w_ptrs)
        enter(PDL)
    else:
        enter(PDL)
        w = _gemv_load_w(w_ptrs)

def launch(x):
    add_one[(1,)](x, 1, **pdl.args())
    half_waits[(1,)](x, **pdl.args())
    leaves_early[(1,)](x, x, **pdl.args())
    prefetches[(1,)](x, **pdl.args())
''')
    found = {fn.name: _before_wait_breaks_the_rule(fn) for fn in _jit_kernels(tree)}  # by launch, any decorator form
    assert found == {"add_one": "calls tl.load before it waits", "half_waits": "never waits",
                     "leaves_early": "returns before it waits", "prefetches": None}


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
