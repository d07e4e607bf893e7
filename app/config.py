"""Typed application configuration.

Every field the application builder accepts is declared here, so a misspelt or
unknown field fails at start-up with its name instead of being silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MediaConfig(_Strict):
    """Decoding, sampling and per-request limits for images and videos."""

    video_fps: float = Field(2.0, gt=0, description="frames sampled per second of video")
    video_min_frames: int = Field(4, ge=2, description="fewest frames sampled from one video (short clips too)")
    video_max_frames: int = Field(64, ge=2, description="most frames sampled from one video; a long video is "
                                  "sampled more sparsely than video_fps")
    image_min_pixels: int = Field(64 * 32 * 32, gt=0, description="smart-resize lower bound")
    image_max_pixels: int = Field(1024 * 1024, gt=0, description="smart-resize upper bound")
    video_min_pixels: int = Field(64 * 32 * 32, gt=0, description="per-frame lower bound")
    video_max_pixels: int = Field(256 * 32 * 32, gt=0, description="per-frame upper bound")
    max_items_per_request: int = Field(16, ge=1, description="images + videos per request; more is a 400")
    max_frames_per_request: int = Field(256, ge=2, description="sampled video frames over all of a request's videos")
    max_input_pixels: int = Field(64_000_000, gt=0, description="decoded image size above which a request is refused")
    max_video_duration_s: float = Field(3600.0, gt=0, description="longest accepted video, checked from its "
                                        "headers before decoding")
    max_media_bytes: int = Field(256 * 1024 * 1024, gt=0, description="largest accepted media payload; a "
                                 "larger declared Content-Length is refused before the body (413)")
    max_media_bytes_in_flight: int = Field(4 << 30, gt=0, description="media payload bytes (http(s) bodies as "
                                           "declared, or as they arrive, decoded data: URLs, files) one process holds at once over "
                                           "all its requests, each from its first byte until its decode ends; an "
                                           "item that finds no room within media_bytes_wait_s is refused with 503 "
                                           "overloaded and Retry-After. At least max_media_bytes")
    media_bytes_wait_s: float = Field(5.0, ge=0, description="how long an item waits for room in "
                                      "max_media_bytes_in_flight before its request gets the 503")
    fetch_timeout_s: float = Field(15.0, gt=0, description="total deadline of one http(s) fetch, redirects and "
                                   "body included")
    max_redirects: int = Field(3, ge=0, le=10, description="redirect hops followed; each is checked again")
    allowed_domains: list[str] = Field(default_factory=list, description="hosts that http(s) media may come from "
                                       "('*.example.com' = its subdomains); empty = any public host")
    allow_private_networks: bool = Field(False, description="let http(s) media reach loopback, private, link-local "
                                         "and other non-public addresses (trusted networks only)")
    allowed_private_endpoints: list[str] = Field(
        default_factory=list, description="non-public addresses that stay reachable when allow_private_networks is "
        "off: '10.0.0.5:9000', '10.1.0.0/16', '[fd00::1]:8080' (a port limits the entry to that port)")
    allowed_local_media_path: str | None = Field(None, description="directory that file:// media may be read "
                                                 "from; None = file:// refused")
    worker_threads: int = Field(2, ge=1, description="decode/resize/hash threads per MediaPreprocessor replica, "
                                "and per Router for the inline images it prepares itself "
                                "(Pillow, PyAV, numpy copies and SHA-256 release the GIL for most of an item)")
    decode_timeout_s: float = Field(30.0, gt=0, description="deadline for decoding and preparing one item")
    router_local_below: int = Field(1, ge=0, description="the Router prepares a request's inline images itself "
                                    "(no hop to a MediaPreprocessor replica) while fewer than this many requests "
                                    "are preparing media in it and one of its media threads is free; 0: always the replicas "
                                    "(app/media/adaptive.py)")
    router_local_bytes: int = Field(2 << 20, ge=0, description="inline media (data: URL characters) of one request "
                                    "above which it always goes to the replicas")
    max_video_streams: int = Field(16, ge=1, description="streams a video container may hold")
    max_decoded_video_bytes: int = Field(2 << 30, gt=0, description="RGB bytes of one video's sampled frames "
                                         "before the resize (64 frames of 4K: 1.6 GB)")

    @field_validator("allowed_private_endpoints")
    @classmethod
    def _check_endpoints(cls, v: list[str]) -> list[str]:
        from .media.netpolicy import parse_endpoint

        for entry in v:
            parse_endpoint(entry)  # ValueError names the entry
        return v

    @field_validator("allowed_local_media_path")
    @classmethod
    def _check_local_root(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("allowed_local_media_path must be an absolute path")
        return v

    @model_validator(mode="after")
    def _check_bounds(self) -> MediaConfig:
        if self.video_min_frames > self.video_max_frames:
            raise ValueError("video_min_frames must not exceed video_max_frames")
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError("image_min_pixels must not exceed image_max_pixels")
        if self.video_min_pixels > self.video_max_pixels:
            raise ValueError("video_min_pixels must not exceed video_max_pixels")
        if self.max_media_bytes_in_flight < self.max_media_bytes:  # else a valid item could never get room
            raise ValueError("max_media_bytes_in_flight must be at least max_media_bytes")
        return self


class EncoderConfig(_Strict):
    """Vision encoder: CUDA-graph budgets and per-batch limits (see app/vision/graphs.py)."""

    cuda_graphs: bool = Field(True, description="capture CUDA graphs per token budget (ignored without CUDA); "
                              "false runs every batch eagerly")
    token_budgets: list[int] | None = Field(None, description="explicit budgets (patch tokens); else powers of two")
    min_budget: int = Field(256, ge=4, description="smallest generated budget, in patch tokens")
    max_budget: int = Field(8192, ge=4, description="largest generated budget (included); larger batches "
                            "run eagerly or are cut into chunks that fit")
    budget_steps_per_octave: int = Field(4, ge=1, le=16, description="generated budgets between powers of two")
    max_items_per_batch: int = Field(16, ge=1, description="items per encoder batch that a graph accepts")
    max_frames_per_batch: int = Field(32, ge=1, description="attention sequences (images + temporal groups)")
    autotune: bool = Field(True, description="drop graphs that are not faster than eager")
    autotune_cache: bool = Field(True, description="keep the auto-tune's table and the tower's GEMM choice on "
                                 "disk (under cache_dir, per GPU model, checkpoint config, dtype, graph settings "
                                 "and tower code): a replica starting where one already tuned applies them instead "
                                 "of timing, and replicas starting together let the first tune alone "
                                 "(app/gpu/tune_cache.py)")
    uniform_graph_shapes: list[tuple[int, int]] = Field(
        default_factory=list, description="(sequences, length) exact-shape graphs captured at start-up")
    uniform_capture_after: int = Field(0, ge=0, description="sightings of an equal-length shape before its graph "
                                       "is captured while serving (when the queue is empty; each capture then "
                                       "stalls the replica ~0.25 s); 0 = only the listed shapes")
    max_uniform_graphs: int = Field(16, ge=0, description="exact-shape graphs per replica")
    eager_margin: float = Field(0.1, ge=0, description="a batch that fits a graph runs eagerly only when the "
                                "tuned eager time, raised by this fraction, still beats the graph (until "
                                "observe_dispatch has timed enough of its batches)")
    eager_when_faster: bool | None = Field(
        None, description="a batch that fits a graph may run eagerly where the auto-tune (eager_margin, "
        "observe_dispatch) expects eager to be faster, and the auto-tune drops a graph slower than eager; False: "
        "every graph captured is kept and a batch replays the smallest that holds it (eager only where none "
        "does: more tokens, items or frames than any graph holds). None: True, except "
        "under the `fused` placement, where the tower's eager launches share the process's GIL with the "
        "engine's thread, which the idle tuning runs do not see: on one H200 under MPS, 22 eager batches at "
        "180 req/s went with TTFT p99 302 against 208 ms without eager, and encode run 14.4 against 6.8 ms "
        "mean (benchmarks/results/2026-12-03-ttft-tail-and-eager-tower-h200.md)")
    observe_dispatch: bool = Field(True, description="correct the auto-tune's graph and eager estimates with the "
                                   "times of the batches served (CUDA events), and time the other path on one "
                                   "batch in 16 near a tie, in 4 while it has no timings (app/vision/observed.py)")
    batch_wait_ms: float = Field(2.0, ge=0, description="longest wait for other requests' items before a batch runs; none when the encoder was idle")
    batch_wait_when_idle: bool = Field(False, description="wait batch_wait_ms even after an idle spell: fuller batches, "
                                       "later first tokens (batch jobs turn it on)")
    backlog_wait_ms: float = Field(0.0, ge=0, description="`fused` placement: while the engine has requests waiting "
                                   "for a sequence slot or KV blocks, a tower batch waits up to this long (instead of batch_wait_ms) for "
                                   "more items, since encoding sooner would not start them sooner and a fuller batch "
                                   "costs the shared GPU less per image; 0 = off (not yet measured on GPUs)")
    pinned_pixel_copy: bool = Field(True, description="patch rows go to the GPU through pinned host buffers and a copy "
                                    "stream, so that their copy waits neither for the stream nor for the LLM's step "
                                    "(app/vision/staging.py); batches below pinned_copy_min_rows are copied directly")
    pinned_copy_min_rows: int = Field(2048, ge=0, description="smallest batch, in patch rows, staged in pinned memory: "
                                      "on an H200 a single 448^2 image (784 rows) staged added 4-6 ms of TTFT at "
                                      "concurrency 1 in the fused replica, while batches of 1024^2 images did not")
    cache_bytes: int = Field(512 * 1024 * 1024, ge=0, description="embedding cache size per replica; 0 = off")
    stream: Literal["shared", "own"] = Field(
        "shared", description="`fused` placement on a GPU: 'shared' = the tower's batches queue on the engine's "
        "stream, between its steps; 'own' = on a CUDA stream of their own, beside the steps, and a request "
        "reaches the engine once its embeddings are made (app/vision/service.py). On an H200 'own' gave +3% "
        "at 1024^2 and concurrency 64, -3% at 128, and 1-11 ms more TTFT at concurrency 1 (benchmarks/RESULTS.md)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="the tower's dtype; auto: bfloat16 on CUDA, float32 on the CPU")
    dense_attention: Literal["sdpa", "flash4"] = Field(
        "sdpa", description="kernel of the graphs' attention over equal-length sequences (a 1024^2 image, equal "
        "slices): 'sdpa' = PyTorch's SDPA (cuDNN first in graphs), 'flash4' = FlashAttention-4 (the optional "
        "flash-attn-4 package, Hopper/Blackwell, bf16/fp16; an error at start if it cannot run; no effect "
        "with cuda_graphs off; app/vision/flash4.py)")

    @model_validator(mode="after")
    def _check_budgets(self) -> EncoderConfig:
        if self.min_budget > self.max_budget:
            raise ValueError("min_budget must not exceed max_budget")
        for b in self.token_budgets or []:
            if b <= 0 or b % 4:
                raise ValueError(f"token budget {b} must be a positive multiple of 4")
        for seqs, length in self.uniform_graph_shapes:
            if seqs < 1 or length <= 0 or length % 4:
                raise ValueError(f"uniform graph shape {(seqs, length)}: sequences >= 1, length a positive multiple of 4")
        return self


class LLMConfig(_Strict):
    """Text generation (app/llm/): a paged KV cache, chunked prefill inside decode steps, prefix caching."""

    max_model_len: int = Field(8192, ge=16, description="prompt + completion limit per request")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that gives none")
    max_num_seqs: int | None = Field(None, ge=1, description="requests decoded together; default 256 on a GPU, "
                                     "8 on the CPU. Costs no memory: the KV cache is a shared pool of blocks")
    max_num_batched_tokens: int = Field(2048, ge=16, description="tokens per engine step (decodes + prefill "
                                        "chunks): a long prompt is prefilled in chunks of at most this many "
                                        "tokens, each step also decoding every running request")
    max_waiting: int = Field(256, ge=0, description="queued requests beyond the running ones; more get 503")
    block_size: int = Field(16, ge=1, description="tokens per KV-cache block (the prefix-caching granularity)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="fraction of the GPU memory that is free "
                                          "after the weights and a forward at the step's token budget, given to "
                                          "the KV cache")
    num_kv_blocks: int | None = Field(None, ge=2, description="explicit KV pool size in blocks (overrides "
                                      "gpu_memory_utilization; the CPU default holds max_num_seqs x max_model_len)")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prompt prefixes; vision "
                                        "tokens are identified by their media's content key")
    cuda_graphs: bool = Field(True, description="decode steps replayed from CUDA graphs per batch bucket")
    step_graphs: bool = Field(True, description="with cuda_graphs: every other step (prefill chunks, alone or "
                              "beside decodes) replayed from a CUDA graph per token bucket instead of launched "
                              "kernel by kernel (a 1000-token prompt's TTFT 7.6-8.1 against 10.2-14.7 ms on an "
                              "H200); false launches them eagerly (benchmarks/RESULTS.md, 'Step graphs')")
    decode_kv_splits: int = Field(32, ge=1, description="decode attention: the most programs one sequence's "
                                  "keys are split over (the partial softmaxes merged after), used only where a "
                                  "decode step's sequences x KV heads fill less than half the GPU (one stream of "
                                  "a model with few KV heads, or one rank's share under tensor parallelism); 1 "
                                  "never splits")
    decode_gemv: bool = Field(True, description="on CUDA: the engine times, at start-up, each projection shape "
                              "of one- and two-token steps (qkv, o, the MoE router, the dense MLP) as a Triton "
                              "matrix-vector product against cuBLAS, and uses the kernel where it is faster "
                              "(app/llm/gemv.py; a few seconds of start-up); false keeps cuBLAS throughout")
    decode_gemv_split: bool = Field(True, description="with decode_gemv: split-K tiles among the candidates "
                                    "(K divided among several programs per column tile, the parts summed in the "
                                    "same launch); single-stream 30B-A3B 1.05x on an H200 without PDL, 1.02x on "
                                    "an H100 with it (decode.py --gemv-split / --no-gemv-split, 2026-12-02)")
    decode_gemv_cache: bool = Field(True, description="with decode_gemv: the choice is kept under cache_dir "
                                    "(gemv-tune/), keyed by GPU model, libraries, checkpoint config, dtype, tensor "
                                    "parallelism and the engine's code, and a replica that finds one applies it "
                                    "and times nothing (a restart, a scale-up, the second replica on a GPU; "
                                    "app/gpu/tune_cache.py)")
    pdl: bool = Field(True, description="on Hopper and later: the engine's Triton kernels are launched with "
                      "programmatic dependent launch, so that each may start while the one before it finishes (its "
                      "blocks wait on the device for that one's writes); aimed at single-stream decode, whose ~600 "
                      "kernels a token left the GPU idle 13% of the time on an H200 (app/llm/pdl.py): 1.10-1.12x "
                      "single-stream on 30B-A3B on one H200 (decode.py against --no-pdl, 2026-12-02); the whole GPU "
                      "suite passed with it on. Ignored on older GPUs and on the CPU; false launches as before")
    overlap_steps: bool | None = Field(None, description="plan and launch step N+1 while step N runs on the "
                                       "device (its sampled tokens fed back on the device), so the GPU does not "
                                       "wait for the host between steps; None: on with CUDA, off on the CPU "
                                       "(nothing to overlap there)")
    stream_interval_ms: float = Field(10.0, ge=0, description="a stream sends at most one chunk per interval "
                                      "after its first (tokens that arrive meanwhile are merged); 0 = every step")
    switch_interval_ms: float | None = Field(0.2, gt=0, description="the GIL switch interval the engine sets for "
                                             "its process (sys.setswitchinterval; Python's default is 5 ms): how long "
                                             "the engine thread and the replica's event loop wait for each other's "
                                             "turn; None leaves the interpreter's")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="the text model's dtype; auto: bfloat16 on CUDA, float32 on the CPU")
    load_format: Literal["auto", "dummy"] = Field("auto", description="auto: the checkpoint's safetensors; dummy: "
                                                  "random weights made on the device, for the LLM and the vision "
                                                  "tower (benchmarks of shapes whose checkpoints cannot be written "
                                                  "to disk: a folder built with --config-only serves; config, "
                                                  "tokenizer and processor files are still read from it)")
    moe_parallel: Literal["tp", "ep"] = Field("tp", description="under tensor parallelism, how MoE layers split: "
                                              "every expert's units over the ranks (tp) or whole experts per rank "
                                              "(ep)")
    tp_all_reduce: Literal["nccl", "symm_mem"] = Field(
        "nccl", description="under tensor parallelism, the all-reduces of up to 512 KB (decode steps): NCCL's, or "
        "one kernel over torch's symmetric memory (checked against NCCL at start, NCCL kept if it cannot; "
        "app/llm/symm_all_reduce.py). 1.7% faster than NCCL at one stream on two H200s; under Ray each rank sees "
        "its one GPU as cuda:0, which torch's rendezvous refuses, so a served replica keeps NCCL for now (logged)")

    def resolved_max_num_seqs(self, device_type: str) -> int:
        return self.max_num_seqs or (256 if device_type == "cuda" else 8)


class PlacementConfig(_Strict):
    """Where replicas go (app/serving/placement.py turns this and the cluster's GPU count into Ray options).

    Policies: `colocate` puts one encoder and one LLM replica on every GPU; `fused` puts one LLM
    replica on every GPU with the vision tower inside it (the embeddings never leave the GPU; no
    VisionEncoder replicas run); `split` gives the encoder `encoder_gpus` GPUs and the LLM the others;
    `auto` picks (docs/concepts/placement.md). Without GPUs every replica runs on the CPU, one of each unless
    autoscaling says otherwise (`fused` is kept there: one LLM replica that also encodes)."""

    policy: Literal["auto", "colocate", "fused", "split"] = Field(
        "auto", description="fused: the tower inside each LLM replica; colocate: an encoder and an LLM replica "
        "on every GPU; split: GPUs divided between the two; auto: fused on GPUs, colocate when encoder_replicas "
        "or encoder_num_gpus is set")
    encoder_gpus: int | Literal["auto"] = Field("auto", description="split: GPUs for the encoder (auto: 1)")
    llm_gpus: int | Literal["auto"] = Field("auto", description="split: GPUs for the LLM (auto: the rest)")
    encoder_replicas: int | Literal["auto"] = Field("auto", description="auto: none under fused, one per encoder "
                                                    "GPU (colocate: one per GPU); 1 without GPUs")
    llm_replicas: int | Literal["auto"] = Field("auto", description="auto: `llm_replicas_per_gpu` per LLM GPU; 1 "
                                                "without GPUs")
    llm_replicas_per_gpu: int = Field(1, ge=1, description="LLM replicas sharing each LLM GPU when llm_replicas is "
                                      "auto: more processes for the host work (each its own GIL), at the cost of a "
                                      "copy of the weights (and under fused, of the tower) per replica; they split "
                                      "llm.gpu_memory_utilization between them")
    llm_tensor_parallel: int = Field(1, ge=1, description="GPUs per LLM replica: the model is split over this many "
                                     "GPUs of one node (tensor parallelism; a placement group of that many bundles, "
                                     "STRICT_PACK), for models too large for one GPU (Qwen3-VL-32B, the MoE models). "
                                     "Replicas are whole groups: each node holds its GPUs // this many. With the "
                                     "fused placement (or on the CPU, over gloo)")
    encoder_num_gpus: float | Literal["auto"] = Field("auto", description="explicit GPU share per encoder replica")
    llm_num_gpus: float | Literal["auto"] = Field("auto", description="explicit GPU share per LLM replica")
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved by each encoder and LLM replica")
    router_replicas_per_gpu: int = Field(3, ge=1, description="the Routers' autoscaling floor per GPU of the "
                                         "cluster (the ceiling is twice it; 1 to 4 without GPUs), unless a config "
                                         "file's deployments section gives the Router an autoscaling_config. Each "
                                         "Router is one Python process for HTTP, JSON and prompts: two GPUs served "
                                         "1.31x one with two Routers, 1.73x with six pinned (benchmarks/RESULTS.md)")
    media_replicas_per_gpu: int = Field(4, ge=1, description="the MediaPreprocessor's autoscaling floor per GPU "
                                        "of the cluster (at most a quarter of its cores; the ceiling half the "
                                        "cores, at least twice it; 1 without GPUs), unless a config file's deployments section "
                                        "gives it an autoscaling_config. Media costs ~12 ms of CPU per request and "
                                        "the autoscaler adds replicas only after seconds of load: on four H200s "
                                        "four replicas served 500.76 req/s, twelve 764.88. Four per GPU keep one "
                                        "GPU's floor at the four measured there (264 req/s, GPU-bound)")
    prefer_local_node: bool = Field(False, description="each Router sends a request to the media, encoder and "
                                    "LLM replicas of its own node first, and to another node's only when none "
                                    "of its own has room: no pixels or tokens cross the network. For a cluster "
                                    "whose traffic a load balancer spreads over every node's port; with one "
                                    "entry node it would leave the other nodes' GPUs idle, hence off by "
                                    "default (docs/guides/cluster.md)")
    router_num_cpus: float = Field(0.5, ge=0, description="CPUs reserved by each Router replica")
    media_num_cpus: float = Field(0.5, ge=0, description="CPUs reserved by each MediaPreprocessor replica")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="requests each replica (router, encoder, LLM) takes at once, unless a config "
        "file's deployments section sets it. Ray Serve's default of 5 caps the LLM's continuous batching and the "
        "encoder's cross-request batching at 5 requests")

    @model_validator(mode="after")
    def _check_split(self) -> PlacementConfig:
        for name in ("encoder_gpus", "llm_gpus", "encoder_replicas", "llm_replicas"):
            v = getattr(self, name)
            if v != "auto" and v < (0 if name.endswith("gpus") else 1):
                raise ValueError(f"placement.{name} must be 'auto' or {'>= 0' if name.endswith('gpus') else '>= 1'}")
        return self


class RetryConfig(_Strict):
    """Router retries of encoder + LLM calls that failed because a replica died (app/api/retry.py)."""

    max_attempts: int = Field(4, ge=1, description="tries per request, the first included")
    budget_s: float = Field(90.0, gt=0, description="no new try starts after this long, and a retried try "
                            "waits for its first chunk only until then (a restarted replica on a loaded CPU "
                            "machine takes tens of seconds)")
    backoff_s: float = Field(0.5, ge=0, description="wait before the first retry; doubles on each further one")


class AppConfig(_Strict):
    """Arguments of `deployments.app:build_app` (the `args:` block of serve_config.yaml)."""

    model: str = Field("embedded:tiny", description="'embedded:<preset>' or a path to a Qwen3-VL checkpoint")
    served_model_name: str | None = Field(None, description="the model id in responses and /v1/models; None: "
                                          "the preset's or the checkpoint folder's name")
    cache_dir: str | None = Field(None, description="where embedded checkpoints are built, the tower's auto-tune "
                                  "table and the compiled Triton kernels kept (app/gpu/kernel_cache.py); default "
                                  "~/.cache/vlm-serve")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when the replica has a GPU, "
                                                   "else cpu")
    media: MediaConfig = Field(MediaConfig(), description="decoding, sampling and limits for images and videos")
    encoder: EncoderConfig = Field(EncoderConfig(), description="the vision encoder: CUDA-graph budgets, "
                                   "batching, embedding cache")
    llm: LLMConfig = Field(LLMConfig(), description="the LLM engine: KV cache, step budget, CUDA graphs")
    placement: PlacementConfig = Field(PlacementConfig(), description="where replicas go and what they "
                                       "reserve; the Routers' and media replicas' autoscaling floors")
    retry: RetryConfig = Field(RetryConfig(), description="retries of requests whose replica died before "
                               "their first token")
    api_key: SecretStr | None = Field(None, description="required as 'Authorization: Bearer <key>' on every path "
                                      "but /health; None = the env var VLM_API_KEY, if set. Never printed")
    max_request_bytes: int = Field(384 * 1024 * 1024, gt=0, description="largest accepted request body (base64 "
                                   "data: URLs are 4/3 of their media's size)")
    router_http_port: int | None = Field(None, ge=1, le=65535, description="every Router replica also serves HTTP "
                                         "itself on this port, shared by a node's Routers (SO_REUSEPORT): no proxy hop "
                                         "(app/api/shared_port.py); None = only Ray Serve's proxy")
    router_http_host: str = Field("0.0.0.0", description="the address router_http_port binds")
    sampling_defaults: Literal["checkpoint", "openai"] = Field(
        "checkpoint", description="what sampling parameters a request omits take: 'checkpoint' = the values of "
        "the checkpoint's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; "
        "max_new_tokens caps llm.default_max_tokens), as vLLM's default --generation-config auto; 'openai' = "
        "OpenAI's (temperature 1, no top-p or top-k), as vLLM's --generation-config vllm. /v1/models lists them")
    reject_unknown_parameters: bool = Field(
        False, description="a request parameter this server does not know (nor a chat_template_kwargs name its "
        "chat template reads) is a 400 unsupported_parameter; false: it is ignored, logged once per name and "
        "counted in vlm_unknown_parameters_total")
    enable_prompt_tokens_details: bool = Field(
        False, description="usage.prompt_tokens_details.cached_tokens (Responses: input_tokens_details) says how "
        "many prompt tokens the prefix cache served, as vLLM's --enable-prompt-tokens-details; off by default as "
        "there (a repeated prompt's usage then differs from its first)")
    warmup: bool | None = Field(None, description="before a replica reports ready, it sends itself real requests "
                                "through the real path (app/serving/warmup.py: the LLM replica every sampling, log-probability, "
                                "structured-output and, under fused, media path; a media replica each codec), so its "
                                "first users meet compiled kernels; None: on with CUDA, off on the CPU")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model.split(":", 1)[1] if self.model.startswith("embedded:") else self.model.rstrip("/").split("/")[-1]
