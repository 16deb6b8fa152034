#!/usr/bin/env bash
# The README's two commands on a GPU machine, as a new user runs them there: the machine's own CUDA torch in place
# of the CPU pin, everything else as written (issue 38). One part per device call:
#
#   bash benchmarks/gpu_readme.sh job     # pip install -e . ; megatron-rl train   (the default job, to its end)
#   bash benchmarks/gpu_readme.sh tests   # pip install -e '.[hf]' ; python -m pytest -q   (the `gpu` set runs)
#
# The device machine reaches no package index, so pip installs from what is there plus the wheels carried in .whl/
# (megatron-core, gguf; README "On GPUs"); wandb is not there, so the tests that need it skip. The tests part runs
# pytest over pytest-xdist workers to fit one 10-minute call (PYTEST_WORKERS, default 10; 12 workers ran the suite in
# 136 s on an H200's 16 cores, with the `gpu` set skipped) and needs the shared data beside the repo: a carried .data/ (a copy of ../shared/data)
# is copied there. SmolLM2's GGUF arrives in parts, one per call (gpu_env.sh): carry the first part with `job`, the
# second with `tests`, at most 30 s apart so the machine stays warm.
# Logs and a junit report go to $OUT (or ./gpu_readme_out); the last line says what passed.
set -uo pipefail
part=${1:?usage: gpu_readme.sh job|tests}
out=${OUT:-gpu_readme_out}
mkdir -p "$out"
t0=$SECONDS
source benchmarks/gpu_env.sh || { echo "gpu_readme: gpu_env.sh failed"; exit 1; }
export PATH=${PATH#"$HOME/bin:"}  # `megatron-rl` is pip's entry point, as a user has it, not gpu_env's wrapper
extra=$([ "$part" = tests ] && echo "[hf]")
python3 -m pip install -q --no-index --find-links .whl --no-build-isolation -e ".$extra" > "$out/pip.log" 2>&1 \
    || { tail -5 "$out/pip.log"; echo "gpu_readme: pip install -e failed"; exit 1; }
echo "== installed in $((SECONDS - t0)) s: $(command -v megatron-rl)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, megatron.core as m; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'megatron-core', m.__version__)" 2>&1 | tail -1

case $part in
    job)
        python3 -W error -m compileall -q -f megatron_rl > "$out/compile.log" 2>&1
        echo "== compileall -W error: exit $? ($(wc -l < "$out/compile.log") lines)"
        megatron-rl config > "$out/config.yaml" 2> "$out/config.err"
        echo "== megatron-rl config: exit $?; fitted: $(grep -E '^ *(tp|pp|dp|colocated):' "$out/config.yaml" \
            | tr -s ' ' | tr '\n' ' ')"
        t=$SECONDS
        megatron-rl train > "$out/job.out" 2> "$out/job.err"
        rc=$?
        echo "== megatron-rl train: exit $rc in $((SECONDS - t)) s; stderr $(wc -l < "$out/job.err") lines"
        head -n 2 "$out/job.out"; tail -n 2 "$out/job.out"; head -n 20 "$out/job.err"
        cp checkpoints/default/summary.json "$out/" 2>/dev/null
        t=$SECONDS
        megatron-rl train run.steps=4 trainer.sft_warmup_steps=10 checkpoint.dir=/tmp/quiet > "$out/quiet.out" \
            2> "$out/quiet.err"
        echo "== the issue's short job: exit $? in $((SECONDS - t)) s; stderr: $(wc -l < "$out/quiet.err") lines"
        head -n 10 "$out/quiet.err"
        [ "$rc" -eq 0 ] || { echo "gpu_readme job: FAILED"; exit 1; }
        ;;
    tests)
        [ -d ../shared/data ] || { mkdir -p ../shared && cp -r .data ../shared/data; } || exit 1
        # The `gpu` set's files first: its tests take the GPU in turn (conftest.py: gpu_env), so they start at once
        # while the other workers run the rest. One torch thread per rank (spawn.threads_per_rank reads it): without
        # it each rank of each worker's world took all 16 cores, and the suite ran past 470 s. SIGINT at the time
        # limit, so that pytest still reports what failed; a test silent for 240 s has its stacks dumped.
        files=$(ls tests/test_*.py | grep -v '^tests/test_gpu.py$')
        t=$SECONDS
        OMP_NUM_THREADS=1 timeout -s INT -k 30 "${PYTEST_TIMEOUT:-480}" python3 -m pytest -q -n "${PYTEST_WORKERS:-10}" \
            -p no:cacheprovider -rfEs --durations=25 -o faulthandler_timeout=240 --junitxml="$out/junit.xml" \
            tests/test_gpu.py $files 2>&1 | tee "$out/pytest.log" | tail -n 120
        rc=${PIPESTATUS[0]}
        echo "== pytest: exit $rc in $((SECONDS - t)) s"
        [ -f "$out/junit.xml" ] && python3 - "$out/junit.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
for c in cases:
    if "test_gpu" in c.get("classname", ""):
        state = next((k.tag for k in c if k.tag in ("failure", "error", "skipped")), "passed")
        print(f"gpu set: {c.get('name')}: {state} in {float(c.get('time')):.1f} s")
EOF
        [ "$rc" -eq 0 ] || { echo "gpu_readme tests: FAILED"; exit 1; }
        ;;
    *) echo "unknown part $part (job or tests)"; exit 2 ;;
esac
echo "gpu_readme $part: passed in $((SECONDS - t0)) s"
