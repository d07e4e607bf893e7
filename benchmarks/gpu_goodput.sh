#!/usr/bin/env bash
# Goodput measured right (issue 45), in ONE device call, from the repository root with .gpu-deps carried:
#   bash benchmarks/gpu_goodput.sh [CONFIG] [goodput.py args ...]        (CONFIG: configs/qwen3-vl-2b-gpu.yaml)
# Stages (STAGES, default "one all crosscheck"), each its own `benchmarks/goodput.py --start` (Ray and the app
# started once per stage, stopped after it):
#   one        1 GPU: closed-loop saturation (serve.py's closed loop, --closed-loop C N), warm-up, goodput
#              search per workload, then cold start at 50% and 90% of the first workload's goodput (the app
#              deployed again; the load starts the moment /health and /v1/models answer).
#   all        every GPU of the host: closed loop, warm-up, goodput search (no cold start).
#   ab         an A/B against `one`: a fresh 1-GPU app with AB_ARGS (JSON deep-merged into the config's args, e.g.
#              '{"encoder": {"pinned_copy_min_rows": 0}}') at AB_RATES (default RATES_ONE, which `one` then
#              searches from, so that both sides hold points at the same rates), no search, no closed loop
#              (AB_CLOSED="C N": one); AB_MPS=1: the B side under CUDA MPS (nvidia-cuda-mps-control -d, quit after);
#              AB_ENV="VAR=value ...": the B side's process (and the Ray it starts) with these variables, e.g.
#              AB_ENV=RAY_max_direct_call_object_size=524288 (deployments/ray_env.py lets a set variable win)
#   crosscheck AIPerf or GuideLLM (CROSSCHECK_TOOL; default aiperf where .gpu-aiperf is carried) against a
#              fresh 1-GPU app at the goodput that `one` found (or CROSSCHECK_RATE), beside our own point of the
#              same shape, when the tool is importable here, AIPERF or GUIDELLM names its command, or its bundle
#              is carried (benchmarks/bundle_aiperf.sh, bundle_guidellm.sh; neither fits beside .gpu-deps,
#              so it goes in a call of its own on a machine an earlier call left with .gpu-deps unpacked:
#              STAGES=crosscheck CROSSCHECK_RATE=R); otherwise it writes why it was skipped to
#              $OUT/crosscheck.txt. CROSSCHECK_WORKERS="0 4": AIPerf once per value against the same app, with
#              that many worker processes (0: its default), each its own line and `runs` entry.
# Environment (defaults in brackets):
#   WORKLOADS [image]        goodput.py --workload, e.g. "image mix" (the mix's TTFT bound: --ttft-p99-ms-mix)
#   CLOSED_ONE [512 2048]    closed loop on 1 GPU: concurrency and requests (per workload); about 8 s at saturation
#   CLOSED_ALL [256*N 2048*N] the same on N GPUs (2026-11-27's 512 1024 on four H200s was 1.3 s: too short to read)
#   RATES_ONE / RATES_ALL    coarse rates; unset: FRACTIONS of the closed-loop throughput [0.5 0.7 0.85 1.0]
#   WINDOW [6] RAMP [2] WARMUP [6] MAX_POINTS [5] COLD_S [20]
#   COLD_FIRST (req/s)       the first deploy is itself the cold start at this rate (about half the expected
#                            goodput; its fraction of the measured goodput is reported), then only 0.9 is
#                            redeployed: one deploy less (60-100 s on the 2B preset)
#   MPS                      set: every stage runs under CUDA MPS (the daemon started first, quit at the end)
#   PROBE_IMPORTS            set: benchmarks/replica_imports.py (4 fresh processes, about a minute of BUDGET), a replica's imports and settings readers in fresh
#                            processes, ours against transformers' ($OUT/imports.txt, imports.json)
#   LOAD_ONE [2] LOAD_ALL [2 per GPU]   load processes (one process tops out at a few hundred streamed req/s)
#   BUDGET [570]             seconds this script may take in all; each stage gets a deadline from it and starts
#   ALL_RESERVE [200]        no point it could not finish; `one` leaves ALL_RESERVE seconds to `all`
#   AB_RESERVE [150]         and AB_RESERVE to `ab`; ONE_RESERVE [200]: what `ab` leaves to a `one` after it
#                            (STAGES="ab one")
# goodput.py's --pyspy EXE --pyspy-rate R (in the args) samples every serving process inside the window of
# the point at R: carry the bundle built by `bash benchmarks/bundle_gpu_deps.sh` (.gpu-deps, py-spy on its
# PATH) and pass --pyspy py-spy.
# What fits: with the defaults (image only) about 550 s on the 2B preset if an app deploys in about 60 s;
# what does not fit is skipped and said so, a stage's last steps first (the 0.9 cold start, then the 0.5).
# The mix on both sides does not fit beside it: run STAGES=one WORKLOADS="image mix" in one call and
# STAGES=all WORKLOADS="image mix" RAMP=4 in another.
# Results: $OUT/goodput_1gpu and $OUT/goodput_<N>gpu (goodput.json, goodput.md, goodput.png, cold_start.png,
# the stage's log; with --pyspy, pyspy_<point>.txt summed per point and pyspy_raw.tgz of the raw stacks),
# $OUT/summary.md with every stage's table, $OUT/env.txt. The device returns at most 8 files a call: where $OUT
# holds more, the stages' folders travel as one $OUT/stages.tar.xz (PACK=0: never), beside summary.md and env.txt.
set -uo pipefail
source benchmarks/gpu_env.sh
CONFIG=${1:-configs/qwen3-vl-2b-gpu.yaml}; shift || true
BUDGET=${BUDGET:-570}
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
NG=$(nvidia-smi -L | wc -l)
# The config's embedded checkpoint is built once here (about 40 s on a fresh machine), not inside a stage's timing.
python3 -c "import sys, yaml; from app.checkpoints.model_builder import resolve_model
a = yaml.safe_load(open(sys.argv[1]))['applications'][0]['args']; print('model at', resolve_model(a['model'], a.get('cache_dir')))" "$CONFIG"
# shellcheck disable=SC2206
WL=(${WORKLOADS:-image})
COMMON=(--serve-config "$CONFIG" --workload "${WL[@]}"
        --window-s "${WINDOW:-6}" --ramp-s "${RAMP:-2}" --warmup-s "${WARMUP:-6}" --max-points "${MAX_POINTS:-5}"
        --fractions ${FRACTIONS:-0.5 0.7 0.85 1.0})
: > "$OUT/summary.md"
if [ -n "${PROBE_IMPORTS:-}" ]; then  # how long the serving imports take on this machine, in fresh processes
  { python3 -c "import sys, os, transformers; d = os.path.dirname(transformers.__file__)
print('dont_write_bytecode', sys.dont_write_bytecode, os.environ.get('PYTHONDONTWRITEBYTECODE'), 'transformers at', d,
      'writable', os.access(d, os.W_OK), 'has __pycache__', os.path.isdir(d + '/__pycache__'))"
    python3 benchmarks/replica_imports.py --runs 2 --out "$OUT/imports.json"  # our settings readers against transformers'
    } > "$OUT/imports.txt" 2>&1
  cat "$OUT/imports.txt"
fi

stage() {  # NAME DIR GPUS DEADLINE_S [goodput.py args ...]
  local name=$1 dir=$2 gpus=$3 deadline=$4; shift 4
  mkdir -p "$dir"
  if [ "$deadline" -lt 60 ]; then echo "=== $name: skipped, ${deadline} s left" | tee -a "$OUT/summary.md"; return; fi
  echo "=== $name: $gpus GPU(s), deadline ${deadline} s"
  ray stop --force >/dev/null 2>&1
  # shellcheck disable=SC2086
  env ${STAGE_ENV:-} timeout $(( deadline + 40 )) python3 benchmarks/goodput.py --start --num-gpus "$gpus" "${COMMON[@]}" \
    --deadline-s "$deadline" --out-dir "$dir" "$@" 2>&1 | grep -v "Warning\|warn(" | tee "$dir/goodput.log" \
    | grep -E "ready in|closed loop|warm-up|req/s offered|goodput|cold start|cross-check|no time|Error|error:"
  { echo "## $name: $gpus GPU(s), $(head -1 "$OUT/env.txt")"; cat "$dir/goodput.md" 2>/dev/null; echo; } >> "$OUT/summary.md"
  ray stop --force >/dev/null 2>&1
  # py-spy's stacks (--pyspy): one folder per point is deeper than the device's copy brings back, so each
  # point is summed here (pyspy_<point>.txt) and the raw stacks travel as one archive beside it
  if [ -d "$dir/pyspy" ]; then
    for p in "$dir"/pyspy/*/; do
      python3 benchmarks/pyspy_summary.py "$p" > "$dir/pyspy_$(basename "$p").txt" 2>&1
    done
    tar -czf "$dir/pyspy_raw.tgz" -C "$dir" pyspy && rm -rf "$dir/pyspy"
  fi
}

if [ -n "${MPS:-}" ]; then  # MPS=1: every stage under CUDA MPS (docs/guides/single-gpu.md), the daemon quit at the end
  nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT \
    && echo "all stages under MPS" | tee -a "$OUT/summary.md" || { echo "MPS did not start" | tee -a "$OUT/summary.md"; exit 1; }
fi
ALL_STAGES=" ${STAGES:-one all crosscheck} "
if [ "$NG" -lt 2 ] && [[ "$ALL_STAGES" == *" all "* ]]; then  # `all` would repeat `one`
  echo "=== all: skipped, this host has $NG GPU" | tee -a "$OUT/summary.md"; ALL_STAGES=${ALL_STAGES/ all / }
fi
ran_one=no ran_ab=no
for s in $ALL_STAGES; do
  case $s in
    one)
      ran_one=yes
      reserve=0; [[ "$ALL_STAGES" == *" all "* ]] && reserve=${ALL_RESERVE:-200}
      [ "$ran_ab" = no ] && [[ "$ALL_STAGES" == *" ab "* ]] && reserve=$(( reserve + ${AB_RESERVE:-150} ))  # only for an `ab` still to come
      cold=(--cold-start 0.5 0.9)
      [ -n "${COLD_FIRST:-}" ] && cold=(--cold-first "$COLD_FIRST" --cold-start 0.9)
      # shellcheck disable=SC2086
      stage one "$OUT/goodput_1gpu" 1 $(( $(left) - reserve - 20 )) --load-processes "${LOAD_ONE:-2}" \
        --closed-loop ${CLOSED_ONE:-512 2048} \
        "${cold[@]}" --cold-s "${COLD_S:-20}" --cold-warm-window-s "${WINDOW:-6}" \
        ${RATES_ONE:+--rates $RATES_ONE} "$@" ;;
    all)
      # shellcheck disable=SC2086
      stage all "$OUT/goodput_${NG}gpu" "$NG" $(( $(left) - 20 )) --load-processes "${LOAD_ALL:-$(( 2 * NG ))}" \
        --closed-loop ${CLOSED_ALL:-$(( 256 * NG )) $(( 2048 * NG ))} \
        ${RATES_ALL:+--rates $RATES_ALL} "$@" ;;
    ab)
      ran_ab=yes
      rates=${AB_RATES:-${RATES_ONE:-}}
      if [ -z "$rates" ] || { [ -z "${AB_ARGS:-}" ] && [ -z "${AB_MPS:-}" ] && [ -z "${AB_ENV:-}" ]; }; then
        echo "=== ab: skipped, it needs AB_ARGS (or AB_MPS or AB_ENV) and AB_RATES (or RATES_ONE)" | tee -a "$OUT/summary.md"; continue
      fi
      # AB_MPS=1: the B side runs under CUDA's Multi-Process Service, so that the kernels of the two LLM
      # replicas sharing the GPU may run at once instead of in time slices; the daemon is stopped after it
      mps=no
      if [ -n "${AB_MPS:-}" ]; then
        if nvidia-cuda-mps-control -d 2>"$OUT/mps.txt"; then mps=yes; else echo "ab: MPS did not start" | tee -a "$OUT/summary.md"; continue; fi
        ( sleep 120; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$OUT/mps_clients.txt" 2>&1 ) &
      fi
      # `one` still to come (STAGES="ab one"): leave it ONE_RESERVE seconds, as `one` leaves AB_RESERVE to `ab`
      later=0; [ "$ran_one" = no ] && [[ "$ALL_STAGES" == *" one "* ]] && later=${ONE_RESERVE:-200}
      # shellcheck disable=SC2086
      [ -n "${AB_ENV:-}" ] && echo "ab: with $AB_ENV" | tee -a "$OUT/summary.md"
      STAGE_ENV=${AB_ENV:-} stage ab "$OUT/goodput_1gpu_ab" 1 $(( $(left) - later - 20 )) --rates $rates --no-search --closed-loop ${AB_CLOSED:-0 0} \
        --load-processes "${LOAD_ONE:-2}" --app-args "${AB_ARGS:-{\}}" "$@"
      if [ $mps = yes ]; then
        { echo "MPS servers while the stage ran (their clients: nvidia-smi's processes then):"; cat "$OUT/mps_clients.txt" 2>/dev/null
          echo get_server_list | nvidia-cuda-mps-control; } >> "$OUT/mps.txt" 2>&1
        echo quit | nvidia-cuda-mps-control
        echo "ab: under MPS ($(grep -c . "$OUT/mps.txt") lines in mps.txt)" >> "$OUT/summary.md"
      fi ;;
    crosscheck)
      g=${CROSSCHECK_RATE:-$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(next(iter(r['workloads'].values()))['search']['goodput'])" \
          "$OUT/goodput_1gpu/goodput.json" 2>/dev/null)}
      # the tool: CROSSCHECK_TOOL, else AIPerf where its bundle is carried, else GuideLLM; each from its own
      # bundle when carried (benchmarks/bundle_aiperf.sh, bundle_guidellm.sh; too large beside .gpu-deps)
      tool=${CROSSCHECK_TOOL:-$([ -f .gpu-aiperf/install ] && echo aiperf || echo guidellm)}
      exe=""
      if [ "$tool" = aiperf ]; then
        exe=${AIPERF:-}; [ -z "$exe" ] && [ -f .gpu-aiperf/install ] && exe=$(bash .gpu-aiperf/install)
      else
        exe=${GUIDELLM:-}; [ -z "$exe" ] && [ -f .gpu-guidellm/install ] && exe=$(bash .gpu-guidellm/install)
      fi
      have=no; { [ -n "$exe" ] || python3 -c "import $tool" 2>/dev/null; } && have=yes
      if [ "$have" = no ] || [ -z "$g" ] || [ "$g" = "0.0" ]; then
        echo "crosscheck skipped: $tool importable or its bundle carried: $have; 1-GPU goodput: ${g:-none}" \
          "(docs/guides/goodput.md, 'Cross-check')" | tee "$OUT/crosscheck.txt"
        continue
      fi
      # our point of the first workload at the goodput, then ours and the tool's of the same shape
      stage crosscheck "$OUT/crosscheck_1gpu" 1 $(( $(left) - 20 )) --rates "$g" --no-search --closed-loop 0 0 \
        --crosscheck "$tool" --crosscheck-rate "$g" ${exe:+--crosscheck-exe "$exe"} \
        ${CROSSCHECK_WORKERS:+--crosscheck-workers $CROSSCHECK_WORKERS} \
        --load-processes "${LOAD_ONE:-2}" "$@" ;;
  esac
done
cat "$OUT/summary.md"
stage_dirs=$(cd "$OUT" && ls -d goodput_* crosscheck_* 2>/dev/null | tr "\n" " ")
if [ "${PACK:-1}" != 0 ] && [ -n "$stage_dirs" ] && [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  # shellcheck disable=SC2086
  tar -cJf "$OUT/stages.tar.xz" -C "$OUT" $stage_dirs && (cd "$OUT" && rm -rf $stage_dirs) &&
    echo "more than 8 files under \$OUT: the stages' folders ($stage_dirs) are in stages.tar.xz"
fi
echo "script seconds: $(( $(date +%s) - T0 ))"
