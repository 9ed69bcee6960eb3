#!/usr/bin/env bash
# The whole GPU check-and-bench in one device call:  bash benchmarks/gpu_check.sh [steps...]
# steps: env kernels kernel_tests kernel_tests_attn_ar parity parity_trained parity32 bench06 bench06sync profile06 profile8 bench8 bench8tp2 online06
#        gemm gemmlt allreduce tp_parity bench8tp2nccl bench8tp2twoshot sweep bench06best layout
#        bench8tp2notrim bench8notrim profile8tp2 order bench8tp2noorder bench8noorder bench8lt bench8chunk16k
#        gemmsweep parity_trained_lt kernel_tests_mm bench8noplan profile8gaps bench8tp2noplan bench06chunk16k bench8tp2chunk16k bench06fresh
#        bench06noplan bench06noplanfresh bench8bal bench06bal bench8tp2bal policy_check policy_check_tp2 bench8ov (OVERLAP=0|1) bench8pre (PREFILL_ATTN=BM,BN,W,S) bench8fcfs bench8tp2fcfs prof8bal (MIXED_STEP=32|64|128)
#        mixedattn mixedtiles kernel_tests_varlen bench8persist (PERSIST=0|1) bench8nohold
#        bench8lmtrim (LMTRIM=0|1) bench06pg (PG=auto|0|1) bench06host headoverlap ltsearch kvlayout
#        kernel_tests_decode splitk energy bench8vllminit
# (default: env kernels parity bench06 profile06 bench8). online06 needs fastapi/uvicorn: carry .whl and
# start the command with the wheel install from the device README.
# Logs go to $OUT (or ./gpu_out); each step has its own time limit and a failure doesn't stop the rest.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${*:-"env kernels parity bench06 profile06 bench8"}
run() {  # name, limit_s, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name rc=$rc"
}
for s in $steps; do
  case $s in
    env) run env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,power.max_limit,temperature.gpu,pstate --format=csv; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
    kernels) run kernels 240 python3 benchmarks/kernel_check.py ;;
    kernel_tests) run kernel_tests 400 python3 -m pytest tests/kernels -q -x ;;
    kernel_tests_attn_ar) run kernel_tests_attn_ar 300 python3 -m pytest tests/kernels/test_triton_attention.py tests/kernels/test_triton_ar_norm.py -q -x ;;
    parity) run parity 240 python3 benchmarks/parity_bf16.py ;;
    parity_trained) run parity_trained 300 python3 benchmarks/parity_bf16.py --model trained ;;
    parity_trained_lt) NANOVLLM_BLAS=cublaslt run parity_trained_lt 300 python3 benchmarks/parity_bf16.py --model trained ;;
    kernel_tests_mm) run kernel_tests_mm 200 python3 -m pytest tests/kernels/test_triton_matmul.py -q -x ;;
    bench8lmtrim) TAIL=12 NANOVLLM_MIXED_LM_TRIM=${LMTRIM:-1} run bench8lmtrim${LMTRIM:-1} 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} mixed LM head trim ${LMTRIM:-1}" --step-log "$OUT/steps8lmtrim${LMTRIM:-1}.json" --gpu-idle ;;
    bench06pg) TAIL=14 NANOVLLM_PREFILL_GRAPHS=${PG:-auto} run bench06pg${PG:-auto} 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} prefill graphs ${PG:-auto}" --step-log "$OUT/steps06pg.json" --gpu-idle ;;
    bench06host) TAIL=20 run bench06host 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} host phases" --gpu-idle --host-phases ;;
    kernel_tests_decode) run kernel_tests_decode 300 python3 -m pytest tests/kernels/test_triton_attention.py -q -x -k decode ;;
    splitk) TAIL=10 run splitk 200 python3 benchmarks/splitk_bench.py ;;
    energy) TAIL=14 run energy 240 python3 benchmarks/energy_bench.py ;;
    bench8vllminit) TAIL=12 run bench8vllminit 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --reinit-uniform 1e-3 --json "$OUT/bench.jsonl" --label "${LABEL:-} weights uniform in +-1e-3 (vLLM's dummy init)" --step-log "$OUT/steps8vllminit.json" --gpu-idle ;;
    headoverlap) TAIL=30 run headoverlap 300 python3 benchmarks/head_overlap_bench.py --groups 1,2 ;;
    ltsearch) TAIL=30 run ltsearch 300 python3 benchmarks/cublaslt_search.py --rows 192,256,384,512 ;;
    kvlayout) TAIL=30 run kvlayout 300 python3 benchmarks/kv_layout_bench.py ;;
    bench8noplan) TAIL=40 NANOVLLM_GEMM_PLAN=0 run bench8noplan 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} no GEMM plan" --step-log "$OUT/steps8noplan.json" ;;
    profile8gaps) TAIL=10 NANOVLLM_PROFILE_STEPS="$OUT/prof8-d150:150:2:decode,$OUT/prof8-d850:850:2:decode" run profile8gaps 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --label "${LABEL:-} profiled"
      for f in "$OUT"/prof8-d*.rank0.trace.json; do python3 benchmarks/kernel_gaps.py "$f" > "${f%.trace.json}.gaps.txt" 2>&1; cat "${f%.trace.json}.gaps.txt"; done ;;
    bench8tp2noplan) TAIL=40 NANOVLLM_GEMM_PLAN=0 run bench8tp2noplan 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2 no GEMM plan" --step-log "$OUT/steps8tp2noplan.json" ;;
    bench8tp2chunk16k) TAIL=40 run bench8tp2chunk16k 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --max-num-batched-tokens 16384 --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2 16384-token chunks" --step-log "$OUT/steps8tp2chunk16k.json" ;;
    bench06chunk16k) TAIL=40 run bench06chunk16k 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --max-num-batched-tokens 16384 --json "$OUT/bench.jsonl" --label "${LABEL:-} 16384-token chunks" --step-log "$OUT/steps06chunk16k.json" ;;
    bench06fresh) TAIL=40 TRITON_CACHE_DIR=$(mktemp -d) run bench06fresh 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} empty Triton cache" --step-log "$OUT/steps06fresh.json" ;;
    bench06noplanfresh) TAIL=40 NANOVLLM_GEMM_PLAN=0 TRITON_CACHE_DIR=$(mktemp -d) run bench06noplanfresh 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} no GEMM plan, empty Triton cache" --step-log "$OUT/steps06noplanfresh.json" ;;
    bench06noplan) TAIL=40 NANOVLLM_GEMM_PLAN=0 run bench06noplan 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} no GEMM plan" --step-log "$OUT/steps06noplan.json" ;;
    gemmsweep) TAIL=200 run gemmsweep 560 python3 benchmarks/gemm_sweep.py --budget-s "${SWEEP_S:-420}" --json "$OUT/gemm_sweep.json" ;;
    parity32) run parity32 240 python3 benchmarks/parity_bf16.py --dtype float32 --num-prompts 16 ;;
    bench06) TAIL=40 run bench06 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-}" --step-log "$OUT/steps06.json" --gpu-idle ;;
    bench06sync) run bench06sync 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --no-async-scheduling --json "$OUT/bench.jsonl" --label "${LABEL:-} sync" ;;
    profile8) TAIL=60 run profile8 300 python3 benchmarks/profile_step.py --model benchmarks/models/qwen3-8b --load-format dummy ;;
    gemm) TAIL=40 run gemm 200 python3 benchmarks/comm_gemm_check.py gemm ;;
    gemmlt) TAIL=40 run gemmlt 200 python3 benchmarks/comm_gemm_check.py gemm cublaslt ;;
    tp_parity) run tp_parity 300 python3 benchmarks/tp_parity.py ;;
    bench8tp2nccl) TAIL=40 NANOVLLM_ALLREDUCE=nccl run bench8tp2nccl 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2 nccl" --step-log "$OUT/steps8tp2nccl.json" ;;
    bench8tp2twoshot) TAIL=40 NANOVLLM_ALLREDUCE=twoshot run bench8tp2twoshot 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2 twoshot" --step-log "$OUT/steps8tp2twoshot.json" ;;
    allreduce) TAIL=40 run allreduce 200 python3 benchmarks/comm_gemm_check.py allreduce ;;
    profile06) TAIL=60 run profile06 240 python3 benchmarks/profile_step.py --model benchmarks/models/qwen3-0.6b --load-format dummy ;;
    bench8) TAIL=40 run bench8 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-}" --step-log "$OUT/steps8.json" --gpu-idle ;;
    policy_check) run policy_check 300 python3 benchmarks/policy_check.py ;;
    policy_check_tp2) run policy_check_tp2 300 python3 benchmarks/policy_check.py --tensor-parallel-size 2 ;;
    prof8bal) TAIL=60 NANOVLLM_PROFILE_STEPS="$OUT/p8bal${MIXED_STEP:-128}-150:150:2:prefill,$OUT/p8bal${MIXED_STEP:-128}-${PROF_AT:-750}:${PROF_AT:-750}:2:prefill" NANOVLLM_MIXED_GRAPH_STEP=${MIXED_STEP:-128} run prof8bal${MIXED_STEP:-128} 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --scheduling-policy balanced --json "$OUT/bench.jsonl" --label "${LABEL:-} balanced, mixed graphs every ${MIXED_STEP:-128} rows, profiled" --step-log "$OUT/steps8bal${MIXED_STEP:-128}.json" ;;
    bench8bal) TAIL=40 NANOVLLM_MIXED_GRAPH_STEP=${MIXED_STEP:-128} run bench8bal${MIXED_STEP:-128} 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --scheduling-policy balanced --json "$OUT/bench.jsonl" --label "${LABEL:-} balanced, mixed graphs every ${MIXED_STEP:-128} rows" --step-log "$OUT/steps8bal${MIXED_STEP:-128}.json" --gpu-idle ;;
    bench06bal) TAIL=40 run bench06bal 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --scheduling-policy balanced --json "$OUT/bench.jsonl" --label "${LABEL:-} balanced" --step-log "$OUT/steps06bal.json" --gpu-idle ;;
    bench8tp2bal) TAIL=40 run bench8tp2bal 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --scheduling-policy balanced --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2 balanced" --step-log "$OUT/steps8tp2bal.json" --gpu-idle ;;
    bench8ov) TAIL=40 NANOVLLM_MIXED_OVERLAP=${OVERLAP:-1} run bench8ov${OVERLAP:-1} 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} mixed overlap ${OVERLAP:-1}" --step-log "$OUT/steps8ov${OVERLAP:-1}.json" ;;
    bench8pre) TAIL=40 NANOVLLM_PREFILL_ATTN=${PREFILL_ATTN:-32,128,4,2} run bench8pre 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} varlen tiles ${PREFILL_ATTN:-32,128,4,2} for chunks <= 512" --step-log "$OUT/steps8pre.json" ; mv "$OUT/bench8pre.log" "$OUT/bench8pre-$(echo ${PREFILL_ATTN:-32,128,4,2} | tr , x).log" ;;
    bench8nohold) TAIL=40 NANOVLLM_BALANCED_HOLD=0 run bench8nohold 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} balanced without the last-token hold" --step-log "$OUT/steps8nohold.json" --gpu-idle ;;
    bench8persist) TAIL=40 NANOVLLM_PREFILL_PERSISTENT=${PERSIST:-1} run bench8persist${PERSIST:-1} 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} mixed-graph varlen persistent ${PERSIST:-1}" --step-log "$OUT/steps8persist${PERSIST:-1}.json" --gpu-idle ;;
    mixedattn) TAIL=60 run mixedattn 300 python3 benchmarks/mixed_attn_bench.py ;;
    mixedtiles) TAIL=70 run mixedtiles 300 python3 benchmarks/mixed_attn_bench.py --tiles ;;
    kernel_tests_varlen) run kernel_tests_varlen 300 python3 -m pytest tests/kernels/test_triton_attention.py -q -x -k "persistent or leading or mixed_batch" ;;
    bench8fcfs) TAIL=40 run bench8fcfs 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --scheduling-policy fcfs --json "$OUT/bench.jsonl" --label "${LABEL:-} fcfs" --step-log "$OUT/steps8fcfs.json" --gpu-idle ;;
    bench8tp2fcfs) TAIL=40 run bench8tp2fcfs 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --scheduling-policy fcfs --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2 fcfs" --step-log "$OUT/steps8tp2fcfs.json" --gpu-idle ;;
    bench8tp2) TAIL=40 run bench8tp2 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2" --step-log "$OUT/steps8tp2.json" --gpu-idle ;;
    bench8tp2notrim) TAIL=40 NANOVLLM_TRIM_LAST_LAYER=0 run bench8tp2notrim 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2 no trim" --step-log "$OUT/steps8tp2notrim.json" ;;
    bench8lt) TAIL=40 NANOVLLM_BLAS=cublaslt run bench8lt 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} cublaslt" --step-log "$OUT/steps8lt.json" ;;
    bench8chunk16k) TAIL=40 run bench8chunk16k 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --max-num-batched-tokens 16384 --json "$OUT/bench.jsonl" --label "${LABEL:-} 16384-token chunks" --step-log "$OUT/steps8chunk16k.json" ;;
    bench8notrim) TAIL=40 NANOVLLM_TRIM_LAST_LAYER=0 run bench8notrim 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} no trim" --step-log "$OUT/steps8notrim.json" ;;
    profile8tp2) TAIL=10 NANOVLLM_PROFILE_STEPS="$OUT/prof8tp2-decode:300:3:decode,$OUT/prof8tp2-prefill:3:1:prefill" run profile8tp2 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --label "${LABEL:-} tp2 profiled" ;;
    online06) TAIL=40 run online06 400 python3 benchmarks/online_bench.py --model benchmarks/models/qwen3-0.6b --load-format dummy --max-model-len 4096 --rates "${RATES:-16,64,inf}" --output "$OUT/online06.json" ;;
    layout) TAIL=60 run layout 300 python3 benchmarks/decode_layout.py ;;
    order) TAIL=20 run order 300 python3 benchmarks/decode_order.py ;;
    bench8tp2noorder) TAIL=40 NANOVLLM_DECODE_ORDER=0 run bench8tp2noorder 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --tensor-parallel-size 2 --json "$OUT/bench.jsonl" --label "${LABEL:-} tp2 batch order" --step-log "$OUT/steps8tp2noorder.json" ;;
    bench8noorder) TAIL=40 NANOVLLM_DECODE_ORDER=0 run bench8noorder 400 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-8b --load-format dummy --json "$OUT/bench.jsonl" --label "${LABEL:-} batch order" --step-log "$OUT/steps8noorder.json" ;;
    sweep) TAIL=40 run sweep 300 python3 benchmarks/decode_sweep.py --out "$OUT/best_decode.txt" ;;
    bench06best) TAIL=20 NANOVLLM_DECODE_ATTN=$(cat "$OUT/best_decode.txt") run bench06best 300 python3 benchmarks/bench_offline.py --model benchmarks/models/qwen3-0.6b --load-format dummy --json "$OUT/bench.jsonl" --label "decode cfg $(cat "$OUT/best_decode.txt")" ;;
    *) echo "unknown step $s" ;;
  esac
done
