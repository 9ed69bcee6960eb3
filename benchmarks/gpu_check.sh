#!/usr/bin/env bash
# The GPU check in one device call:  bash benchmarks/gpu_check.sh [steps...]   (default: env gpu_tests bench06 bench8)
#
#   env        nvidia-smi (clocks, power limit, temperature) and the torch / triton / transformers versions
#   gpu_tests  python3 -m pytest -m gpu tests -q: tests/gpu (kernels at full size, bf16 parity, CUDA graphs and the
#              balanced policy against eager fcfs, TP=2 against TP=1 when there are two GPUs; the server test
#              needs fastapi, uvicorn and openai, the JSON-schema test xgrammar: carry their wheels as for online06)
#   bench06    the reference workload (benchmarks/bench_offline.py) on Qwen3-0.6B, dummy weights, one GPU
#   bench8     ... on Qwen3-8B, one GPU
#   bench8tp2  ... on Qwen3-8B, two GPUs (skipped, with a message, on fewer)
#   online06   the server bench (benchmarks/online_bench.py) on Qwen3-0.6B at RATES (default 16,64,inf) requests/s.
#              Needs fastapi and uvicorn: carry their wheels (.whl) and start the device command with the wheel
#              install from the device README (pip install --target /tmp/site ... && export PYTHONPATH=/tmp/site)
#   moe30b     ... on Qwen3-30B-A3B (MoE), one GPU; moe30b_fp8: the same with FP8 weights (experts too), then FP8
#              weights + FP8 KV cache, then in the block-FP8 checkpoint layout (benchmarks/models/qwen3-30b-a3b-fp8)
#   fp8        ... on Qwen3-8B with FP8 weights, then FP8 weights + FP8 KV cache, then in the block-FP8 checkpoint
#              layout (benchmarks/models/qwen3-8b-fp8)
#   spec       speculative decoding: trains the copy model (benchmarks/train_tiny.py, once per machine), then its
#              copy workload with and without SPEC_CONFIG (default n-gram, SPEC_K=12 drafts) at SPEC_BATCHES
#              (default 1 16 256) concurrent requests; and the reference workload without and with it on
#              SPEC_REF_MODELS (default qwen3-0.6b; e.g. "qwen3-0.6b qwen3-8b")
#   sampling   decode step time with a JSON schema / penalties / logit bias / n on 256 rows vs plain
#              (benchmarks/bench_sampling_features.py; the JSON mode needs xgrammar: carry its wheels as above)
#   attention  the prefill kernel against torch SDPA (benchmarks/kernel_bench.py attention)
#   decode     the decode kernel over bf16 and e4m3 caches at 256 sequences (benchmarks/kernel_bench.py decode), then
#              the QK-norm + RoPE + KV store into both caches (kernel_bench.py kvstore)
#   moe_sweep  the fused-MoE tile sweep for Qwen3-30B-A3B's expert shape at MOE_TOKENS (benchmarks/kernel_bench.py
#              moe; MOE_FP8=1: FP8 experts): prints the MOE_CONFIGS entry to paste into nanovllm/kernels/moe_configs.py
#   profile06, profile8   where a step's time goes (benchmarks/profile_step.py): step timings and kernel tables
#   compare    bench_offline on MODEL (default benchmarks/models/qwen3-8b; more flags in BENCH_ARGS) twice in this
#              call: at BASELINE_DIR (an older copy of the repo), then at this tree; prints current / baseline.
#              A speed claim is such a ratio, measured in one call (machines differ by several percent)
#
# Logs: $OUT/<step>.log (OUT defaults to ./gpu_out); bench results are appended to $OUT/bench.jsonl, labelled
# "$LABEL <step>". Each step has its own time limit; a failure doesn't stop the rest.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OUT LABEL=${LABEL:-}
steps=${*:-"env gpu_tests bench06 bench8"}

run() {  # name, limit_s, command...: the command's output into $OUT/<name>.log, then its last TAIL lines
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-30}" "$OUT/$name.log"
  echo "=== $name rc=$rc"
}

bench() {  # name, limit_s, model dir, more bench_offline flags...
  local name=$1 limit=$2 model=$3
  shift 3
  run "$name" "$limit" python3 benchmarks/bench_offline.py --model "$model" --load-format dummy \
    --json "$OUT/bench.jsonl" --label "${LABEL:+$LABEL }$name" --step-log "$OUT/steps-$name.json" --gpu-idle "$@"
}

quick() {  # bench without the step log and GPU-idle timing: pairs of runs compared with each other
  local name=$1 limit=$2 model=$3
  shift 3
  run "$name" "$limit" python3 benchmarks/bench_offline.py --model "$model" --load-format dummy \
    --json "$OUT/bench.jsonl" --label "${LABEL:+$LABEL }$name" "$@"
}

compare() {  # MODEL at BASELINE_DIR, then at this tree (same config file), and the ratio of their tok/s
  local model tag="${LABEL:+$LABEL }compare"
  model=$(realpath "${MODEL:-benchmarks/models/qwen3-8b}")
  echo "--- baseline: $BASELINE_DIR"
  # shellcheck disable=SC2086  # BENCH_ARGS: several flags
  PYTHONPATH=$BASELINE_DIR python3 "$BASELINE_DIR/benchmarks/bench_offline.py" --model "$model" --load-format dummy \
    --json "$OUT/bench.jsonl" --label "$tag baseline" ${BENCH_ARGS:-} || return
  echo "--- current: $PWD"
  # shellcheck disable=SC2086
  python3 benchmarks/bench_offline.py --model "$model" --load-format dummy \
    --json "$OUT/bench.jsonl" --label "$tag current" ${BENCH_ARGS:-} || return
  python3 -c '
import json, sys
last = {r["label"]: r for r in map(json.loads, open(sys.argv[1]))}  # the latest line of each label
base, cur = last[sys.argv[2] + " baseline"], last[sys.argv[2] + " current"]
b, c = base["output_tok_s"], cur["output_tok_s"]
print("%s: current %.0f / baseline %.0f output tok/s = %.4f" % (cur["model"], c, b, c / b))' "$OUT/bench.jsonl" "$tag"
}
export -f compare

for s in $steps; do
  case $s in
    env) run env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,power.max_limit,temperature.gpu,pstate --format=csv; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), \"GPUs\")"' ;;
    gpu_tests) run gpu_tests 420 python3 -m pytest -m gpu tests -q ;;
    bench06) bench bench06 300 benchmarks/models/qwen3-0.6b ;;
    bench8) bench bench8 400 benchmarks/models/qwen3-8b ;;
    bench8tp2)
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
        echo "=== bench8tp2 skipped: it needs two GPUs (an nvidia-h200-x2 machine)"
      else
        bench bench8tp2 400 benchmarks/models/qwen3-8b --tensor-parallel-size 2
      fi ;;
    online06)
      if ! python3 -c 'import fastapi, uvicorn' 2> /dev/null; then
        echo "=== online06 skipped: fastapi and uvicorn are missing (carry their wheels: see this script's header)"
      else
        run online06 400 python3 benchmarks/online_bench.py --model benchmarks/models/qwen3-0.6b --load-format dummy \
          --max-model-len 4096 --rates "${RATES:-16,64,inf}" --output "$OUT/online06.json"
      fi ;;
    moe30b) bench moe30b 300 benchmarks/models/qwen3-30b-a3b ;;
    moe30b_fp8)
      bench moe30b_fp8 300 benchmarks/models/qwen3-30b-a3b --quantization fp8
      bench moe30b_fp8kv 300 benchmarks/models/qwen3-30b-a3b --quantization fp8 --kv-cache-dtype fp8
      bench moe30b_fp8block 300 benchmarks/models/qwen3-30b-a3b-fp8 ;;
    fp8)
      bench fp8 300 benchmarks/models/qwen3-8b --quantization fp8
      bench fp8kv 300 benchmarks/models/qwen3-8b --quantization fp8 --kv-cache-dtype fp8
      bench fp8block 300 benchmarks/models/qwen3-8b-fp8 ;;
    spec)
      copy=${COPY_MODEL:-/tmp/copy-model}
      [ -f "$copy/config.json" ] || run train_copy 200 python3 benchmarks/train_tiny.py "$copy"
      spec=${SPEC_CONFIG:-'{"method": "ngram", "num_speculative_tokens": '${SPEC_K:-12}', "prompt_lookup_max": 4}'}
      for b in ${SPEC_BATCHES:-1 16 256}; do
        n=$((b * 8 < 16 ? 16 : (b * 8 > 1024 ? 1024 : b * 8)))  # requests: about a second of work or more
        TAIL=3 quick "copy-b$b" 120 "$copy" --workload copy --batch "$b" --num-seqs $n
        TAIL=4 quick "copy-b$b-spec" 120 "$copy" --workload copy --batch "$b" --num-seqs $n --speculative-config "$spec"
      done
      for m in ${SPEC_REF_MODELS:-qwen3-0.6b}; do
        TAIL=3 quick "ref-$m" 300 "benchmarks/models/$m"
        TAIL=4 quick "ref-$m-spec" 300 "benchmarks/models/$m" --speculative-config "$spec"
      done ;;
    sampling) run sampling 300 python3 benchmarks/bench_sampling_features.py --model benchmarks/models/qwen3-0.6b \
                --rows 256 --tokens 128 --modes "${SAMPLING_MODES:-plain,json,penalties,bias,n}" ;;
    attention) TAIL=40 run attention 300 python3 benchmarks/kernel_bench.py attention ;;
    decode)
      TAIL=12 run decode 200 python3 benchmarks/kernel_bench.py decode
      TAIL=5 run kvstore 120 python3 benchmarks/kernel_bench.py kvstore ;;
    moe_sweep) TAIL=60 run moe_sweep 560 python3 benchmarks/kernel_bench.py moe --tokens ${MOE_TOKENS:-256 1024 4096 8192} \
                 ${MOE_FP8:+--fp8} --json "$OUT/moe_sweep.json" ;;
    profile06) TAIL=70 run profile06 300 python3 benchmarks/profile_step.py --model benchmarks/models/qwen3-0.6b \
                 --load-format dummy --out "$OUT/profile06" ;;
    profile8) TAIL=70 run profile8 400 python3 benchmarks/profile_step.py --model benchmarks/models/qwen3-8b \
                --load-format dummy --out "$OUT/profile8" ;;
    compare)
      if [ -z "${BASELINE_DIR:-}" ] || [ ! -f "$BASELINE_DIR/benchmarks/bench_offline.py" ]; then
        echo "=== compare skipped: set BASELINE_DIR to an older copy of the repo (with benchmarks/bench_offline.py)"
      else
        TAIL=12 run compare 560 bash -c compare
      fi ;;
    *) echo "unknown step $s (see the header of $0)" ;;
  esac
done
