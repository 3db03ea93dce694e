#!/usr/bin/env bash
# The GPU checks of extraction in one go, sized for one H200 in about 5 minutes (each step has its own limit;
# all of them together stay under 9 minutes, 9.2 with the kill grace: run it with a 600 s limit):
#
#   1. imports    the extraction path imports with the packages a GPU machine lacks blocked (snakemake, duckdb,
#                 pandera, ...): benchmarks/extract_gpu.py --check-imports
#   2. gpu_tests  pytest -m gpu tests/test_extract_gpu.py under the same guard (aux == HF output_hidden_states,
#                 batched == single in bf16 for every layout and kernel, overlapped writeback bytes, device locks)
#   3. bench      benchmarks/extract_gpu.py: padded and packed at 16,384 and 65,536 tokens per batch (Llama-3.1-8B
#                 config, random bf16 weights, 200k tokens of mixed lengths 16..8,192): one JSON line per run,
#                 then a summary line
#   4. bench_flex the packed path with the FlexAttention kernel at 65,536 (skipped when time is short)
#
#   bash benchmarks/extract_gpu.sh          # from the repository root, on the GPU machine (needs no install:
#                                           # PYTHONPATH=src, torch + transformers + safetensors + numpy + pyarrow)
#   bash benchmarks/extract_gpu.sh --tiny   # the same steps on CPU (GPU tests skip; tiny config)
#
# Logs and the JSON lines go to $OUT (the device tool's output folder) or ./extract_gpu_out. The script always
# exits 0 after the last step and prints each step's exit status ("== <step> rc=<n>"); the JSON lines are
# collected in extract_gpu.jsonl.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
OUTDIR="${OUT:-extract_gpu_out}"
mkdir -p "$OUTDIR"
TINY=""
[ "${1:-}" = "--tiny" ] && TINY="--tiny"
START=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUTDIR/NAME.log, report the status
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, at $(( $(date +%s) - START ))s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUTDIR/$name.log"
  echo "== $name rc=${PIPESTATUS[0]} ($(( $(date +%s) - START ))s)"
}

{
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  df -h . /tmp 2>/dev/null | tail -n +1
} 2>&1 | tee "$OUTDIR/env.txt"

# the benchmark's files go to the working tree's disk (deleted after each run), not to a RAM-backed /tmp
BENCH_TMP=$(mktemp -d "$PWD/.extract_gpu_tmp.XXXXXX")
trap 'rm -rf "$BENCH_TMP"' EXIT

step imports 60 "$PY" benchmarks/extract_gpu.py --check-imports
step gpu_tests 240 "$PY" benchmarks/extract_gpu.py --gpu-tests
step bench 210 "$PY" benchmarks/extract_gpu.py $TINY --block-imports --out-dir "$BENCH_TMP"
LEFT=$(( 540 - ($(date +%s) - START) ))
if [ -n "$TINY" ]; then
  step bench_flex 240 "$PY" benchmarks/extract_gpu.py --tiny --block-imports --runs packed-flex:1024 --tokens 1000 \
    --out-dir "$BENCH_TMP"
elif [ "$LEFT" -ge 90 ]; then
  step bench_flex $(( LEFT < 150 ? LEFT : 150 )) "$PY" benchmarks/extract_gpu.py --block-imports \
    --runs packed-flex:65536 --tokens 100000 --out-dir "$BENCH_TMP"
else
  echo "== bench_flex skipped: ${LEFT}s left"
fi
grep -h '^{"benchmark"' "$OUTDIR"/imports.log "$OUTDIR"/bench.log "$OUTDIR"/bench_flex.log 2>/dev/null \
  > "$OUTDIR/extract_gpu.jsonl"
echo "== done in $(( $(date +%s) - START ))s; JSON lines in $OUTDIR/extract_gpu.jsonl"
