#!/bin/bash
# The GPU check on a machine lent by this workplace's device tool (docs/gpu.md, "On an H200").
#
#   bench/gpu/device.sh wheels    # here: download what the device image lacks into .whl/
#   bench/gpu/device.sh run       # there (device run, carry [".whl"]): install, check, test
#
# The device image has torch, numpy, rich, safetensors, xxhash, httpx, uvloop, psutil,
# prometheus_client and pytest, and no registry; the packages below travel as Python 3.12
# wheels (fastapi 0.165 imports opentelemetry). `run` writes gpu.json, gpu.err, pytest.log
# and logs.tgz (the jobs' logs and status) under $OUT. Settings: BENCH_TIMEOUT (s, 440),
# GPU_ARGS (extra bench.gpu flags, e.g. --quick), PYTESTS=0 to skip `pytest -m gpu`
# (GPU_TESTS: its files), LEAVE=0 to skip the NCCL leave probe (leave.json).
set -u
WHEELS="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0 pydantic==2.13.4
pydantic_core==2.46.4 typing-inspection==0.4.2 annotated-types annotated-doc==0.0.7
typing_extensions==4.16.0 plotly==7.1.0 opentelemetry-api==1.45.2"
GPU_TESTS="${GPU_TESTS:-tests/test_checkpoint_store.py tests/test_control_word.py
tests/test_devices.py tests/test_group_abort.py tests/test_heal.py tests/test_e2e_runtime.py
tests/test_landing.py}"

case "${1:-}" in
wheels)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS
    du -sh .whl
    ;;
run)
    export PYTHONUNBUFFERED=1
    t0=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 9
    export PYTHONPATH="/tmp/site:$PWD"  # the checkout too: the tests' workers import tidal
    nvidia-smi -L
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__,
torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
    python3 -c "import tidal.cli" || exit 8
    if [ "${LEAVE:-1}" != 0 ]; then  # where an NCCL leave's time goes (bench/gpu/leave.py)
        timeout 90 python3 -m bench.gpu.leave --json "$OUT/leave.json" 2>"$OUT/leave.err"
        echo "bench.gpu.leave exit $? at $(($(date +%s) - t0)) s"
        tail -1 "$OUT/leave.err"
    fi
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-440}" python3 -m bench.gpu ${GPU_ARGS:-} --json "$OUT/gpu.json" \
        --workdir /tmp/gpu-run 2> >(tee "$OUT/gpu.err" >&2) >/dev/null
    echo "bench.gpu exit $? at $(($(date +%s) - t0)) s"
    if [ "${PYTESTS:-1}" != 0 ]; then
        # shellcheck disable=SC2086
        timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 90 -o addopts="" \
            $GPU_TESTS >"$OUT/pytest.log" 2>&1
        echo "pytest -m gpu exit $? at $(($(date +%s) - t0)) s"
        tail -5 "$OUT/pytest.log"
    fi
    (cd /tmp && find gpu-run -type f -size -2M \( -name '*.log' -o -name '*.json' \
        -o -name '*.txt' -o -name '*.db' \) | tar czf "$OUT/logs.tgz" -T -)
    ;;
*)
    echo "usage: bench/gpu/device.sh wheels|run" >&2
    exit 2
    ;;
esac
