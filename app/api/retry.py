"""Retrying encoder + LLM calls that failed because a replica died.

Ray Serve restarts a dead replica, but the calls it was serving fail with Ray's actor errors. A request
that has not produced a token yet has shown the client nothing, so it is sent again (to another
replica, or to the restarted one: the handle queues it until one is up), within `max_attempts` and
`budget_s`; so is a stream whose tokens so far have no text (the client saw only the role event;
`ChatService._sse`). A non-streaming request has shown nothing until it finishes, so it is retried from
scratch wherever it failed before its last chunk. A stream that already sent tokens cannot be
replayed: it ends with an error event (503, `replica_failed`) and `[DONE]`, never a hang.

Only replica failures are retried: a client error or an overloaded engine (503) is answered at once.
Ray is imported lazily so that app/ stays importable without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ..errors import ClientError

log = logging.getLogger(__name__)

_RAY_FAILURES = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
                 "NodeDiedError", "OwnerDiedError", "ObjectLostError", "ReplicaUnavailableError",
                 "DeploymentUnavailableError")


def _failure_types() -> tuple[type, ...]:
    out: list[type] = []
    try:
        import ray.exceptions as rex

        out += [getattr(rex, n) for n in _RAY_FAILURES if hasattr(rex, n)]
        import ray.serve.exceptions as sex

        out += [getattr(sex, n) for n in _RAY_FAILURES if hasattr(sex, n)]
    except ImportError:
        pass
    return tuple(out)


def is_replica_failure(e: BaseException | None) -> bool:
    """A replica (or its node or process) went away, anywhere in the exception's cause chain."""
    types, seen = _failure_types(), 0
    while e is not None and seen < 8:
        if isinstance(e, ClientError):
            return False
        if types and isinstance(e, types):
            return True
        e = getattr(e, "cause", None) or e.__cause__
        seen += 1
    return False


def replica_failed(retries: int = 0) -> ClientError:
    err = ClientError(f"a model replica failed while serving this request (after {retries} retries); retry it",
                      status=503, type="server_error", code="replica_failed", headers={"retry-after": "5"})
    err.retries = retries  # for the request's record
    return err


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    budget_s: float = 90.0
    backoff_s: float = 0.5
    is_retryable: Callable[[BaseException], bool] = is_replica_failure

    @classmethod
    def from_config(cls, cfg) -> RetryPolicy:
        """From a RetryConfig."""
        return cls(cfg.max_attempts, cfg.budget_s, cfg.backoff_s)

    async def _wait_or_give_up(self, e: BaseException, attempt: int, t0: float) -> None:
        """Raises when `e` is not retryable or the bounds are spent; else sleeps the backoff."""
        if not self.is_retryable(e):
            raise e
        delay = self.backoff_s * 2 ** (attempt - 1)
        if attempt >= self.max_attempts or time.monotonic() + delay - t0 > self.budget_s:
            raise replica_failed(attempt - 1) from e
        await asyncio.sleep(delay)


async def _close(stream) -> None:
    for name in ("aclose", "cancel"):
        fn = getattr(stream, name, None)
        if fn is not None:
            try:
                r = fn()
                if asyncio.iscoroutine(r):
                    await r
            except Exception:
                pass
            return


async def _first_of(stream: AsyncIterator[dict], policy: RetryPolicy, attempt: int, t0: float) -> dict:
    """The stream's first chunk. A retried attempt waits for it at most what is left of the policy's
    budget: it sits in the handle's queue while the failed replica is replaced (weights, graphs: minutes),
    and the budget is the request's, not each attempt's. Past it, the stream is cancelled and the request
    answered `replica_failed` (503, Retry-After)."""
    if attempt <= 1:
        return await anext(stream)
    left = policy.budget_s - (time.monotonic() - t0)
    try:
        return await asyncio.wait_for(anext(stream), max(left, 0.0))
    except TimeoutError as e:
        cancel_stream(stream)
        raise replica_failed(attempt - 1) from e


async def first_chunk(start: Callable[[], AsyncIterator[dict]], policy: RetryPolicy, attempts: int = 0,
                      t0: float | None = None, failed: BaseException | None = None
                      ) -> tuple[dict, AsyncIterator[dict], int]:
    """(first chunk, the rest of its stream, retries): the call is retried until a chunk arrives.
    A stream that showed nothing and then failed with `failed` is started again the same way:
    `attempts` already made for the request and its start (`time.monotonic()`), so that the policy's
    bounds and backoff cover the request, not each start."""
    t0, attempt = time.monotonic() if t0 is None else t0, attempts
    if failed is not None:
        await policy._wait_or_give_up(failed, attempt, t0)
    while True:
        attempt += 1
        stream = aiter(start())
        try:
            return await _first_of(stream, policy, attempt, t0), stream, attempt - 1
        except StopAsyncIteration:
            raise
        except Exception as e:
            await _close(stream)
            await policy._wait_or_give_up(e, attempt, t0)
        except BaseException:  # cancelled (the client left): stop the generation just started
            cancel_stream(stream)
            raise


async def collect(start: Callable[[], AsyncIterator[dict]], policy: RetryPolicy, choices: int = 1
                  ) -> tuple[list[dict], float | None, int]:
    """(every chunk, perf_counter() at the first chunk of the attempt that finished, retries): a
    whole non-streamed answer, retried from scratch when a replica fails before its last chunk.
    The chunk that brings the last of the request's `choices` finish reasons is the last: the answer
    returns then, without waiting for the stream's end to come back from the replica (one more round
    trip through Ray); the rest of the stream is read in the background (`drain_later`)."""
    t0, attempt = time.monotonic(), 0
    while True:
        attempt += 1
        chunks, first_at, finished = [], None, 0
        stream = aiter(start())
        try:
            try:
                head = [await _first_of(stream, policy, attempt, t0)]
            except StopAsyncIteration:
                head = []
            async for chunk in _chain(head, stream):
                first_at = time.perf_counter() if first_at is None else first_at
                chunks.append(chunk)
                finished += bool(chunk.get("finish_reason"))
                if finished == choices:
                    drain_later(stream)
                    break
            return chunks, first_at, attempt - 1
        except Exception as e:
            await _close(stream)
            await policy._wait_or_give_up(e, attempt, t0)
        except BaseException:  # cancelled (the client left): stop the generation
            cancel_stream(stream)
            raise


async def _chain(head: list[dict], rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    for chunk in head:
        yield chunk
    async for chunk in rest:
        yield chunk


_draining: set[asyncio.Task] = set()  # strong references: a pending task may otherwise be collected


def cancel_stream(stream: AsyncIterator) -> None:
    """Stop a stream whose reader has gone: a Ray Serve streaming call is cancelled on its replica (its
    generator stops and frees its engine slot); another async generator is closed in the background."""
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
        return
    _in_background(_close(stream))


def drain_later(stream: AsyncIterator) -> None:
    """Read what is left of a stream in a background task and drop it. Ray Serve counts a call as
    running until its stream has ended (per-replica load, `max_ongoing_requests`), so a stream is
    read to its end even when its answer is already out; errors there no longer concern anyone."""
    async def drain() -> None:
        try:
            async for _ in stream:
                pass
        except Exception as e:
            log.debug("a finished answer's stream ended with %r", e)

    _in_background(drain())


def _in_background(coro) -> None:
    """Run `coro` as a task of the running loop, held until it ends (the loop keeps only weak references)."""
    task = asyncio.get_running_loop().create_task(coro)
    _draining.add(task)
    task.add_done_callback(_draining.discard)


async def call_with_retries(start: Callable[[], Awaitable], policy: RetryPolicy) -> tuple[object, int]:
    """(result, retries) of a single awaited call, sent again when its replica failed."""
    t0, attempt = time.monotonic(), 0
    while True:
        attempt += 1
        try:
            return await start(), attempt - 1
        except Exception as e:
            await policy._wait_or_give_up(e, attempt, t0)
