"""Router deployment: the FastAPI ingress. Wiring only; the logic is app.api.chat.ChatService.

It keeps HTTP, JSON parsing, prompt building and orchestration. Media preparation runs in
MediaPreprocessor replicas (app/media/remote.py), except for small inline images while this Router is
nearly idle, which it prepares on its own threads (app/media/adaptive.py: no hop at low load). Encoding
runs in VisionEncoder replicas (or, under the `fused` placement, in the LLM replicas), generation in LLM
replicas. The Router passes the replicas' items and the embeddings on as object references and never
re-serialises them; only the rows of items it prepared itself travel in the encoder call's arguments.
Several Router replicas run behind Ray Serve's HTTP proxy (autoscaled)."""

import asyncio
import logging
import time
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api import fastjson
from app.api.auth import ApiKeyMiddleware, resolve_api_key
from app.api.body import parse_json, read_body
from app.api.chat import ChatService, ask_ttft_parts, unwrap_client_error
from app.api.completions import CompletionService
from app.api.responses import ResponseService
from app.api.retry import RetryPolicy
from app.api.schemas import with_header_request_id
from app.api.shared_port import SCOPE_KEY as SHARED_PORT_SCOPE
from app.api.shared_port import SharedPortServer, bind_shared, unless_client_leaves
from app.api.tokenize import TokenizeService
from app.checkpoints.model_builder import resolve_model
from app.checkpoints.tokenizer_loader import load_tokenizer
from app.config import AppConfig
from app.errors import ClientError
from app.media.adaptive import AdaptiveMedia, CountingPool
from app.media.pipeline import MediaPipeline
from app.media.remote import RemoteMedia
from app.media.spec import patch_spec_for
from app.serving.cluster import node_router_port
from app.serving.gc_pauses import watch
from app.serving.prometheus import scrape_text
from app.serving.readiness import ReadinessProbe, serve_app_state, serve_replica_states, serving_without
from app.serving.replica_stats import merge_encoder_stats, merge_llm_loads
from app.serving.shutdown import ANSWER_GRACE_S, answer_grace_s, shared_port_drain_s
from app.serving.warmup import warm_router

from .logs import route_app_logs
from .metrics import RouterMetrics, broadcast_within

log = logging.getLogger("ray.serve")
api = FastAPI(title="vlm-serve")
api.add_middleware(ApiKeyMiddleware, get_key=lambda: getattr(api.state, "api_key", None))


class FastJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return fastjson.dumps_bytes(content)


@api.exception_handler(StarletteHTTPException)
async def http_error(request: Request, exc: StarletteHTTPException):
    """FastAPI's own refusals (unknown path 404, wrong method 405) in OpenAI's error shape too, so
    that every client error of this server parses the same way."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = ClientError(str(exc.detail), status=exc.status_code, code=code,
                      type="invalid_request_error" if exc.status_code < 500 else "server_error")
    return FastJSONResponse(err.to_json(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


class RayBackend:
    """Encoder response handed straight to the LLM call: the embeddings never pass through the router.
    Under the `fused` placement one call does both: the LLM replica encodes the payload itself."""

    def __init__(self, encoder: DeploymentHandle, llm: DeploymentHandle, fused: bool = False):
        self.encoder, self.llm, self.fused = encoder, llm, fused

    def stream(self, gen: dict, payload: list):
        if self.fused:
            return self.llm.options(stream=True).generate_from_media.remote(gen, payload)
        encoded = self.encoder.encode.remote(payload) if payload else []
        return self.llm.options(stream=True).generate.remote(gen, encoded)


# a proxy in front (nginx) must pass each event on as it comes, not buffer the stream
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _as_client_error(e: BaseException, what: str) -> ClientError:
    """The ClientError inside `e` (Ray wraps remote ones), or a logged 500."""
    err = unwrap_client_error(e)
    if err is None:
        log.exception("%s failed", what)
        err = ClientError("internal server error", status=500, type="server_error")
    return err


def error_response(e: ClientError) -> JSONResponse:
    return FastJSONResponse(e.to_json(), status_code=e.status, headers=e.headers)


async def _service_work(service, body):
    """What `Router._generate` needs from a service with `prepare`, `open_stream(req, t0)` and
    `complete(req, t0)` (completions, responses). Defined above the Router: Serve pickles the class
    when it is decorated, and a name defined below it would be missing in the replica."""
    req = await service.prepare(body)
    return req.stream, partial(service.open_stream, req), partial(service.complete, req)


# A Router that is stopped (scaled down, redeployed) lets the answers in flight finish, as an LLM replica
# does: Ray Serve kills the replica graceful_shutdown_timeout_s after the stop whatever is still open, so both
# take the grace of a long answer (app/serving/shutdown.py; the builder's follows llm.default_max_tokens).
# An idle replica stops at once either way. The shared port's drain fits inside it.
METRICS_TIMEOUT_S = 2.0  # GET /metrics waits this long for the replicas' numbers, then renders what came
ROUTER_WARMUP_S = 60.0  # a Router's warm-up gives up after this and opens its port anyway
# A Router of a first deploy waits this long for the other deployments to serve (the LLM replicas load and
# capture graphs meanwhile) before it warms; past it, it opens its port cold
ROUTER_WAIT_FOR_APP_S = 900.0
APP_POLL_S = 0.5


async def _others_serving(ctx, limit_s: float) -> bool:
    """Whether every other deployment of the Router's app has a replica running, waiting up to `limit_s`.
    A poll that fails (a controller busy with a large deploy, the app not listed yet) is logged and tried
    again: one failure would otherwise open the port cold at once."""
    deadline = time.monotonic() + limit_s
    while True:
        serving = False
        try:
            serving = await asyncio.wait_for(asyncio.to_thread(
                lambda: serving_without(serve_replica_states(ctx.app_name), ctx.deployment)), 10.0)
        except Exception as e:  # noqa: BLE001 - keep waiting until the deadline
            log.info("Router: the application's state could not be read (%s: %s); asking again",
                     type(e).__name__, e)
        if serving or time.monotonic() >= deadline:
            return serving
        await asyncio.sleep(APP_POLL_S)


async def open_shared_port(app, sock) -> SharedPortServer:
    """A Router's shared port, opened only once Ray Serve has made the Router the replica's instance: FastAPI's
    routes find their `self` through it, which Serve sets after the constructor returns, so a request the
    port took in between would have none. Before it listens, a Router sends its own warm-up requests
    through its routes (app/serving/warmup.py: `warm_router`) once the app's other deployments serve: on
    one H100 (2026-11-27), the points that met a Router added under load had TTFT p99 over 400 ms at 40-47
    req/s, with the engine's parts of it under 40 ms. At a first deploy it waits for them (up to
    ROUTER_WAIT_FOR_APP_S): the app's readiness did not cover the Routers' own cold paths, and the first
    second after ready had a TTFT p99 of 1.68x warm at half the goodput (H100, 2026-11-28). `sock` was
    bound in the constructor (a port another program holds fails the replica there); it listens here.
    `app` is the FastAPI app as the Router's own methods see it: Serve pickles the Router with a copy of
    the module's `api`, and only that copy holds the API key the constructor set (`app.state.api_key`; the
    module's own `api`, which this function would otherwise find, has none: the port once let every
    request through). A failed or cancelled opening stops what it started and closes the socket."""
    server = None
    try:
        while serve.get_replica_context().servable_object is None:
            await asyncio.sleep(0.01)
        ctx = serve.get_replica_context()
        try:
            if await _others_serving(ctx, ROUTER_WAIT_FOR_APP_S):
                report = await asyncio.wait_for(warm_router(app, getattr(app.state, "api_key", None)),
                                                ROUTER_WARMUP_S)
                log.info("Router warm-up: %d requests in %.1f s, %d errors%s", report.requests, report.seconds,
                         len(report.errors), f" (first: {report.errors[0]})" if report.errors else "")
        except Exception as e:  # noqa: BLE001 - a warm-up that fails leaves the Router cold, not down
            log.warning("Router warm-up failed, opening the shared port cold: %s: %s", type(e).__name__, e)
        server = SharedPortServer(app, sock)
        await server.started()
        return server
    except BaseException:
        if server is not None:
            server.stop()
            server.task.cancel()
        sock.close()
        raise


@serve.deployment(name="Router", graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=ANSWER_GRACE_S)
@serve.ingress(api)
class Router:
    async def __init__(self, config: dict, media: DeploymentHandle, encoder: DeploymentHandle, llm: DeploymentHandle,
                       fused: bool = False):
        """`fused`: the placement runs the tower inside the LLM replicas (no VisionEncoder replicas).
        Async so that the shared-port HTTP server (`router_http_port`) starts on this replica's loop."""
        route_app_logs()
        self.cfg = AppConfig(**config)
        app_name = serve.get_replica_context().app_name
        self.readiness = ReadinessProbe(lambda: serve_app_state(app_name))
        api.state.api_key = resolve_api_key(self.cfg.api_key)  # None: no key required
        ckpt = resolve_model(self.cfg.model, self.cfg.cache_dir)
        # Object references, not values, must cross these handles (app/media/remote.py; the encoder's
        # response goes to the LLM unresolved). Ray's by-value gRPC mode (RAY_SERVE_THROUGHPUT_OPTIMIZED)
        # would otherwise pull both through this process.
        # placement.prefer_local_node: this node's replicas first (deployments/routing.py for the LLM's)
        local = self.cfg.placement.prefer_local_node
        media, encoder, llm = (h.options(_by_reference=True, _prefer_local_routing=local) for h in (media, encoder, llm))
        self.metrics = RouterMetrics()
        source = RemoteMedia(media, patch_spec_for(ckpt), RetryPolicy.from_config(self.cfg.retry),
                             on_retry=self.metrics.retried)
        if self.cfg.media.router_local_below > 0:  # small inline images at low load: no media hop
            self.media_pool = CountingPool(self.cfg.media.worker_threads, thread_name_prefix="media")
            source = AdaptiveMedia(source, MediaPipeline(self.cfg.media, source.spec, self.media_pool),
                                   self.cfg.media.router_local_below, self.cfg.media.router_local_bytes,
                                   on_choice=self.metrics.media_where)
        self.chat = ChatService(self.cfg, load_tokenizer(ckpt), source, RayBackend(encoder, llm, fused),
                                observer=self.metrics.observe, on_unknown=self.metrics.unknown_parameter,
                                checkpoint=str(ckpt))
        # /v1/completions, /v1/responses, /tokenize and /detokenize: the chat path underneath
        self.completions, self.responses = CompletionService(self.chat), ResponseService(self.chat)
        self.tokens = TokenizeService(self.chat)
        self.encoder, self.llm, self.fused = encoder, llm, fused
        self.opening = None
        if self.cfg.router_http_port:
            # a node may give its Routers a port of its own (app/serving/cluster.py: several nodes on one host);
            # bound here, so that a port another program holds fails this constructor, and served after it,
            # once the replica is Serve's (check_health reports a later failure)
            sock = bind_shared(self.cfg.router_http_host, node_router_port(self.cfg.router_http_port))
            self.opening = asyncio.get_running_loop().create_task(open_shared_port(api, sock))
        self.gc = watch()

    @property
    def direct(self) -> SharedPortServer | None:
        """The shared port's server once its opening succeeded (None before, without one, or if it failed)."""
        opening = getattr(self, "opening", None)
        if opening is None or not opening.done() or opening.cancelled() or opening.exception() is not None:
            return None
        return opening.result()

    def check_health(self) -> None:
        """Ray Serve's periodic check: a shared port that failed to open (taken, refused), or whose server
        stopped later, fails it, and Serve replaces the replica, as a failed constructor did before the port
        opened after it."""
        if self.opening is not None and self.opening.done():
            if self.opening.cancelled():
                raise RuntimeError("the shared port's opening was cancelled")
            if self.opening.exception() is not None:
                raise RuntimeError(f"the shared port did not open: {self.opening.exception()!r}")
        if self.direct is not None and self.direct.task.done() and not self.direct.server.should_exit:
            raise RuntimeError("the shared port's HTTP server stopped")

    async def __del__(self):
        """Ray Serve awaits this when it stops the replica, after draining the requests it counted: the
        shared port stops taking connections and its requests in flight get to finish (within the
        deployment's `graceful_shutdown_timeout_s`, after which Ray stops the process anyway). An opening
        still under way is cancelled and stops what it started; a port that opened is drained."""
        opening = getattr(self, "opening", None)
        if opening is not None and not opening.done():
            opening.cancel()
            await asyncio.wait({opening})  # its own cleanup runs; its outcome is not ours to raise
        direct = self.direct
        if direct is not None:
            try:
                await direct.drain(shared_port_drain_s(answer_grace_s(self.cfg.llm.default_max_tokens)))
            except Exception as e:  # noqa: BLE001 - its server had failed; the rest still has to stop
                log.warning("the shared port's server had failed: %s: %s", type(e).__name__, e)
        if getattr(self, "media_pool", None) is not None:
            self.media_pool.shutdown(wait=False, cancel_futures=True)

    def record_autoscaling_stats(self) -> dict:
        """Custom autoscaling metrics: requests in flight on the shared port, which Ray Serve does not
        count (app.serving.autoscaling.RouterAutoscalingPolicy adds them to its own count)."""
        return {"direct_ongoing": self.direct.ongoing if self.direct is not None else 0}

    @api.get("/health")
    async def health(self):
        """200 once the application is ready (app/serving/readiness.py: every deployment's whole target running
        the first time; once Serve's state shows the app served, one running replica each), else 503."""
        ready, deployments = await asyncio.to_thread(self.readiness)
        if ready:
            return {"status": "ok"}
        return FastJSONResponse({"status": "starting", "deployments": deployments}, status_code=503,
                                headers={"Retry-After": "1"})

    @api.get("/v1/models")
    async def models(self) -> dict:
        """The served model, with the sampling defaults omitted parameters take (`sampling_defaults`)."""
        return {"object": "list", "data": [self.chat.model_card()]}

    @api.get("/v1/encoder/stats")
    async def encoder_stats(self) -> dict:
        """Every encoder replica's counters, summed (per replica under "replicas"); under `fused`, the
        LLM replicas' towers."""
        if self.fused:
            return merge_encoder_stats(await self.llm.broadcast("encoder_stats").results_async())
        return merge_encoder_stats(await self.encoder.broadcast("stats").results_async())

    @api.get("/v1/llm/load")
    async def llm_load(self) -> dict:
        """Every LLM replica's engine load: requests summed, per replica under "replicas"; `router_gc`: the
        garbage collector's pauses in the Router that answered."""
        return {**merge_llm_loads(await self.llm.broadcast("replica_load").results_async()),
                "router_gc": self.gc.snapshot()}

    @api.get("/metrics")
    async def prometheus_metrics(self) -> Response:
        """Prometheus text with vLLM's metric names (app/serving/prometheus.py): every LLM replica's
        counters and histograms and every tower's counters, summed now; a replica that does not answer
        within METRICS_TIMEOUT_S is left out and counted. Open without the API key, as /health."""
        asked = [broadcast_within(self.llm, "metrics_snapshot", METRICS_TIMEOUT_S)]
        if not self.fused:  # under fused the LLM replicas' snapshots hold their towers' stats
            asked.append(broadcast_within(self.encoder, "stats", METRICS_TIMEOUT_S))
        answers = await asyncio.gather(*asked)
        body, content_type = scrape_text(answers[0], answers[1] if len(answers) > 1 else None, self.cfg.model_name)
        return Response(body, media_type=content_type)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, self._chat_work, "chat completion")

    @api.post("/v1/completions")
    async def completions_route(self, request: Request):
        """OpenAI's text completions, as vLLM serves them (app/api/completions.py)."""
        return await self._generate(request, partial(_service_work, self.completions), "completion")

    @api.post("/v1/responses")
    async def responses_route(self, request: Request):
        """OpenAI's Responses API, run on the chat path (app/api/responses.py)."""
        return await self._generate(request, partial(_service_work, self.responses), "response", id_header=False)

    async def _chat_work(self, body):
        req, gen, payload = await self.chat.prepare(body)
        return req.stream, partial(self.chat.open_stream, req, gen, payload), partial(self.chat.complete, req, gen, payload)

    async def _generate(self, request: Request, work, what: str, id_header: bool = True):
        """One generating request: `work(body)` prepares it and gives (streams?, open the stream(t0),
        the whole answer(t0)); errors become OpenAI error JSON, a streamed answer server-sent events.
        `id_header`: an `X-Request-Id` header names the request, as in vLLM's chat and text completions
        (the Responses API has no `request_id`)."""
        t0 = time.perf_counter()
        ask_ttft_parts(request.headers.get("x-ttft-parts", "0").lower() not in ("0", "false", "no", "off", ""))
        try:
            body = await self._body(request)
            if id_header:
                body = with_header_request_id(body, request.headers.get("x-request-id"))
            stream, open_stream, complete = await work(body)
            if stream:
                return StreamingResponse(await open_stream(t0), media_type="text/event-stream", headers=SSE_HEADERS)
            answer = complete(t0)
            if not request.scope.get(SHARED_PORT_SCOPE):
                return FastJSONResponse(await answer)
            answer = await unless_client_leaves(answer, request.receive)  # uvicorn would not cancel it
            return FastJSONResponse(answer) if answer is not None else Response(status_code=499)
        except Exception as e:
            err = _as_client_error(e, what)
            self.chat.record(id=None, status=err.status, e2e_s=time.perf_counter() - t0)
            return error_response(err)

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's: a prompt's or chat messages' token ids (app/api/tokenize.py). Not a generation: not
        counted in the request metrics."""
        return await self._tokens(request, self.tokens.tokenize)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's: token ids' text."""
        return await self._tokens(request, self.tokens.detokenize)

    async def _tokens(self, request: Request, handle):
        try:
            return FastJSONResponse(handle(await self._body(request)))
        except Exception as e:
            return error_response(_as_client_error(e, request.url.path))

    async def _body(self, request: Request):
        """The request's JSON body, within `max_request_bytes`."""
        return parse_json(await read_body(request.stream(), request.headers.get("content-length"),
                                          self.cfg.max_request_bytes))
