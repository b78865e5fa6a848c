#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one script (docs/cuda.md says what it measured).
#
# Run from a checkout's root on the GPU machine: `WHL=../.whl OUT=/some/dir tools/gpu_check.sh`.
# WHL: wheels of what the machine's python3 lacks (trio, outcome, sniffio, pytest-trio,
# pyopencl, tinygrad), installed into /tmp/site first. Every stage has its own time limit and
# writes its log under $OUT; a failing stage does not stop the next.
set -u
OUT=${OUT:-/tmp/hcqa-gpu}
WHL=${WHL:-.whl}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HCQA_CACHE_DIR=/tmp/hcqa-cache
if ls "$WHL"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHL"/*.whl || echo "wheel install failed" >>"$OUT/env.txt"
fi
export PYTHONPATH=/tmp/site:$PWD

stage() {  # stage NAME SECONDS COMMAND...: run, log to $OUT/NAME.txt, say how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.txt"
}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -c "import sys, cuda.bindings; print(sys.version.split()[0], 'cuda-bindings', cuda.bindings.__version__)"
    python3 -m pip list 2>/dev/null | grep -i -E "nvidia-cuda-nvrtc|cuda-bindings|numpy|pytest|trio|pyopencl|tinygrad"
    command -v cc gcc clang ld
    ls /usr/local/nvidia/lib64 2>/dev/null | head -50
} >"$OUT/env.txt" 2>&1
ocl=$(ls /usr/local/nvidia/lib64/libnvidia-opencl.so* /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so* \
    /usr/lib64/libnvidia-opencl.so* /usr/lib/libnvidia-opencl.so* 2>/dev/null | head -n 1)
if [ -n "$ocl" ]; then
    mkdir -p /tmp/icd && echo "$ocl" >/tmp/icd/nvidia.icd
    export OCL_ICD_VENDORS=/tmp/icd OCL_ICD_FILENAMES=$ocl
    echo "OpenCL ICD: $ocl" >>"$OUT/summary.txt"
fi
stage info 30 python3 -m hcqa.cli info

stage test_cuda 120 python3 -m pytest -q -p no:cacheprovider -p no:randomly -ra tests/test_cuda.py

# The OpenCL suite on the GPU's own OpenCL driver, through pyopencl's ICD loader (set for every
# stage: opencl:0 is then the GPU, also for test_cuda's cuda <-> opencl transfers).
if [ -n "$ocl" ]; then
    stage test_opencl 120 python3 -m pytest -q -p no:cacheprovider -p no:randomly -ra \
        tests/test_opencl.py tests/test_opencl_pitfalls.py tests/test_opencl_integration.py
else
    echo "== test_opencl: no libnvidia-opencl.so on this machine" | tee -a "$OUT/summary.txt"
fi

stage bench 60 python3 tools/cuda_bench.py
# the same launches with the driver's threads blocking instead of spinning (a context flag)
HCQA_CUDA_SCHED=blocking stage bench_blocking 40 python3 tools/cuda_bench.py --sizes 4096,1048576

# tinygrad's own CUDA device needs libnvrtc (from the nvidia-cuda-nvrtc wheel) and libcuda.
nvrtc=$(python3 - <<'EOF'
import glob, os, site
for d in site.getsitepackages() + ["/tmp/site"]:
    for f in sorted(glob.glob(os.path.join(d, "nvidia", "**", "libnvrtc.so*"), recursive=True)):
        if "builtins" not in f:
            print(f); raise SystemExit
EOF
)
cuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
loader=$(ls /tmp/site/pyopencl/.libs/libOpenCL* 2>/dev/null | head -n 1)
echo "tinygrad: NVRTC_PATH=$nvrtc CUDA_PATH=$cuda OPENCL_PATH=$loader" >>"$OUT/summary.txt"
NVRTC_PATH=$nvrtc CUDA_PATH=$cuda OPENCL_PATH=$loader \
    stage model 90 python3 tools/cuda_model.py
cat "$OUT/summary.txt"
