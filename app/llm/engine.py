"""The LLM engine: requests in, token ids out, one step at a time on a thread of its own.

    submit() ──> inbox ──> Scheduler.schedule() ──> ModelRunner.launch/collect ──> emit()

A step is the scheduler's plan (decodes plus prefill chunks under a token budget), run by the model
runner, then turned into one `TokenDelta` per request that advanced; `emit` gets the whole step's
deltas in one call (the LLM deployment hands them to its event loop once per step). What a request
needs beyond the step (M-RoPE positions, prefix-cache keys, its embeddings on the device,
validation) is prepared in `submit`, on the caller's thread. With `llm.overlap_steps` step N+1 is
planned and launched before step N's tokens are read: a sequence's token from step N is a
placeholder that step N+1 takes on the device (docs/concepts/engine.md, "Overlapped steps").
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ..config import LLMConfig
from ..errors import ClientError, Overloaded, Unavailable
from ..gpu.timing import GpuTimer
from . import pdl
from .block_manager import BlockManager
from .gemv import choose_gemv, gemv_cache_for
from .grammar import Grammars
from .loader import load_checkpoint, load_in_memory, resolve_dtype, vision_token_ids
from .lockstep import Channel, Tick, describe, rebuild
from .model_runner import LaunchedStep, ModelRunner
from .mrope import Rope
from .parallel import SINGLE, TensorParallel
from .sampling import MAX_LOGPROBS
from .scheduler import Scheduler
from .sequence import GenerationRequest, Sequence, Status, VisionInput
from .stream import Chunk, OutputStream, ThreadReader, TokenDelta

log = logging.getLogger(__name__)

__all__ = ["Chunk", "Engine", "GenerationRequest", "VisionInput"]

STEP_LOG = 8192  # steps kept for host-time statistics
# An idle tensor-parallel leader sends an empty turn this often: a follower waits for the next tick in a
# gloo broadcast, which raises after its group's timeout (30 minutes by default), and a follower whose
# thread died so would take the replica down at its first request after a quiet half hour.
LOCKSTEP_IDLE_TURN_S = 60.0


class Engine:
    """`Engine(path, device, config)` loads a checkpoint; `Engine.from_model(hf_model, tokenizer, device)`
    takes a transformers model in memory. Keyword overrides set LLMConfig fields, e.g.
    `Engine(path, "cuda", max_num_seqs=64)`. `tp`: this process's rank of a tensor-parallel group
    (parallel.py); with `lockstep` (lockstep.py) rank 0 takes requests and the other ranks follow
    its steps. `tune_dir`: where the start-up's matrix-vector choice is kept for the next replica
    (gemv.gemv_cache_for; None: timed at every start)."""

    def __init__(self, path: str | None = None, device: str = "cpu", config: LLMConfig | None = None, *,
                 model=None, tokenizer=None, tp: TensorParallel = SINGLE, lockstep: Channel | None = None,
                 tune_dir: str | None = None, **overrides):
        cfg = (config or LLMConfig()).model_copy(update=overrides)
        self.cfg = cfg
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the engine thread must use the same GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.max_model_len = cfg.max_model_len
        self.max_num_seqs = cfg.resolved_max_num_seqs(self.device.type)
        self.max_waiting = cfg.max_waiting
        t = time.time()
        if model is None:
            loaded = load_checkpoint(path, self.dtype, self.device, self.max_model_len, tp, cfg.load_format)
        else:
            loaded = load_in_memory(model, tokenizer, self.dtype, self.device, self.max_model_len, tp)
        weights = ("weights", t, time.time())
        self.model, self.tokenizer, self.eos_ids = loaded.model, loaded.tokenizer, loaded.eos_ids
        self.spec = self.model.spec
        # before anything is timed or captured: both see the launches as they will be (app/llm/pdl.py)
        pdl.enable(cfg.pdl, self.device)
        tune = cfg.decode_gemv and self.device.type == "cuda"
        gemv_cache = None
        if tune and tune_dir and path:
            gemv_cache = gemv_cache_for(tune_dir, path, self.device, self.dtype, f"{tp.size} {tp.moe}",
                                        cfg.decode_gemv_split)
        gemv = choose_gemv(self.model, cfg.decode_gemv_split, gemv_cache) if tune else None
        self.rope = Rope.from_config(loaded.config)
        self.vision_ids = vision_token_ids(loaded.config, self.tokenizer)
        self.runner = ModelRunner(self.model, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size,
                                  num_kv_blocks=cfg.num_kv_blocks,
                                  gpu_memory_utilization=cfg.gpu_memory_utilization, cuda_graphs=cfg.cuda_graphs,
                                  step_graphs=cfg.step_graphs, decode_kv_splits=cfg.decode_kv_splits)
        # (phase, start, end), wall clock: the replica reports them (app/serving/startup.py)
        self.startup = [weights, *([gemv] if gemv else []), *self.runner.startup]
        self.grammars = self.runner.grammars = Grammars(self.tokenizer, self.spec.vocab)
        self.runner.sampler.eos_ids = sorted(self.eos_ids)  # what min_tokens holds back
        self.blocks = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, self.max_num_seqs, cfg.max_num_batched_tokens)
        self.emit: Callable[[list[tuple[Sequence, TokenDelta]]], None] = self._emit_each
        self.overlap = cfg.overlap_steps if cfg.overlap_steps is not None else self.device.type == "cuda"
        self._inflight: LaunchedStep | None = None  # launched, tokens not read yet (overlap only)
        self.steps = self.graph_steps = self.step_graph_steps = 0  # steps; replayed from decode / step graphs
        # per step: seqs, tokens, graph ("decode", "step" or "" for eager), host s, wall s
        self.step_log: deque[tuple[int, int, str, float, float]] = deque(maxlen=STEP_LOG)
        # device time of each launched step, from CUDA events around the launch (app/gpu/timing.py)
        self.gpu_timer = GpuTimer(self.device)
        # The engine thread shares the GIL with whoever reads the outputs (the replica's event loop). When
        # a step's device work is done it must get the GIL back at once, and the loop its turn, not after
        # CPython's default 5 ms switch interval (which, with a busy reader, became most of a batch-64
        # step on an H200, and left the loop hundreds of ms behind the engine with 64+ streams).
        if cfg.switch_interval_ms:
            sys.setswitchinterval(cfg.switch_interval_ms / 1e3)
        self._inbox: list[Sequence] = []
        self._cv = threading.Condition()
        self._stop = False
        self.lockstep = lockstep
        self.broken: Exception | None = None  # under lockstep: the step failure that stopped this rank (`alive`)
        follower = lockstep is not None and not lockstep.leader
        if follower:
            self.emit = _discard
        self._thread = threading.Thread(target=self._follow if follower else self._loop, name="llm-engine",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model, tokenizer, device: str = "cpu", **overrides) -> Engine:
        return cls(None, device, model=model, tokenizer=tokenizer, **overrides)

    # ------------------------------------------------------------------ public
    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def kv_heads(self) -> int:
        return self.spec.kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    def submit(self, req: GenerationRequest, sink: Callable[[TokenDelta], None] | None = None) -> Sequence:
        """Queue a request of one choice. Its token deltas go to `sink` if given (the caller makes text of
        them with an `OutputStream`); otherwise `seq.next_chunk()` returns text chunks on any thread."""
        if req.params.n != 1:
            raise ValueError(f"a request of {req.params.n} choices is queued with submit_choices")
        return self.submit_choices(req, [sink])[0]

    def submit_choices(self, req: GenerationRequest, sinks: list[Callable[[TokenDelta], None] | None]
                       ) -> list[Sequence]:
        """Queue the request's `params.n` choices, one sink each (as `submit`'s). Choice i draws with
        `seed + i` when the request has a seed. The choices after the first are forks of it
        (`Sequence.fork`): they share its prompt's KV blocks and embeddings."""
        if self.broken is not None:
            raise Unavailable("this replica's tensor-parallel group failed and is being replaced; retry shortly")
        length, n = len(req.input_ids), req.params.n
        if len(sinks) != n:
            raise ValueError(f"{len(sinks)} sinks for {n} choices")
        k = req.params.logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ClientError(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
        layers = self.spec.deepstack_layers
        if any(len(v.deepstack) != layers for v in req.vision):  # the step graphs hold exactly this many
            raise ValueError(f"the vision encoder gave {[len(v.deepstack) for v in req.vision]} deepstack layers "
                             f"per item; the text model takes {layers}")
        self.check_admission(length, n)
        first = self._sequence(req)
        seed = req.params.seed
        seqs = [first] + [self._fork(first, None if seed is None else seed + i) for i in range(1, n)]
        if self.lockstep is not None:  # what the followers must queue alike (lockstep.py)
            for i, seq in enumerate(seqs):
                seq.lockstep_new = describe(seq, req, None) if i == 0 else describe(seq, None, first)
        for seq, sink in zip(seqs, sinks):
            if sink is None:
                reader = ThreadReader(OutputStream(self.tokenizer, req.params, length, _rows(req)), seq.cancel)
                seq.reader, sink = reader, reader.put
            seq.sink = sink
        with self._cv:
            if self.broken is not None:  # stopped since the check above: the loop would never take these
                raise Unavailable("this replica's tensor-parallel group failed and is being replaced; retry shortly")
            if len(self._inbox) + len(self.scheduler.waiting) + n > self.max_waiting:
                raise Overloaded()
            now = time.perf_counter()
            for seq in seqs:
                seq.queued_time = now
            if first.matcher is not None:
                self.grammars.live += n
            self._inbox.extend(seqs)
            self._cv.notify()
        return seqs

    def _sequence(self, req: GenerationRequest) -> Sequence:
        """A request's first choice, fitted to the cache and the rotary tables, with its grammar's matcher."""
        capacity = self.blocks.usable_blocks * self.blocks.block_size
        seq = Sequence(req, rope=self.rope, vision_ids=self.vision_ids, max_model_len=min(self.max_model_len, capacity),
                       block_size=self.blocks.block_size, device=self.device, dtype=self.dtype)
        self._fit_rope(seq)
        if req.params.grammar is not None:
            seq.matcher = self.grammars.matcher(req.params.grammar)
        return seq

    def _fork(self, first: Sequence, seed: int | None) -> Sequence:
        seq = first.fork(seed)
        if first.matcher is not None:
            seq.matcher = self.grammars.matcher(first.params.grammar)
        return seq

    def _fit_rope(self, seq: Sequence) -> None:
        """Positions must stay inside the rotary tables (an index past them is a device-side assert on a
        GPU, which ends every request of the replica). They run ahead of the token count where a video's
        time axis counts seconds (Qwen2.5-VL): a prompt whose positions do not fit is a 400, and the
        output is cut ("length") where its positions would leave the table."""
        rows = self.model.cos_table.shape[0]
        top = int(seq.prompt_positions.max()) if seq.prompt_len else 0
        if top >= rows:
            raise ClientError(f"the prompt's rotary positions reach {top}, beyond the {rows} this server holds "
                              "(a long video: fewer frames or a lower fps fit)", param="messages",
                              code="context_length_exceeded")
        seq.max_new = max(0, min(seq.max_new, rows - seq.prompt_len - seq.rope_delta))

    def check_admission(self, length: int, choices: int = 1) -> int:
        """Raise the ClientError `submit` would raise for a prompt of `length` tokens now (too long:
        400; queue full: 503), so that a caller can refuse before costly work such as encoding its
        media. `choices`: the request's `n`, each a sequence in the queue. Returns the KV cache's
        capacity in tokens."""
        if length < 1:  # nothing to condition on, and the scheduler reads a sequence's last token
            raise ClientError("the prompt has no tokens", param="messages", code="invalid_prompt")
        if length >= self.max_model_len:
            raise ClientError(f"prompt of {length} tokens exceeds max_model_len {self.max_model_len}",
                              param="messages", code="context_length_exceeded")
        capacity = self.blocks.usable_blocks * self.blocks.block_size
        if length >= capacity:
            raise ClientError(f"prompt of {length} tokens exceeds the KV cache ({capacity} tokens)",
                              param="messages", code="context_length_exceeded")
        if choices > max(1, self.max_waiting):  # would be refused with 503 however long the client retried
            raise ClientError(f"n={choices} exceeds the {self.max_waiting} sequences this server queues",
                              param="n")
        if len(self._inbox) + len(self.scheduler.waiting) + choices > self.max_waiting:
            raise Overloaded()
        return capacity

    def output_stream(self, req: GenerationRequest) -> OutputStream:
        """The text side of a request submitted with a `sink`."""
        return OutputStream(self.tokenizer, req.params, len(req.input_ids), _rows(req))

    def generate(self, req: GenerationRequest) -> Iterator[Chunk]:
        """Synchronous convenience: submit and yield chunks until the last; closing it cancels. With
        `n` > 1 the choices run together and are yielded one after another, each chunk with its
        `index`."""
        seqs = self.submit_choices(req, [None] * req.params.n)
        try:
            for i, seq in enumerate(seqs):
                while True:
                    chunk = seq.next_chunk()
                    chunk.index = i
                    yield chunk
                    if chunk.finish_reason:
                        break
        finally:
            for seq in seqs:
                seq.cancel()

    def short_of_room(self) -> bool:
        """Whether requests wait for a sequence slot or KV blocks, as of the last scheduling (not the
        ones that only wait for the next step). One attribute read, no lock: the fused replica's
        encoder asks it every few milliseconds while it batches, beside the step thread."""
        return self.scheduler.short_of_room

    def load(self) -> dict:
        """Queue and KV use: what routing and autoscaling look at."""
        with self._cv:
            waiting = len(self._inbox) + len(self.scheduler.waiting)
        b = self.blocks
        return {"running": len(self.scheduler.running), "waiting": waiting, "kv_usage": b.usage(),
                "kv_blocks": b.usable_blocks, "kv_blocks_free": b.num_free,
                "prefix_cache_queried_tokens": b.queried_tokens, "prefix_cache_hit_tokens": b.hit_tokens,
                "preemptions": self.scheduler.preemptions}

    def stats(self) -> dict:
        """load() plus step counts and host time per step (median ms by batch size) over recent steps."""
        out = self.load() | {"steps": self.steps, "graph_steps": self.graph_steps,
                             "step_graph_steps": self.step_graph_steps,
                             "kv_bytes_per_token": self.runner.bytes_per_block // self.blocks.block_size,
                             "gemv": self.model.gemv.as_dict()}
        by_batch: dict[int, list[float]] = {}
        for seqs, _, _, host, _ in list(self.step_log):
            by_batch.setdefault(seqs, []).append(host)
        out["host_ms_median_by_batch"] = {b: round(1e3 * float(np.median(v)), 3) for b, v in sorted(by_batch.items())}
        return out | self.gpu_time()

    def gpu_time(self) -> dict:
        """Cumulative device time of the launched steps (`engine_gpu_ms_total`, `engine_timed_steps`, ...:
        GpuTimer.snapshot): read at two moments, their difference over the requests served between is
        the engine's GPU time per request (benchmarks/goodput.py)."""
        return self.gpu_timer.snapshot("engine", "steps")

    @property
    def alive(self) -> bool:
        """Its loop runs: false once stopped, or under lockstep once a step failed (the replica's health check
        then fails and Serve replaces the whole group)."""
        return self._thread.is_alive() and self.broken is None

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.device.type == "cuda":  # a new thread starts on GPU 0, whatever its creator had set
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self.scheduler.has_work() and self._inflight is None:
                    if not self._cv.wait(LOCKSTEP_IDLE_TURN_S if self.lockstep is not None else None):
                        break  # an empty turn: its tick keeps the followers' wait under their group's timeout
                if self._stop:
                    if self.lockstep is not None:
                        self.lockstep.send(Tick(stop=True), {})
                    return
                inbox, self._inbox = self._inbox, []
            cancelled = self._tick(inbox) if self.lockstep is not None else None
            for seq in inbox:
                self.scheduler.add(seq)
            self._guarded_step(cancelled)
            if self.broken is not None:
                return

    def _tick(self, inbox: list[Sequence]) -> set[Sequence]:
        """Leader: tell the followers what this turn's step starts from; the cancellations it takes."""
        sched = self.scheduler
        cancelled = {s for s in itertools.chain(sched.running, sched.waiting, inbox) if s.cancelled}
        self.lockstep.send(Tick([s.lockstep_new for s in inbox], [s.id for s in cancelled]), {s.id: s for s in inbox})
        for s in inbox:
            s.lockstep_new = None
        return cancelled

    def _follow(self) -> None:
        """A follower's loop: each tick's new sequences and cancellations, then the same step as the leader."""
        torch.set_grad_enabled(False)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        mine: dict[int, Sequence] = {}  # the leader's ids -> this rank's sequences
        for turn in itertools.count():
            tick, tensors = self.lockstep.receive()
            if tick.stop:
                return
            now = time.perf_counter()
            for new in tick.new:
                if new.parent is None:
                    seq = self._sequence(rebuild(new, *tensors.get(new.id, (None, None))))
                else:
                    seq = self._fork(mine[new.parent], new.seed)
                seq.seed, seq.sink, seq.queued_time = new.seed, _discard, now
                if seq.matcher is not None:
                    self.grammars.live += 1
                mine[new.id] = seq
                self.scheduler.add(seq)
            cancelled = {mine[i] for i in tick.cancelled if i in mine}
            for seq in cancelled:
                seq.cancel()
            self._guarded_step(cancelled)
            if self.broken is not None:
                return
            if turn % 256 == 255:
                mine = {i: s for i, s in mine.items() if s.status is not Status.FINISHED}

    def _guarded_step(self, cancelled: set[Sequence] | None) -> None:
        try:
            self._step(cancelled)
        except Exception as e:  # never let the loop die; what was running fails, cleanly
            if self.lockstep is not None:
                self._break_group(e)
                return
            log.exception("engine step failed")
            self._inflight = None  # its tokens are lost: whoever waits for one fails too
            try:
                failed = list(self.scheduler.running) + [
                    s for s in self.scheduler.waiting if s.token_ids and s.token_ids[-1] < 0]
                if not failed and self.scheduler.waiting:
                    # nothing was running: admitting the head of the queue broke the step, and would
                    # again at every step, so it fails alone and the queue behind it moves on
                    failed = [self.scheduler.waiting[0]]
                self._fail(failed, e)
            except Exception:  # noqa: BLE001 - the loop must go on serving the others
                log.exception("failing the step's requests failed too")
                time.sleep(0.01)  # an error that recurs every step must not spin a core

    def _step(self, cancelled: set[Sequence] | None = None) -> None:
        """One turn: complete, plan, launch. `cancelled`: under lockstep, the cancellations this turn
        takes (the same on every rank); else every sequence cancelled by now."""
        t0 = time.perf_counter()
        if self.grammars.live and self._inflight is not None and any(
                s.matcher is not None for s in self.scheduler.running):  # a mask needs the previous token
            self._complete(self._inflight)
            self._inflight = None
        self._drop_cancelled(cancelled)
        plan = self.scheduler.schedule()
        for seq in self.scheduler.preempted:
            self.runner.release_row(seq)
        self.scheduler.preempted.clear()
        previous, self._inflight = self._inflight, None
        launched = None
        if plan.seqs:
            mark = self.gpu_timer.start()
            try:
                launched = self.runner.launch(plan, previous)
            except Exception as e:
                self.gpu_timer.cancel(mark)
                if self.lockstep is not None:  # the group stops (`_break_group`), not this rank alone
                    raise
                log.exception("step of %d requests failed", len(plan.seqs))
                if previous is not None:  # queued before this one: its tokens stand
                    self._complete(previous)
                self._fail(plan.seqs, e)
                return
            self.gpu_timer.stop(mark)
            launched.host_s += launched.started - t0  # the scheduling counts as the step's host time
            self._commit(launched)
        if previous is not None:
            self._complete(previous)
        if launched is not None:
            if self.overlap:
                self._inflight = launched
            else:
                self._complete(launched)
        elif previous is None:
            if self.scheduler.waiting and not self.scheduler.running:  # cannot happen with a sane pool
                seq = self.scheduler.waiting[0]
                self._finish(seq)
                self.emit([(seq, TokenDelta([], error=ClientError("request does not fit the KV cache",
                                                                  code="context_length_exceeded")))])
            else:
                with self._cv:
                    self._cv.wait(0.001)

    def _commit(self, step: LaunchedStep) -> None:
        """At launch: the step's tokens count as computed, and each sequence that samples gets its
        placeholder -(k + 1), k its row among the step's sampled tokens."""
        plan, k = step.plan, 0
        register = self.blocks.register_computed
        for seq, n, sampled in zip(plan.seqs, plan.num_tokens, plan.sample):
            seq.num_computed += n
            if len(seq.block_hashes) < len(seq.block_keys):
                register(seq)
            if sampled:
                step.placed.append((seq, len(seq.token_ids)))
                seq.token_ids.append(-1 - k)
                k += 1
        self.steps += 1
        self.graph_steps += step.graph == "decode"
        self.step_graph_steps += step.graph == "step"

    def _complete(self, step: LaunchedStep) -> None:
        """Read a launched step's tokens, put them in place of its placeholders, emit them."""
        try:
            result = self.runner.collect(step)
        except Exception as e:
            log.exception("step of %d requests failed", len(step.plan.seqs))
            self._fail(step.plan.seqs, e)
            return
        t0 = time.perf_counter()
        outputs, eos = [], self.eos_ids
        logprobs = result.logprobs or itertools.repeat(None)
        for (seq, i), tok, lp in zip(step.placed, result.tokens, logprobs):
            if seq.status is Status.FINISHED:  # cancelled, failed or stopped since: the token is dropped
                continue
            first = seq.first_token_time is None
            if first:
                seq.first_token_time = t0
            if tok in eos and not seq.params.ignore_eos:
                del seq.token_ids[i:]  # and the placeholder of a step queued after this one
                delta = TokenDelta([], "stop")
                if seq.matcher is not None and not seq.matcher.is_accepting():  # only an incomplete answer
                    delta = TokenDelta([], error=self.grammars.refusal(seq.matcher, tok))
            else:
                seq.token_ids[i] = tok
                reason = "length" if i + 1 - seq.prompt_len >= seq.max_new else None
                delta = None
                if seq.matcher is not None:
                    try:
                        if self.grammars.accept(seq.matcher, tok):
                            reason = "stop"  # the response format is complete
                    except RuntimeError as e:  # this request fails alone
                        log.exception("structured output of request %s", seq.id)
                        delta = TokenDelta([], error=e)
                if delta is None:
                    delta = TokenDelta([tok], reason, logprobs=None if lp is None else [lp])
            if first:  # the prefix cache's share of the prompt is known since admission (OpenAI's usage)
                delta.cached_tokens = seq.num_cached
                delta.timing = first_token_timing(seq)
            outputs.append((seq, delta))
            if delta.finish_reason or delta.error is not None:
                self._finish(seq)
        self.emit(outputs)
        now = time.perf_counter()
        plan = step.plan
        # host time: preparing and launching, reading the tokens, the outputs (not the wait for the device)
        host = result.host_s + (now - t0)
        self.step_log.append((len(plan.seqs), sum(plan.num_tokens), result.graph, host, now - step.started))

    def _break_group(self, error: Exception) -> None:
        """Under lockstep a failed step stops this rank for good. Recovering alone, as a single engine does,
        would leave this rank's scheduler different from the others': from then on each would plan other
        batches, and their collectives would pair up wrong (a hang under NCCL, silently wrong sums through
        symmetric memory). So every request this rank holds fails with a 503 (on the leader they are the
        clients'), new ones are refused (`submit_choices`), the loop ends, and the replica's health check
        (`alive`, `followers_alive`) makes Serve replace the group."""
        log.exception("tensor-parallel step failed on this rank: the group stops and will be replaced")
        self._inflight = None
        unavailable = Unavailable("this replica's tensor-parallel group failed and is being replaced; retry shortly")
        with self._cv:  # with the inbox's lock: a request queued after this is refused, not left in it
            self.broken = error
            inbox, self._inbox = self._inbox, []
        held = list(dict.fromkeys([*self.scheduler.running, *self.scheduler.waiting]))
        try:
            self._fail(held, unavailable)
        except Exception:  # noqa: BLE001 - their answers matter more than the pool's bookkeeping now
            log.exception("releasing the failed group's requests failed; answering them anyway")
            self.emit([(s, TokenDelta([], error=unavailable)) for s in held if s.status is not Status.FINISHED])
        self.emit([(s, TokenDelta([], error=unavailable)) for s in inbox])

    def _fail(self, seqs: list[Sequence], error: Exception) -> None:
        failed = [seq for seq in seqs if seq.status is not Status.FINISHED]
        for seq in failed:
            self._finish(seq)
        self.emit([(seq, TokenDelta([], error=error)) for seq in failed])

    def _drop_cancelled(self, only: set[Sequence] | None = None) -> None:
        def gone_now(s):
            return s in only if only is not None else s.cancelled

        gone = [s for s in self.scheduler.running if gone_now(s)]
        gone += [s for s in self.scheduler.waiting if gone_now(s)]
        if gone:
            for seq in gone:
                self._finish(seq)
            self.emit([(s, TokenDelta([], "cancelled")) for s in gone])

    def _finish(self, seq: Sequence) -> None:
        if seq.matcher is not None:
            seq.matcher = None
            with self._cv:
                self.grammars.live -= 1
        self.scheduler.remove(seq)
        self.runner.release_row(seq)
        seq.release_vision()

    @staticmethod
    def _emit_each(outputs: list[tuple[Sequence, TokenDelta]]) -> None:
        for seq, delta in outputs:
            seq.sink(delta)


def _discard(*_) -> None:
    """A follower's sink and emit: only the leader's outputs reach clients."""


def _rows(req: GenerationRequest) -> int:
    return sum(v.main.shape[0] for v in req.vision)


def first_token_timing(seq: Sequence) -> dict | None:
    """Where a sequence's time to its first token went, in seconds: waiting in the engine's queue (queued
    to first scheduled, preemptions aside) and prefilling (first scheduled to first token: its prompt's
    chunks and the steps beside them). None when a time is missing (a follower rank's copy)."""
    if seq.queued_time is None or seq.scheduled_time is None or seq.first_token_time is None:
        return None
    return {"queue_s": seq.scheduled_time - seq.queued_time, "prefill_s": seq.first_token_time - seq.scheduled_time}
