#!/usr/bin/env bash
# The GPU checks on a machine with a CUDA GPU, from the repository root:
#
#   OUT=gpu-out scripts/gpu_check.sh [engine|graphs|suite|bench|launchtests|launch|profiles|wheel]...    (default: engine bench)
#
#   engine  tests/test_gpu.py (one rank over NCCL; two ranks sharing the GPU over gloo with CUDA
#           tensors: sync, wfbp, dear, top-k+EF, PowerSGD, a MergeComp search, a user's compressor,
#           the local-update methods, their H=1 definition and commlab.wrap against DDP; CUDA-event
#           timelines; the conformance checks on CUDA tensors), tests/test_fused.py (the fused kernels
#           against the eager codecs) and the compressor tests with their inputs on the GPU
#           (COMMLAB_TEST_DEVICE=cuda)
#   graphs  the CUDA graphs of compress and the fused kernels (tests/test_graphs.py, test_fused.py,
#           test_fused_launch.py), the compressor tests of the codecs they cover with inputs on the GPU, and
#           tests/test_accounts.py (GRAPHS_LIMIT: seconds for each of the two commands)
#   suite   the whole test suite (pytest-xdist when installed: -n $JOBS)
#   bench   bench/compressor_speed.py --device cuda beside GRACE ($GRACE_DIR), profiling the misses
#   launchtests  tests/test_fused_launch.py, and tests/test_fused.py with each launch (COMMLAB_FUSED_LAUNCH)
#   launch  bench/fused_launch.py: the fused kernels launched by commlab against Triton's own launch
#           (LAUNCH_LIMIT: seconds each command of these two parts may take)
#   profiles  commlab profile of torchvision ResNet-50 and ResNet-101, batch 64, 224x224 (the device profile
#           bench/model_validation.py --table e holds the H100 roofline to)
#   wheel   tests/test_wheel.py alone, full tracebacks (SUITE_ARGS="--ignore tests/test_wheel.py" then
#           leaves it out of the suite part)
#
# Python packages the machine lacks can come as wheels in .whl/ (installed, no network, to a folder named
# site-packages, which tests/test_wheel.py's fresh environment is pointed at). A copy of the working tree
# that is not a git checkout is made one (test_wheel builds from the tracked files). Logs and results go to $OUT;
# with PACK=DIR they are also packed, on exit, into DIR/gpu-out.tgz (one file: the device tool brings back at
# most 8, and a run that wrote more lost its suite log that way).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
JOBS=${JOBS:-12}
mkdir -p "$OUT"
if [ -n "${PACK:-}" ]; then
    trap 'tar czf "$PACK/gpu-out.tgz" -C "$OUT" . 2>/dev/null || echo "gpu_check: packing $OUT failed" >&2' EXIT
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the setup below is done once per machine, and one at a time when two parts run side by side
exec 9>/tmp/commlab-gpu-check.lock && flock 9
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=/tmp/commlab-deps/site-packages
    if [ ! -e $SITE/.installed ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
            .whl/*.whl || { echo "gpu_check: installing .whl/ failed" >&2; exit 2; }
        touch $SITE/.installed
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if ! git rev-parse --git-dir >/dev/null 2>&1; then
    git init -q && git add -A && git -c user.name=gpu -c user.email=gpu@localhost commit -qm "the copy" \
        || { echo "gpu_check: could not make the copy a git checkout" >&2; exit 2; }
fi
flock -u 9
status=0
parts=("${@:-engine}")
[ $# -eq 0 ] && parts=(engine bench)
for part in "${parts[@]}"; do
    case "$part" in
        engine)
            nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv | tee "$OUT/device.txt"
            "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_properties(0))" \
                | tee -a "$OUT/device.txt"
            xdist=()
            "$PY" -c "import xdist" 2>/dev/null && xdist=(-n "${ENGINE_JOBS:-8}")
            "$PY" -m pytest -q -rs "${xdist[@]}" -p no:cacheprovider tests/test_gpu.py tests/test_fused.py 2>&1 \
                | tee "$OUT/engine-tests.log" || status=1
            COMMLAB_TEST_DEVICE=cuda "$PY" -m pytest -q -rs "${xdist[@]}" -p no:cacheprovider tests/test_compressors_common.py \
                tests/test_compressors_sparse.py tests/test_compressors_quantize.py tests/test_compressor_buffers.py \
                tests/test_compressor_capabilities.py tests/test_powersgd_layout.py 2>&1 \
                | tee "$OUT/compressors-cuda.log" || status=1
            ;;
        graphs)
            nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv | tee "$OUT/device.txt"
            xdist=()
            "$PY" -c "import xdist" 2>/dev/null && xdist=(-n "${ENGINE_JOBS:-8}")
            ${GRAPHS_LIMIT:+timeout "$GRAPHS_LIMIT"} "$PY" -m pytest -q -rs "${xdist[@]}" -p no:cacheprovider tests/test_graphs.py \
                tests/test_fused.py tests/test_fused_launch.py tests/test_accounts.py 2>&1 | tee "$OUT/graphs-tests.log" || status=1
            COMMLAB_TEST_DEVICE=cuda ${GRAPHS_LIMIT:+timeout "$GRAPHS_LIMIT"} "$PY" -m pytest -q -rs "${xdist[@]}" \
                -p no:cacheprovider tests/test_compressors_quantize.py tests/test_compressors_common.py 2>&1 \
                | tail -15 | tee "$OUT/graphs-compressors-cuda.log" || status=1
            ;;
        suite)
            xdist=()
            "$PY" -c "import xdist" 2>/dev/null && xdist=(-n "$JOBS")
            # -v into the log: a run stopped by SUITE_LIMIT still says which tests passed
            # shellcheck disable=SC2086
            ${SUITE_LIMIT:+timeout "$SUITE_LIMIT"} "$PY" -m pytest -v -rs "${xdist[@]}" -p no:cacheprovider \
                ${SUITE_ARGS:-} > "$OUT/suite.log" 2>&1 || status=1
            # xdist's -v lines read "[gw3] [ 43%] FAILED tests/...": not at the start of a line
            grep -E "(FAILED|ERROR) tests/|^=+ .*(passed|failed)" "$OUT/suite.log" | sort -u | tail -40
            echo "gpu_check: $(grep -cE '(PASSED|FAILED|ERROR|SKIPPED) tests/' "$OUT/suite.log") results logged"
            ;;
        bench)
            "$PY" bench/compressor_speed.py --device cuda --grace "${GRACE_DIR:-none}" --profile-misses \
                ${SIZES:+--sizes "$SIZES"} ${ONLY:+--only "$ONLY"} --out "$OUT/gpu_speed" 2>&1 | tee "$OUT/bench.log" || status=1
            ;;
        launchtests)
            # the direct launch's own tests, then every fused-kernel test through Triton's launch (the direct
            # one is the default, which the suite's own run of test_fused takes)
            ${LAUNCH_LIMIT:+timeout "$LAUNCH_LIMIT"} "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_fused_launch.py 2>&1 \
                | tee "$OUT/launch-tests.log" || status=1
            COMMLAB_FUSED_LAUNCH=triton ${LAUNCH_LIMIT:+timeout "$LAUNCH_LIMIT"} "$PY" -m pytest -q -rs -p no:cacheprovider \
                tests/test_fused.py 2>&1 | tee -a "$OUT/launch-tests.log" || status=1
            ;;
        launch)
            ${LAUNCH_LIMIT:+timeout "$LAUNCH_LIMIT"} "$PY" bench/fused_launch.py --out "$OUT/fused_launch" 2>&1 | tee "$OUT/launch.log" || status=1
            ;;
        profiles)
            for m in resnet50 resnet101; do
                "$PY" -m commlab.lab.front.cli profile examples/torchvision-resnet18.yaml --set model=torchvision:$m \
                    --set "dataset.shape=[3,224,224]" --set dataset.classes=1000 --set dataset.size=2048 \
                    --set batch_size=64 --steps 20 -o "$OUT/profile-$m-b64.json" --runs /tmp/gpu-runs 2>&1 \
                    | tee -a "$OUT/profiles.log" || status=1
            done
            ;;
        wheel)
            "$PY" -m pytest -v -rA --tb=long -p no:cacheprovider tests/test_wheel.py > "$OUT/wheel.log" 2>&1 || status=1
            tail -5 "$OUT/wheel.log"
            ;;
        *) echo "gpu_check: unknown part '$part'; allowed: engine, graphs, suite, bench, launchtests, launch, profiles, wheel" >&2
           exit 2 ;;
    esac
done
exit $status
