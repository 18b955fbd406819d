#!/usr/bin/env bash
# One GPU session's checks, in parts that each fit a 10-minute device call; logs and JSON go under $OUT.
#
#   bash benchmarks/gpu_session.sh tests    # CUDA tests (-m gpu) + the demo on cuda           (~5 min)
#   bash benchmarks/gpu_session.sh suite    # the 8b suite: peak memory, reload, decode step   (~8 min)
#   bash benchmarks/gpu_session.sh rollout  # rollout tokens/s on 8b: Engine.generate, BF16 and each FP8 scheme
#                                           # at batch 8 and 64, against transformers' generate  (~6 min)
#   bash benchmarks/gpu_session.sh moe      # MoE load + the 8b reload alone (quicker re-check),
#                                           # and a cProfile of the first 8b load in a process  (~6 min)
#   bash benchmarks/gpu_session.sh tune     # GEMM tiles for the 8b projections at M = 1 and 8 (decode);
#                                           # writes kernels/configs/<gpu>.json into $OUT/configs  (~8 min)
#   bash benchmarks/gpu_session.sh session  # for a 15-minute device budget, in one call (~9.5 min): the CUDA
#                                           # tests on 8 workers, the demo, then the suite on what is left;
#                                           # everything packed into $OUT/gpu_session.tgz (the device returns
#                                           # at most 8 files)
#
# Every step is cut off by SIGINT (timeout -s INT), so pytest still prints its summary; each part's limits add
# up to less than the device's 600 s per call. The tuner writes its JSON and configurations after every slice.
# Run from the repository root. A torchao wheel in .whl/ (`pip download torchao==0.17.0 --no-deps -d .whl`)
# is installed first where torchao is missing. Afterwards, on the development machine: copy the JSON into
# benchmarks/results/, commit it, then `python -m layerwise.benchmarks.readme` and commit README.md. Run
# `tune` before `suite` (in its own call): copy $OUT/configs/*.json into kernels/configs/ and commit it, so the
# suite's decode step launches the tuned GEMMs.
set -uo pipefail
part=${1:?usage: gpu_session.sh tests|suite|rollout|moe|tune|session}
OUT=${OUT:-/tmp/lw-gpu}
mkdir -p "$OUT"
if ! python3 -c "import torchao" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
{ nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; } \
  >"$OUT/device.txt" 2>&1
# the steps more than one part runs: each takes its time limit in seconds (and pytest's extra arguments, or the
# suite's budget)
gpu_tests() {
  local limit=$1; shift
  timeout -s INT -k 10 "$limit" python3 -m pytest -m gpu tests -q -rfE --durations=15 -p no:cacheprovider "$@" \
    >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; tail -n 25 "$OUT/gpu_tests.log"
}
demo_cuda() {
  timeout -s INT -k 10 "$1" python3 -m layerwise.cli demo --device cuda >"$OUT/demo_cuda.log" 2>&1
  echo "demo exit $?"; tail -n 8 "$OUT/demo_cuda.log"
}
# the suite's rollout part has its own step (rollout_8b): in the suite it would get only what the others leave
suite_8b() {
  timeout -s INT -k 10 "$1" python3 -m layerwise.benchmarks.suite --device cuda --size 8b --budget "$2" \
    --parts peak_memory,reload_latency,decode_step --out-dir "$OUT/results" --cache-dir /tmp/lw-bench \
    >"$OUT/suite.log" 2>&1
  echo "suite exit $?"; tail -n 40 "$OUT/suite.log"
}
rollout_8b() {
  timeout -s INT -k 10 "$1" python3 -m layerwise.benchmarks.rollout --device cuda --size 8b --budget "$2" \
    --out-dir "$OUT/results" --cache-dir /tmp/lw-bench >"$OUT/rollout.log" 2>&1
  echo "rollout exit $?"; tail -n 20 "$OUT/rollout.log"
}
case "$part" in
  tests)
    gpu_tests 420
    demo_cuda 120
    ;;
  suite)
    suite_8b 560 500
    ;;
  rollout)
    rollout_8b 560 500
    ;;
  moe)
    timeout -s INT -k 10 180 python3 -m layerwise.benchmarks.moe_load --device cuda --loads 3 --out-dir "$OUT/results" \
      >"$OUT/moe.log" 2>&1
    echo "moe exit $?"; tail -n 15 "$OUT/moe.log"
    timeout -s INT -k 10 260 python3 -m layerwise.benchmarks.reload_latency --device cuda --size 8b --repeats 3 \
      --out-dir "$OUT/reload" --cache-dir /tmp/lw-bench >"$OUT/reload.log" 2>&1
    echo "reload exit $?"; tail -n 20 "$OUT/reload.log"
    timeout -s INT -k 10 100 python3 -m layerwise.benchmarks.first_load_profile --device cuda --size 8b \
      --out-dir "$OUT/results" --cache-dir /tmp/lw-bench >"$OUT/first_load.log" 2>&1
    echo "first-load profile exit $?"; tail -n 14 "$OUT/first_load.log"
    ;;
  tune)
    timeout -s INT -k 10 540 python3 -m layerwise.benchmarks.gemm_tune --device cuda --size 8b --budget 420 --write-configs \
      --out-dir "$OUT/results" >"$OUT/tune.log" 2>&1
    echo "tune exit $?"; tail -n 40 "$OUT/tune.log"
    mkdir -p "$OUT/configs" && cp kernels/configs/*.json "$OUT/configs/" 2>/dev/null
    ;;
  session)
    start=$SECONDS
    if python3 -c "import xdist" 2>/dev/null; then gpu_tests 240 -n 8; else gpu_tests 240; fi
    demo_cuda 60
    left=$((555 - (SECONDS - start)))
    suite_8b "$left" $((left - 45))
    tar czf /tmp/gpu_session.tgz -C "$OUT" . && mv /tmp/gpu_session.tgz "$OUT/"
    ;;
  *)
    echo "unknown part $part (tests|suite|rollout|moe|tune|session)" >&2
    exit 2
    ;;
esac
