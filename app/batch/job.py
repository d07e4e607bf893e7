"""The batch driver: rows in, stages on actor pools, answers out.

Rows travel in chunks of `chunk_rows` (workers.py says why). Per chunk a media actor prepares the rows'
media and prompts (the patch rows stay in the object store); an encoder actor turns them into
embeddings, which go straight to an LLM actor as an object reference (under serving's `fused` placement,
the GPU default, the LLM actor encodes them itself); the answers come back to this driver, which writes
shards, keeping every pool's slots full while reading the input lazily. A chunk whose actor died or a
row whose engine was full (503) is tried again, up to `max_retries`; a chunk that fails otherwise is
tried again row by row. A client error (4xx) or a row's own unexpected error (500) is its final answer,
written once. A row the server could not answer (retries run out, a pool that gave up: 503
`server_unavailable`) is not written, so a rerun of the same command answers it; such rows make
`report["left"]` (a non-zero exit in `__main__`). Once a pool gives up, no more rows start.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

import ray

from ..errors import ClientError
from ..serving.placement import llm_memory_share, resolve_policy
from ..serving.replica_stats import merge_encoder_stats
from .config import BatchConfig
from .io import Row, ShardWriter, count_rows, read_rows, write_json_atomic
from .pool import ActorPool, Member, PoolFailed
from .progress import Progress
from .workers import Busy, EncoderWorker, Failure, LLMWorker, MediaWorker

log = logging.getLogger(__name__)
RETRY_DELAY_S = 1.0
LEFT_FOR_RERUN = "server_unavailable"  # the error code of a row the server could not answer in this run


class _Retry(Exception):
    pass


def llm_actor_share(cfg: BatchConfig, gpus: float, fused: bool) -> tuple[float, dict]:
    """(GPUs each LLM actor reserves, the app config it runs): `llm_pool.num_gpus` when given; else under
    `fused` on GPUs `placement.llm_replicas_per_gpu` actors share a GPU, otherwise each takes a whole one
    (none without GPUs). Actors sharing a GPU split `llm.gpu_memory_utilization` by their share.

    A pool too small for every GPU to hold that many (`llm_pool.max_size` below GPUs x per GPU) shares
    them less: Ray places a fractional actor on the fullest GPU that fits, so four half-GPU actors on
    four GPUs would fill two and leave two idle."""
    share = cfg.llm_pool.num_gpus
    if share is None and gpus > 0 and fused:
        per = cfg.app.placement.llm_replicas_per_gpu
        fits = max(1, cfg.llm_pool.max_size // max(1, int(gpus)))
        if fits < per:
            log.warning("llm_pool.max_size %d is below %d GPUs x llm_replicas_per_gpu %d: %d LLM actor(s) per GPU",
                        cfg.llm_pool.max_size, int(gpus), per, fits)
        share = 1.0 / min(per, fits)
    elif share is None:
        share = 1.0 if gpus > 0 else 0.0
    llm = cfg.app.llm.model_copy(update={
        "gpu_memory_utilization": llm_memory_share(cfg.app.llm.gpu_memory_utilization, share)})
    return share, cfg.app.model_copy(update={"llm": llm}).model_dump()


class Stages:
    """The three pools, and one chunk of rows through them."""

    def __init__(self, cfg: BatchConfig):
        self.cfg = cfg
        gpus = ray.cluster_resources().get("GPU", 0)
        node_gpus = int(max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]), default=0))
        app = cfg.app.model_dump()
        self.encoder_reports: list[dict] = []
        enc, llm = cfg.encoder_pool, cfg.llm_pool
        # Serving's placement decides the stages: under `fused` (the default on GPUs) each LLM actor
        # holds the tower and there is no encoder pool; otherwise as serving's `colocate`: each LLM
        # actor reserves a whole GPU (so Ray spreads them one per GPU), encoder actors reserve none and
        # pin the node's GPUs in turn. Fractional shares would not do: Ray gives them the fullest GPU
        # that fits, pairing encoders with encoders (app/serving/placement.py). An explicit encoder num_gpus
        # is plain Ray accounting.
        # Under `fused`, `placement.llm_replicas_per_gpu` LLM actors share each GPU, as serving's
        # replicas do (two processes for the host work of one GPU), splitting the KV budget.
        self.fused = resolve_policy(cfg.app.placement, int(gpus)) == "fused"
        colocate = gpus > 0 and enc.num_gpus is None
        enc_gpus = 0.0 if colocate else (enc.num_gpus or 0.0)
        llm_gpus, llm_app = llm_actor_share(cfg, gpus, self.fused)
        self.media = ActorPool("media", MediaWorker, lambda i: (app, cfg.file_root), cfg.media_pool,
                               cfg.media_pool.num_gpus or 0.0)
        self.llm = ActorPool("llm", LLMWorker, lambda i: (llm_app, self.fused), llm, llm_gpus,
                             on_remove=self._keep_stats if self.fused else None)
        self.encoder = None if self.fused else ActorPool(
            "encoder", EncoderWorker, lambda i: (app, (i, node_gpus) if colocate else None), enc, enc_gpus,
            on_remove=self._keep_stats)
        self.pools = {name: pool for name, pool in (("media", self.media), ("encoder", self.encoder), ("llm", self.llm))
                      if pool is not None}

    async def _keep_stats(self, m: Member) -> None:
        """A removed actor's encoder counters, for the job's report."""
        method = m.handle.encoder_stats if self.fused else m.handle.stats
        self.encoder_reports.append(await method.remote())

    async def start(self) -> None:
        """Every pool's `min_size` actors. Until they are placed, say every 30 s which pools wait and
        what the cluster has free: a pool that asks for more than the cluster has waits for a node."""
        tasks = {name: asyncio.ensure_future(p.start()) for name, p in self.pools.items()}
        while True:
            done, pending = await asyncio.wait(tasks.values(), timeout=30)
            for t in done:
                t.result()  # an actor that failed to start fails the job here
            if not pending:
                return
            waiting = [name for name, t in tasks.items() if not t.done()]
            log.warning("still starting pools %s; the cluster has %s free", waiting, ray.available_resources())

    def failed_pool(self) -> str | None:
        """The name of a pool that gave up (no actor left, starts failing), if any."""
        return next((name for name, p in self.pools.items() if p.gave_up), None)

    def slots(self) -> int:
        """Rows worth keeping in flight: every pool's slots at its largest, so none starves."""
        return sum(p.cfg.max_size * max([p.cfg.max_in_flight, *(m.capacity for m in p.members)])
                   for p in self.pools.values())

    async def _call(self, pool: ActorPool, method: str, *args, rows: int = 1, num_returns: int = 1):
        m, taken = await pool.acquire(rows)
        dead = False
        try:
            call = getattr(m.handle, method)
            if num_returns > 1:
                refs = call.options(num_returns=num_returns).remote(*args)
                return [await refs[0], *refs[1:]]
            return await call.remote(*args)
        except ray.exceptions.ActorUnavailableError as e:  # a subclass of RayActorError: unreachable for now
            await asyncio.sleep(RETRY_DELAY_S)  # not dead: it keeps its place (and its GPU) in the pool
            raise _Retry(f"{pool.name} actor unavailable: {e}") from e
        except ray.exceptions.RayActorError as e:
            dead = True
            raise _Retry(f"{pool.name} actor lost: {e}") from e
        except ray.exceptions.ObjectLostError as e:  # media or embeddings stored on a node that died
            raise _Retry(f"{pool.name} input lost: {e}") from e
        except ray.exceptions.RayTaskError as e:  # a stage raised for the whole chunk
            cause = e.as_instanceof_cause()
            if isinstance(cause, ClientError) and cause.status >= 500:  # e.g. an overloaded encoder
                await asyncio.sleep(RETRY_DELAY_S)
                raise _Retry(cause.message) from e
            raise
        finally:
            await pool.release(m, taken, dead)

    async def run_chunk(self, rows: list[Row]) -> list[tuple[dict, int]]:
        """Per row (output record, media items), in order. Never raises for the rows' own trouble."""
        answers: dict[int, tuple[dict, int]] = {i: (_error(row, Failure.of(row.error)), 0)
                                                 for i, row in enumerate(rows) if row.error is not None}
        todo = [i for i in range(len(rows)) if i not in answers]
        last: dict[int, object] = {}
        for attempt in range(self.cfg.max_retries + 1):
            if not todo:
                break
            if attempt and all(isinstance(last[i], Busy) for i in todo):
                await asyncio.sleep(RETRY_DELAY_S)  # the engine was full: give it time to drain
            try:
                done = await self._once([rows[i] for i in todo])
            except _Retry as e:
                last.update(dict.fromkeys(todo, e))
                continue
            except Exception as e:
                log.exception("a chunk of %d rows (lines %d...) failed", len(todo), rows[todo[0]].line)
                if len(todo) > 1:  # one bad row (say, one that cannot be pickled) must cost that row alone
                    alone = await asyncio.gather(*(self.run_chunk([rows[i]]) for i in todo))
                    answers.update((i, got[0]) for i, got in zip(todo, alone, strict=True))
                    todo = []
                    break
                last.update(dict.fromkeys(todo, e))
                break
            for i, answer in zip(todo, done, strict=True):
                if isinstance(answer, Busy):
                    last[i] = answer
                else:
                    answers[i] = answer
            todo = [i for i in todo if i not in answers]
        for i in todo:  # out of tries (the server's trouble: not final), or the row's own unexpected error
            cause = last[i]
            err = cause.message if isinstance(cause, Busy) else f"{type(cause).__name__}: {cause}"
            if isinstance(cause, Busy | _Retry | PoolFailed):
                failure = ClientError(f"no answer yet: {err}", status=503, type="server_unavailable",
                                      code=LEFT_FOR_RERUN)
            else:
                failure = ClientError(f"internal error: {err}", status=500, type="server_error")
            answers[i] = _error(rows[i], Failure.of(failure)), 0
        return [answers[i] for i in range(len(rows))]

    async def _once(self, rows: list[Row]) -> list[tuple[dict, int] | Busy]:
        prepared, payloads = await self._call(self.media, "prepare_many", [r.body for r in rows], rows=len(rows),
                                              num_returns=2)
        live = sum(not isinstance(p, Failure | Busy) for p in prepared)
        outs = prepared  # every row failed (or waits) in the media stage: nothing to generate
        if live and self.fused:
            outs = await self._call(self.llm, "generate_from_media_many", prepared, payloads, rows=live)
        elif live:
            media = sum(p.items for p in prepared if not isinstance(p, Failure | Busy))
            encoded = [[] for _ in prepared]
            if media:
                _, encoded = await self._call(self.encoder, "encode_many", payloads, rows=live, num_returns=2)
            outs = await self._call(self.llm, "generate_many", prepared, encoded, rows=live)
        answers: list[tuple[dict, int] | Busy] = []
        for row, p, out in zip(rows, prepared, outs, strict=True):
            if isinstance(out, Busy):
                answers.append(out)
            elif isinstance(out, Failure):
                answers.append((_error(row, out), 0))
            else:
                answers.append(({"id": row.id, "response": out, "usage": out["usage"]}, p.items))
        return answers

    async def encoder_stats(self) -> dict:
        pool, method = (self.llm, "encoder_stats") if self.fused else (self.encoder, "stats")
        live = await asyncio.gather(*(getattr(m.handle, method).remote() for m in pool.members),
                                    return_exceptions=True)
        return merge_encoder_stats(self.encoder_reports + [r for r in live if isinstance(r, dict)])

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self.pools.values()))


def _error(row: Row, f: Failure) -> dict:
    return {"id": row.id, "line": row.line, "status": f.status, "error": f.error}


def _final(record: dict) -> bool:
    """An answer, a client error (4xx) or the row's own unexpected error (a 500, which would recur on
    every rerun) is the row's final record: written, and skipped by a rerun. A row the server could not
    answer now (retries run out, a pool that gave up: LEFT_FOR_RERUN) says nothing about the row, and
    written it would be skipped for ever."""
    return record.get("error", {}).get("code") != LEFT_FOR_RERUN


async def run_job(cfg: BatchConfig, input_path: str, output_dir: str, progress_stream=None) -> dict:
    """Runs the job on the Ray cluster this process is connected to; returns the report (also written
    to `<output>/report.json`)."""
    writer = ShardWriter(output_dir, cfg.shard_rows)
    writer.claim(input_path)
    try:
        return await _run(cfg, input_path, output_dir, writer, progress_stream)
    finally:
        writer.release()


async def _run(cfg: BatchConfig, input_path: str, output_dir: str, writer: ShardWriter, progress_stream) -> dict:
    progress = Progress(total=count_rows(input_path))
    if progress_stream is not None:
        progress.stream = progress_stream
    rows = _todo(read_rows(input_path), writer.done, progress)
    first = next(rows, None)
    if first is None:  # an earlier run answered everything: no actors to start
        report = progress.report(None, {})
        write_json_atomic(os.path.join(output_dir, "report.json"), report)
        return report
    rows = itertools.chain([first], rows)
    stages = Stages(cfg)
    t_start = time.perf_counter()
    await stages.start()
    log.info("pools ready in %.1f s", time.perf_counter() - t_start)
    progress.start = time.perf_counter()
    in_flight: dict[asyncio.Task, int] = {}  # chunk -> its rows
    last_flush = last_show = time.monotonic()
    exhausted = False
    try:
        while True:
            failed = None if exhausted else stages.failed_pool()
            if failed:  # every row started now would fail too: count the rest for the rerun instead
                log.error("the %s pool gave up: no more rows are started; a rerun answers them", failed)
                progress.left += sum(1 for _ in rows)  # the earlier runs' rows among them count as skipped
                exhausted = True
            while not exhausted and sum(in_flight.values()) < stages.slots():
                chunk = list(itertools.islice(rows, cfg.chunk_rows))
                exhausted = len(chunk) < cfg.chunk_rows
                if chunk:
                    in_flight[asyncio.create_task(stages.run_chunk(chunk))] = len(chunk)
            if not in_flight:
                break
            done, _ = await asyncio.wait(in_flight, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del in_flight[task]
                for record, items in task.result():
                    final = _final(record)
                    if final:
                        writer.add(record)
                    progress.record(record, items, final)
            now = time.monotonic()
            if now - last_flush >= cfg.flush_interval_s:
                writer.flush()
                last_flush = now
            if now - last_show >= cfg.progress_interval_s:
                progress.show()
                last_show = now
                for pool in stages.pools.values():
                    await pool.shrink()
        writer.flush()
        progress.show()
        report = progress.report(await stages.encoder_stats(),
                                 {name: {"peak_size": p.peak, "min_size": p.cfg.min_size, "max_size": p.cfg.max_size}
                                  for name, p in stages.pools.items()})
    finally:
        await stages.close()
    report["startup_s"] = round(progress.start - t_start, 3)
    report["shards_written"] = writer.shards_written
    write_json_atomic(os.path.join(output_dir, "report.json"), report)
    return report


def _todo(rows, done: set[str], progress: Progress):
    """Rows that no earlier run answered; the others are counted as skipped."""
    for row in rows:
        if row.id in done:
            progress.skipped += 1
            continue
        yield row
