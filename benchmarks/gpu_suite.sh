#!/usr/bin/env bash
# Every GPU measurement the open issues wait for, in two parts that each fit one 10-minute device call.
#
#   bash benchmarks/gpu_suite.sh a    # generation (#5: 1B and 8B, with and without lookahead) and DDMA (#4)
#   bash benchmarks/gpu_suite.sh b    # RL training step (#6), int8 generator memory/speed, the job on one GPU
#
# Logs go to $OUT (or ./gpu_suite_out); each benchmark ends its log with its JSON line. Copy the numbers into
# docs/benchmarks.md with the date and the device.
set -uo pipefail
part=${1:?usage: gpu_suite.sh a|b}
out=${OUT:-gpu_suite_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$out/device.txt" 2>&1

run() {  # name, command...: run, keep the log, print the last line (the JSON)
    local name=$1; shift
    local t0=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - t0)) s"
    grep -v -i warn "$out/$name.log" | tail -n 4
}

case $part in
    a)
        run generate python benchmarks/generate.py
        run ddma python benchmarks/ddma.py --no-cpu
        ;;
    b)
        run train_step python benchmarks/train_step.py --loss rl --seq 2048 --micro-batch 8 --attention sdpa
        run int8_generator python benchmarks/int8_generator.py --dtype bf16 --memory-cases llama-1b,llama3-8b \
            --speed-cases llama-1b
        # The whole job on one GPU (executors colocated): does `megatron-rl train` run on CUDA end to end?
        run job megatron-rl train trainer.tp=1 generator.colocated=true run.steps=40 trainer.sft_warmup_steps=200 \
            run.eval_interval=20 checkpoint.dir="$out/job"
        ;;
    *) echo "unknown part $part (a or b)"; exit 2 ;;
esac
