#!/usr/bin/env bash
# The tools users point at servers, run against a running server (`make serve`: the CPU server with the
# embedded tiny random-weight model on :8000) with image inputs where the tool takes them (issue 44, item 5):
#   sdk       the official `openai` SDK: /v1/chat/completions (image), /v1/completions, /v1/responses
#             (input_image), each streamed and not
#   aiperf    NVIDIA AIPerf `aiperf profile`: chat with synthetic images, then completions and responses (text)
#   guidellm  GuideLLM `guidellm run`: synthetic images, synchronous then Poisson
#   eval      an OpenAI-speaking VLM evaluation harness on a few image items (lmms-eval; see the results page)
# Each stage reads the server's /metrics before and after and writes the delta of
# vllm:request_success_total (by finished_reason) beside the tool's own counts.
#
#   bash benchmarks/third_party_clients.sh [STAGE ...]      # default: sdk aiperf guidellm eval
#
# Environment: URL (http://localhost:8000), OUT (benchmarks/results/third_party_2026-11-27), VENVS (/tmp:
# the tools live in $VENVS/venv-aiperf, venv-guidellm, venv-lmms, each created and filled with pip when
# missing), PY (python3 with `openai` installed, for the sdk stage), N (20 requests per run), C
# (concurrency 2), OSL (output tokens per request, 16), IMG (image side, 64 px), START=1 starts
# `serve run serve_config.yaml` when nothing answers at URL and stops it (SIGINT) at the end.
# The tokenizer is the served checkpoint's folder (app.checkpoints.model_builder.resolve_model): nothing
# is downloaded from the Hugging Face hub (HF_HUB_OFFLINE=1).
set -uo pipefail
cd "$(dirname "$0")/.."
URL=${URL:-http://localhost:8000}
OUT=${OUT:-benchmarks/results/third_party_2026-11-27}
VENVS=${VENVS:-/tmp}
PY=${PY:-python3}
N=${N:-20}
C=${C:-2}
OSL=${OSL:-16}
IMG=${IMG:-64}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(sdk aiperf guidellm eval)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/third_party.XXXXXX)   # the tools' full artifacts (large); only summaries go to $OUT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 NO_PROXY=localhost,127.0.0.1
log() { echo "== $*" | tee -a "$OUT/run.log"; }

SERVER_PID=
if [ "${START:-0}" = 1 ] && ! curl -sf "$URL/health" >/dev/null; then
    log "starting serve run serve_config.yaml"
    # A background job of a script starts with SIGINT ignored, and Python keeps it so: restore the default
    # before exec, so that SIGINT makes `serve run` shut Serve and its own Ray down (as Ctrl-C does).
    setsid env $($PY -m deployments.ray_env) $PY -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
        serve run serve_config.yaml >"$WORK/serve.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 300); do curl -sf "$URL/v1/models" >/dev/null && break; sleep 1; done
fi
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -INT "$SERVER_PID"
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || return 0; sleep 1; done
    kill -TERM "$SERVER_PID"
}
trap stop_server EXIT
curl -sf "$URL/v1/models" >/dev/null || { echo "no server at $URL (START=1 starts one)"; exit 1; }
MODEL=$(curl -s "$URL/v1/models" | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
TOKENIZER=$($PY -c "from app.checkpoints.model_builder import resolve_model; print(resolve_model('embedded:tiny'))")
log "$(date -u +%FT%TZ) server $URL model $MODEL tokenizer $TOKENIZER"

# The server's finished requests by reason, from /metrics.
snapshot() {
    curl -s "$URL/metrics" | $PY -c '
import json, re, sys
out = {}
for line in sys.stdin:
    m = re.match(r"vllm:request_success_total\{(.*)\} (\S+)", line)
    if m:
        reason = re.search(r"finished_reason=\"([^\"]*)\"", m.group(1)).group(1)
        out[reason] = out.get(reason, 0) + float(m.group(2))
    elif line.startswith("vllm:e2e_request_latency_seconds_count"):
        out["e2e_count"] = float(line.split()[-1])
    elif line.startswith("vlm:encoder_items_total"):  # images encoded: the tool did send images
        out["images_encoded"] = float(line.split()[-1])
print(json.dumps(out))'
}
# server_delta NAME BEFORE: writes $OUT/NAME.server.json and prints one line
server_delta() {
    local after; after=$(snapshot)
    $PY - "$2" "$after" "$OUT/$1.server.json" <<'EOF'
import json, sys
b, a = json.loads(sys.argv[1]), json.loads(sys.argv[2])
d = {k: int(a.get(k, 0) - b.get(k, 0)) for k in a}
d["finished_ok"] = d.get("stop", 0) + d.get("length", 0)  # requests (choices) the server finished
json.dump(d, open(sys.argv[3], "w"), indent=1, sort_keys=True)
print("server /metrics delta:", json.dumps(d, sort_keys=True))
EOF
}
venv() {  # venv NAME PIP_SPEC...: $VENVS/venv-NAME, installed when its first spec is missing
    local v="$VENVS/venv-$1"; shift
    [ -x "$v/bin/python" ] || python3 -m venv "$v"
    "$v/bin/pip" show -q "${1%%[*}" 2>/dev/null || "$v/bin/pip" install -q "$@" >>"$WORK/pip.log" 2>&1
    echo "$v"
}

stage_sdk() {
    log "sdk: openai $($PY -c 'import openai; print(openai.__version__)')"
    local before; before=$(snapshot)
    $PY - "$URL" "$MODEL" "$OUT/sdk.json" <<'EOF' 2>&1 | tee -a "$OUT/run.log"
import base64, io, json, sys
import openai
from PIL import Image

url, model, out = sys.argv[1:4]
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
buf = io.BytesIO()
Image.effect_noise((96, 64), 60).convert("RGB").save(buf, "JPEG")
data_url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
chat_msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                          {"type": "text", "text": "Describe the picture."}]}]
resp_input = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url},
                                           {"type": "input_text", "text": "Describe the picture."}]}]
results, sent, ok = [], 0, 0


def record(name, fn):
    global sent, ok
    sent += 1
    try:
        r = fn()
        ok += 1
        results.append({"call": name, "ok": True, **r})
    except Exception as e:  # the SDK's own error: recorded, the run goes on
        results.append({"call": name, "ok": False, "error": f"{type(e).__name__}: {e}"})
    print(json.dumps(results[-1])[:300])


def chat(stream):
    if not stream:
        r = client.chat.completions.create(model=model, messages=chat_msgs, max_tokens=8)
        return {"finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump()}
    chunks = list(client.chat.completions.create(model=model, messages=chat_msgs, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    return {"chunks": len(chunks), "finish_reason": [c.choices[0].finish_reason for c in chunks if c.choices][-1],
            "usage": chunks[-1].usage.model_dump()}


def completions(stream):
    if not stream:
        r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8)
        return {"finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump()}
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    return {"chunks": len(chunks), "usage": chunks[-1].usage.model_dump()}


def responses(stream):
    if not stream:
        r = client.responses.create(model=model, input=resp_input, max_output_tokens=8)
        return {"status": r.status, "output_text": len(r.output_text), "usage": r.usage.model_dump()}
    events = list(client.responses.create(model=model, input=resp_input, max_output_tokens=8, stream=True))
    return {"events": [e.type for e in events][:3] + ["..."] + [events[-1].type],
            "usage": events[-1].response.usage.model_dump()}


for name, fn in (("chat", chat), ("completions", completions), ("responses", responses)):
    for stream in (False, True):
        record(f"{name} stream={stream}", lambda: fn(stream))
json.dump({"openai": openai.__version__, "sent": sent, "ok": ok, "calls": results}, open(out, "w"), indent=1)
print(f"sdk: {ok}/{sent} calls succeeded")
EOF
    server_delta sdk "$before" | tee -a "$OUT/run.log"
}

# aiperf_summary NAME DIR: the tool's own counts and warnings -> $OUT/NAME.aiperf.json
aiperf_summary() {
    $PY - "$2" "$OUT/$1.aiperf.json" <<'EOF' | tee -a "$OUT/run.log"
import json, re, sys
from pathlib import Path
d = Path(sys.argv[1])
p = json.loads((d / "profile_export_aiperf.json").read_text())
def stat(k, f="avg"):
    v = p.get(k)
    return v.get(f) if isinstance(v, dict) else v
log = (d / "logs" / "aiperf.log").read_text()
warn = sorted({re.sub(r"\d+", "N", m) for m in re.findall(r" - WARNING - ([^\n]{0,160})", log)})
sm = d / "server_metrics_export.json"
server_metrics = None
if sm.exists():
    s = json.loads(sm.read_text())
    succ = s["metrics"].get("vllm:request_success", {}).get("series", [])
    server_metrics = {"endpoints_successful": s["summary"]["endpoints_successful"],
                      "metrics": len(s["metrics"]),
                      "request_success_total_delta": {x["labels"]["finished_reason"]: x["stats"]["total"] for x in succ}}
out = {"aiperf": p.get("aiperf_version"), "request_count": stat("request_count"),
       "completed_request_count": stat("completed_request_count"), "error_request_count": stat("error_request_count") or 0,
       "request_error_rate": stat("request_error_rate"), "error_summary": p.get("error_summary"),
       "usage_completion_tokens_avg": stat("usage_completion_tokens"), "output_sequence_length_avg": stat("output_sequence_length"),
       "osl_mismatch_count": stat("osl_mismatch_count"), "usage_discrepancy_count": stat("usage_discrepancy_count"),
       "ttft_ms_p50": stat("time_to_first_token", "p50"), "request_throughput": stat("request_throughput"),
       "server_metrics": server_metrics, "warnings": warn,
       "prometheus_found": "Server metrics enabled - 1/1 endpoint(s) reachable" in log}
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: out[k] for k in ("request_count", "completed_request_count", "error_request_count",
                                      "osl_mismatch_count", "prometheus_found")}))
EOF
}

stage_aiperf() {
    local v; v=$(venv aiperf aiperf)
    log "aiperf: $("$v/bin/pip" show aiperf | grep ^Version)"
    local common=(-m "$MODEL" --url "$URL" --tokenizer "$TOKENIZER" --request-count "$N" --concurrency "$C"
                  --random-seed 0 --synthetic-input-tokens-mean 32 --synthetic-input-tokens-stddev 0
                  --output-tokens-mean "$OSL" --output-tokens-stddev 0 --extra-inputs "min_tokens:$OSL" --ui none)
    # chat: one synthetic JPEG per request, streamed; output lengths counted with the client's tokenizer
    # (AIPerf's default), then completions and responses (text) with the server's usage counts
    local runs=("chat --streaming --image-width-mean $IMG --image-height-mean $IMG --image-format jpeg"
                "completions --streaming --use-server-token-count"
                "responses --streaming --use-server-token-count")
    for r in "${runs[@]}"; do
        set -- $r; local ep=$1; shift
        local before; before=$(snapshot)
        log "aiperf profile ${common[*]} --endpoint-type $ep $* --artifact-dir $WORK/aiperf_$ep"
        # (AIPerf 0.13 fails to load a local tokenizer folder under HF_HUB_OFFLINE=1: HFValidationError)
        timeout 600 env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE "$v/bin/aiperf" profile "${common[@]}" --endpoint-type "$ep" "$@" \
            --artifact-dir "$WORK/aiperf_$ep" >"$WORK/aiperf_$ep.log" 2>&1
        log "aiperf $ep exit $?"
        grep -v "^$" "$WORK/aiperf_$ep/profile_export_console.txt" > "$OUT/aiperf_$ep.console.txt" 2>/dev/null
        tail -80 "$WORK/aiperf_$ep.log" > "$OUT/aiperf_$ep.log.tail.txt"
        [ -f "$WORK/aiperf_$ep/profile_export_aiperf.json" ] && aiperf_summary "aiperf_$ep" "$WORK/aiperf_$ep"
        server_delta "aiperf_$ep" "$before" | tee -a "$OUT/run.log"
    done
}

stage_guidellm() {
    local v; v=$(venv guidellm "guidellm[vision]")
    log "guidellm: $("$v/bin/pip" show guidellm | grep ^Version)"
    # synchronous (one request at a time), then Poisson at 1 req/s; a synthetic noise image per request, no text
    # beyond GuideLLM's own, OSL output tokens; GuideLLM's default stream_options (continuous_usage_stats) kept
    local runs=("sync kind=synchronous" "poisson kind=poisson,rate=1")
    for r in "${runs[@]}"; do
        set -- $r; local name=$1 profile=$2
        local before; before=$(snapshot)
        local cmd=("$v/bin/guidellm" run --backend "kind=openai_http,target=$URL,model=$MODEL" --profile "$profile"
                   --constraint "kind=max_requests,count=$N"
                   --data "kind=synthetic_image,width=$IMG,height=$IMG,output_tokens=$OSL"
                   --output "kind=json,path=$WORK/guidellm_$name.json" --disable-console-interactive)
        log "${cmd[*]}"
        timeout 600 "${cmd[@]}" >"$WORK/guidellm_$name.log" 2>&1
        log "guidellm $name exit $?"
        grep -v '^\s*$' "$WORK/guidellm_$name.log" | tail -60 > "$OUT/guidellm_$name.log.tail.txt"
        [ -f "$WORK/guidellm_$name.json" ] && $PY - "$WORK/guidellm_$name.json" "$OUT/guidellm_$name.summary.json" <<'EOF' | tee -a "$OUT/run.log"
import json, sys
b = json.load(open(sys.argv[1]))["benchmarks"][0]
counts = {k: len(v or []) for k, v in b["requests"].items() if k != "total"}
toks = [r.get("output_tokens") for r in b["requests"].get("successful") or []]
errors = sorted({(r.get("info") or {}).get("error") or "?" for r in b["requests"].get("errored") or []})
out = {"requests": counts, "output_tokens_per_request": sorted(set(toks)), "errors": errors[:5],
       "duration_s": b.get("duration"), "profile": b.get("config", {}).get("strategy", {}).get("type_")}
json.dump(out, open(sys.argv[2], "w"), indent=1)
print("guidellm counts:", json.dumps(out))
EOF
        server_delta "guidellm_$name" "$before" | tee -a "$OUT/run.log"
    done
}

# lmms-eval's OpenAI-compatible backend (`--model openai`, OPENAI_API_BASE / OPENAI_API_KEY or model_args) on
# `pope_local`: lmms-eval's own POPE task (its utils.py: prompt, scoring, aggregation) with the dataset
# replaced by a local parquet of EVAL_ITEMS synthetic POPE-shaped items (noise images, yes/no questions),
# since the task's dataset (lmms-lab/POPE) lives on the Hugging Face hub.
stage_eval() {
    # lmms-eval 0.7.3 imports filelock._api, which filelock 4 no longer has (ModuleNotFoundError): pin 3.x
    local v; v=$(venv lmms lmms-eval "filelock<4")
    log "lmms-eval: $("$v/bin/pip" show lmms-eval | grep ^Version)"
    local tasks="$WORK/lmms_tasks/pope_local"; mkdir -p "$tasks"
    local sp; sp=$("$v/bin/python" -c 'import lmms_eval, os; print(os.path.dirname(lmms_eval.__file__))')
    cp "$sp/tasks/pope/utils.py" "$tasks/utils.py"
    "$v/bin/python" - "$tasks" "${EVAL_ITEMS:-8}" <<'EOF'
import io, sys
import datasets
from PIL import Image
d, n = sys.argv[1], int(sys.argv[2])
rows = {"question_id": [], "question": [], "answer": [], "category": [], "image": []}
for i in range(n):
    buf = io.BytesIO()
    Image.effect_noise((96 + 16 * i, 64 + 8 * i), 40 + i).convert("RGB").save(buf, "JPEG")
    rows["question_id"].append(str(i)); rows["category"].append("random")
    rows["question"].append(f"Is there a {['cat', 'dog', 'car', 'tree'][i % 4]} in the image?")
    rows["answer"].append("yes" if i % 2 else "no"); rows["image"].append({"bytes": buf.getvalue(), "path": None})
ds = datasets.Dataset.from_dict(rows, features=datasets.Features({k: datasets.Value("string") for k in rows if k != "image"}
                                                                  | {"image": datasets.Image()}))
ds.to_parquet(f"{d}/test.parquet")
open(f"{d}/pope_local.yaml", "w").write(f"""task: pope_local
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {d}/test.parquet
test_split: test
output_type: generate_until
doc_to_visual: !function utils.pope_doc_to_visual
doc_to_text: !function utils.pope_doc_to_text
doc_to_target: "answer"
generation_kwargs:
  max_new_tokens: 16
  temperature: 0
  do_sample: false
process_results: !function utils.pope_process_results
metric_list:
  - metric: pope_accuracy
    aggregation: !function utils.pope_aggregate_accuracy
    higher_is_better: true
lmms_eval_specific_kwargs:
  default:
    pre_prompt: ""
    post_prompt: "\\nAnswer the question using a single word or phrase."
""")
EOF
    local before; before=$(snapshot)
    # (max_retries is lmms-eval's number of attempts: 1 sends each request once, 0 sends nothing)
    local cmd=("$v/bin/lmms-eval" --model openai
               --model_args "model_version=$MODEL,base_url=$URL/v1,api_key=unused,num_concurrent=$C,max_retries=1,timeout=120"
               --tasks pope_local --include_path "$WORK/lmms_tasks" --batch_size 1
               --output_path "$WORK/lmms_out" --log_samples)
    log "${cmd[*]}"
    timeout 600 "${cmd[@]}" >"$WORK/lmms.log" 2>&1
    log "lmms-eval exit $?"
    grep -v '^\s*$' "$WORK/lmms.log" | tail -60 > "$OUT/lmms_eval.log.tail.txt"
    $PY - "$WORK/lmms_out" "$OUT/lmms_eval.summary.json" <<'EOF' | tee -a "$OUT/run.log"
import glob, json, sys
res = sorted(glob.glob(f"{sys.argv[1]}/**/*results.json", recursive=True))
smp = sorted(glob.glob(f"{sys.argv[1]}/**/*samples_pope_local.jsonl", recursive=True))
samples = [json.loads(l) for l in open(smp[-1])] if smp else []
out = {"results": json.load(open(res[-1]))["results"] if res else None, "samples": len(samples),
       "responses": [s.get("filtered_resps") or s.get("resps") for s in samples][:8]}
json.dump(out, open(sys.argv[2], "w"), indent=1)
print("lmms-eval:", json.dumps(out)[:600])
EOF
    server_delta lmms_eval "$before" | tee -a "$OUT/run.log"
}

for s in "${STAGES[@]}"; do "stage_$s"; done
log "done: $OUT (full artifacts in $WORK)"
