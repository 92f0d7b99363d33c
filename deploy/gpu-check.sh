#!/usr/bin/env bash
# Runs on a GPU machine with only its own Python's torch (the kit `make gpu-kit` builds,
# carried there as .gpu/): says what the machine has, checks the test binary finds every
# library, runs the device tests on cuda:0, and sets limpet's 125m time per step beside the
# same model's in plain PyTorch (transformers) on the same GPU. Writes everything under
# $OUT (or ./gpu-out). Exit status: the tests'. LIMPET_TEST_DEVICE=cpu runs the same tests on
# the CPU (the kit's dry run, where there is no GPU).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT_DIR="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
cat "$HERE/KIT" 2>/dev/null
"$PY" -c 'import torch; print("python torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: not there"
TORCH_LIB="$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BIN="$HERE/limpet-cuda-tests"
if ldd "$BIN" | grep 'not found'; then
    echo "gpu-check: the test binary misses the libraries above"
    exit 1
fi
ldd "$BIN" | grep -E 'libtorch|libc10' || true
export LIMPET_TEST_DEVICE="${LIMPET_TEST_DEVICE:-cuda:0}" LIMPET_GPU_OUT="$OUT_DIR" RUST_BACKTRACE=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
echo "device tests on $LIMPET_TEST_DEVICE"
"$BIN" --test-threads=1 --nocapture 2>&1 | tee "$OUT_DIR/tests.log"
STATUS=${PIPESTATUS[0]}
if [ -f "$OUT_DIR/config-125m.json" ]; then
    # The peer: the same configuration, batch and context in transformers on the same GPU.
    "$PY" "$HERE/hf_train.py" "$OUT_DIR/config-125m.json" 8 512 10 3 1 cuda | tee "$OUT_DIR/peer.json"
fi
exit "$STATUS"
