#!/usr/bin/env bash
# The GPU measurements of extraction in one go, sized for one H200: about 4 minutes, at most 5.5 (the deadline;
# EXTRACT_GPU_DEADLINE_S) plus 10 s of kill grace and the clean-up: run it under a 420 s limit. In order of value,
# each step with its own limit, a later one skipped when the deadline leaves too little:
#
#   1. bench       benchmarks/extract_gpu.py --block-imports: the import path with the packages a GPU machine lacks
#                  blocked (snakemake, duckdb, pandera, ...); packed == one-by-one states on a sample (bf16, and fp8
#                  against bf16); the packed backend (FlashAttention varlen) at 65,536 tokens per batch on a random
#                  Llama-3.1-8B in bf16 over 400k tokens of mixed lengths (16..8,192), states written to local disk
#                  in the shipped layout, with bf16 then fp8 auxiliary states; one batch's forward profiled
#                  (matmul / attention / elementwise); 131,072 tokens per batch if time is left; the summary
#   2. gpu_tests   pytest -m gpu tests/gpu/test_extract_gpu.py -k "not flex" under the same guard (aux == HF
#                  output_hidden_states, batched == single in bf16, overlapped writeback bytes, device locks)
#   3. flex        the packed path with the FlexAttention kernel (compiled) at 65,536 tokens per batch
#   4. flex_tests  pytest -m gpu -k flex: the FlexAttention cases of tests/gpu/test_extract_gpu.py
#
#   bash benchmarks/extract_gpu.sh          # from the repository root, on the GPU machine (needs no install:
#                                           # PYTHONPATH=src, torch + transformers + safetensors + numpy + pyarrow)
#   bash benchmarks/extract_gpu.sh --tiny   # the same steps on CPU (GPU tests skip; tiny config)
#   EXTRACT_GPU_STEPS="bench" bash benchmarks/extract_gpu.sh   # some steps only (a rerun)
#
# Everything goes to $OUT if set, else ./extract_gpu_out, 7 files at most: env.txt, one log
# per step (<step>.log), extract_gpu.log (all of this script's output) and extract_gpu.jsonl (every JSON line,
# appended as it is printed, so a step cut short keeps its lines). The script always exits 0 and prints each
# step's exit status ("== <step> rc=<n>"); it ends with the summary line.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
OUTDIR="${OUT:-extract_gpu_out}"
mkdir -p "$OUTDIR"
JSONL="$OUTDIR/extract_gpu.jsonl"
: >"$JSONL"
exec > >(tee "$OUTDIR/extract_gpu.log") 2>&1
TINY=""
[ "${1:-}" = "--tiny" ] && TINY="--tiny"
DEADLINE="${EXTRACT_GPU_DEADLINE_S:-330}"
STEPS="${EXTRACT_GPU_STEPS:-bench gpu_tests flex flex_tests}"
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
wanted() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

step() {  # step NAME MAX_S MIN_S COMMAND...: run within min(MAX_S, time left) (an argument @LIMIT@ becomes that
  # limit less 5 s), log to $OUTDIR/NAME.log, report the status; skipped when under MIN_S are left or not asked
  local name=$1 max=$2 min=$3 limit arg
  shift 3
  wanted "$name" || { echo "== $name not asked (EXTRACT_GPU_STEPS=$STEPS)"; return 0; }
  limit=$(left)
  if [ "$limit" -lt "$min" ]; then echo "== $name skipped: ${limit}s left of ${DEADLINE}s"; return 0; fi
  [ "$limit" -gt "$max" ] && limit=$max
  local cmd=()
  for arg in "$@"; do [ "$arg" = "@LIMIT@" ] && cmd+=("$(( limit - 5 ))") || cmd+=("$arg"); done
  echo "== $name (limit ${limit}s, at $(( $(date +%s) - START ))s)"
  timeout --kill-after=10 "$limit" "${cmd[@]}" 2>&1 | tee "$OUTDIR/$name.log"
  echo "== $name rc=${PIPESTATUS[0]} ($(( $(date +%s) - START ))s)"
}

{
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
    --format=csv 2>/dev/null
  "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  echo "cpus $(nproc)"; free -g 2>/dev/null | head -2; df -h . /tmp 2>/dev/null
  git log -1 --format='commit %H %s' 2>/dev/null
} 2>&1 | tee "$OUTDIR/env.txt"

# the benchmark's files go to the working tree's disk (deleted after each run), not to a RAM-backed /tmp (unless the
# working tree is read-only)
BENCH_TMP=$(mktemp -d "$PWD/.extract_gpu_tmp.XXXXXX" 2>/dev/null || mktemp -d)
trap 'rm -rf "$BENCH_TMP"' EXIT

BENCH=("$PY" benchmarks/extract_gpu.py $TINY --block-imports --jsonl "$JSONL" --out-dir "$BENCH_TMP")
FLEX=(--runs packed-flex:65536 --tokens 100000)
[ -n "$TINY" ] && FLEX=(--runs packed-flex:1024 --tokens 1000)

step bench 240 60 "${BENCH[@]}" --time-limit-s @LIMIT@
step gpu_tests 120 30 "$PY" benchmarks/extract_gpu.py --gpu-tests -k "not flex"
step flex 150 90 "${BENCH[@]}" "${FLEX[@]}" --only-runs --time-limit-s @LIMIT@
step flex_tests 120 60 "$PY" benchmarks/extract_gpu.py --gpu-tests -k flex
echo "== done in $(( $(date +%s) - START ))s; JSON lines in $JSONL"
"$PY" benchmarks/extract_gpu.py --report "$JSONL"
grep -h '"kind": "summary"' "$JSONL" | head -n 1
exit 0
