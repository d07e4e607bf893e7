"""A tensor-parallel engine pair in lockstep (CPU, gloo): rank 0 takes requests, rank 1 follows its steps.
Their answers equal one engine holding the whole model: greedy and seeded sampling, images with
deepstack features, several choices of one request, a prompt longer than a step's token budget; a
request cancelled mid-stream ends alone; the follower stops with the leader."""

from __future__ import annotations

import pickle
import socket

import pytest
import torch
import torch.multiprocessing as mp

from helpers import collect, make_request

KW = dict(max_num_batched_tokens=32, block_size=4, overlap_steps=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(engine, reqs) -> list[list[list[int]]]:
    """Per request, per choice, the tokens (all requests queued at once, then read)."""
    seqs = [engine.submit_choices(r, [None] * r.params.n) for r in reqs]
    return [[collect(seq)[0] for seq in choices] for choices in seqs]


def _rank(rank: int, port: int, path: str, reqs_file: str, out: str) -> None:
    import torch.distributed as dist

    from app.llm.engine import Engine
    from app.llm.lockstep import Channel
    from app.llm.parallel import TensorParallel
    from app.llm.stream import Cancelled

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    try:
        tp = TensorParallel(rank, 2)
        spec_hidden = 64  # the tiny preset's
        channel = Channel(rank, group, None, torch.device("cpu"), spec_hidden, torch.float32)
        engine = Engine(path, "cpu", tp=tp, lockstep=channel, **KW)
        if rank == 0:
            with open(reqs_file, "rb") as f:
                reqs, cancel_me = pickle.load(f)
            answers = _answers(engine, reqs)
            seq = engine.submit(cancel_me)
            first = seq.next_chunk(timeout=120)
            seq.cancel()
            reason = None
            try:
                while not reason:
                    reason = seq.next_chunk(timeout=120).finish_reason
            except Cancelled:  # how a reader learns that its request was cancelled
                reason = "cancelled"
            after = _answers(engine, reqs[:1])  # the pair still serves after a cancellation
            torch.save({"answers": answers, "after": after, "cancel": (first.token_ids, reason)}, out)
            engine.shutdown()  # sends the followers the word to stop
        else:
            engine._thread.join(timeout=300)
            assert not engine._thread.is_alive(), "the follower did not stop with the leader"
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def requests(world):
    reqs = [make_request(world, [])[0],
            make_request(world, ["image"], data_seed=1, words=3, temperature=0.8, seed=7)[0],
            make_request(world, ["image", "image"], data_seed=2, words=30, max_tokens=6)[0],  # 2 chunks
            make_request(world, [], data_seed=3, words=2, temperature=1.0, seed=3, n=3)[0]]
    cancel_me = make_request(world, ["image"], data_seed=4, max_tokens=200, ignore_eos=True)[0]
    return reqs, cancel_me


def test_a_lockstep_pair_answers_as_one_engine(tiny_checkpoint, requests, tmp_path):
    from app.llm.engine import Engine

    reqs, cancel_me = requests
    single = Engine(str(tiny_checkpoint), "cpu", **KW)
    want = _answers(single, reqs)
    single.shutdown()
    reqs_file, out = str(tmp_path / "reqs.pkl"), str(tmp_path / "out.pt")
    with open(reqs_file, "wb") as f:
        pickle.dump((reqs, cancel_me), f)
    mp.spawn(_rank, args=(_free_port(), str(tiny_checkpoint), reqs_file, out), nprocs=2, join=True)
    got = torch.load(out)
    assert got["answers"] == want
    assert len(got["answers"][3]) == 3 and len(set(map(tuple, got["answers"][3]))) > 1  # three different draws
    assert got["after"] == want[:1]
    first_tokens, reason = got["cancel"]
    assert first_tokens and reason == "cancelled"


def _rank_faults(rank: int, port: int, path: str, reqs_file: str, out: str) -> None:
    """Short collective timeouts (the ticks' group 2 s, the model's 15 s) and a 0.3 s idle turn: the pair
    idles for 4 s and then answers (the empty turns kept the follower's wait alive); then the leader's
    third launch raises, and the group stops: its request and any later one get a 503, both ranks report
    themselves dead (the follower once its collective times out, with nobody to pair with)."""
    from datetime import timedelta

    import torch.distributed as dist

    import app.llm.engine as engine_module
    from app.errors import Unavailable
    from app.llm.engine import Engine
    from app.llm.lockstep import Channel
    from app.llm.parallel import TensorParallel

    torch.set_num_threads(1)
    engine_module.LOCKSTEP_IDLE_TURN_S = 0.3
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=15))
    ticks = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    try:
        channel = Channel(rank, ticks, None, torch.device("cpu"), 64, torch.float32)
        engine = Engine(path, "cpu", tp=TensorParallel(rank, 2), lockstep=channel, **KW)
        if rank == 0:
            with open(reqs_file, "rb") as f:
                reqs, long_one = pickle.load(f)
            import time

            time.sleep(4)  # twice the ticks' timeout, idle
            after_idle = _answers(engine, reqs[:1])
            launch, calls = engine.runner.launch, []

            def failing(plan, previous):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected on rank 0 only")
                return launch(plan, previous)

            engine.runner.launch = failing
            seq, error = engine.submit(long_one), None
            try:
                while not seq.next_chunk(timeout=120).finish_reason:
                    pass
            except Unavailable as e:
                error = e
            try:
                engine.submit(reqs[0])
                refused = None
            except Unavailable as e:
                refused = e
            engine._thread.join(timeout=30)
            torch.save({"after_idle": after_idle, "status": getattr(error, "status", None),
                        "refused": getattr(refused, "status", None), "alive": engine.alive,
                        "thread": engine._thread.is_alive()}, out)
        else:
            engine._thread.join(timeout=120)
            torch.save({"alive": engine.alive, "thread": engine._thread.is_alive(),
                        "broken": repr(engine.broken)}, out + ".follower")
    finally:
        dist.destroy_process_group()


def test_an_idle_pair_keeps_step_and_a_step_failed_on_one_rank_stops_the_group(tiny_checkpoint, requests,
                                                                              world, tmp_path):
    from app.llm.engine import Engine

    reqs, _ = requests
    long_one = make_request(world, [], data_seed=5, max_tokens=40, ignore_eos=True)[0]
    single = Engine(str(tiny_checkpoint), "cpu", **KW)
    want = _answers(single, reqs[:1])
    single.shutdown()
    reqs_file, out = str(tmp_path / "reqs.pkl"), str(tmp_path / "out.pt")
    with open(reqs_file, "wb") as f:
        pickle.dump((reqs, long_one), f)
    mp.spawn(_rank_faults, args=(_free_port(), str(tiny_checkpoint), reqs_file, out), nprocs=2, join=True)
    leader, follower = torch.load(out), torch.load(out + ".follower")
    assert leader["after_idle"] == want
    assert leader["status"] == 503 and leader["refused"] == 503
    assert not leader["alive"] and not leader["thread"]
    assert not follower["alive"] and not follower["thread"], follower
