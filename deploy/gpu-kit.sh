#!/usr/bin/env bash
# Builds, on this machine, a kit that proves limpet's device paths on a GPU machine which has
# its own Python torch but no Rust and no network (and cannot receive libtorch: ~1 GB): the
# device tests (trainer/tests/cuda.rs) built against that machine's torch version, with
# deploy/gpu-check.sh and the PyTorch peer (bench/hf_train.py), in .gpu/ (at most 64 MiB).
#
#   deploy/gpu-kit.sh TORCH_VERSION      (make gpu-kit TORCH=2.11.0)
#
# tch pairs with one libtorch release: 0.26 with 2.13 (the workspace's own), 0.24 with 2.11.
# The kit is built in a scratch copy of the working tree with tch pinned to the pairing
# release, so the workspace's own lock file and target directory are untouched. Only the
# wheel's libtorch (lib/ and include/) is unpacked; its CUDA libraries are not installed
# here: the test binary is linked allowing libtorch_cuda.so's own undefined symbols, which
# the GPU machine's torch resolves at run time.
set -euo pipefail

TORCH="${1:?usage: deploy/gpu-kit.sh TORCH_VERSION (2.13.x or 2.11.x)}"
case "$TORCH" in
    2.13.*) TCH=0.26.0 ;;
    2.11.*) TCH=0.24.0 ;;
    *) echo "gpu-kit: no tch release here pairs with torch $TORCH (2.13.x: tch 0.26, 2.11.x: tch 0.24)" >&2; exit 64 ;;
esac
CLONE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${LIMPET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/limpet}"
KIT_CACHE="$CACHE/gpu-kit"
TORCH_DIR="$KIT_CACHE/torch-$TORCH"
OUT_DIR="$CLONE/.gpu"
PYTHON_BIN="${PYTHON:-python3}"
say() { printf '==> gpu-kit: %s\n' "$*" >&2; }

mkdir -p "$KIT_CACHE"
if [ "$TCH" = 0.26.0 ] && [ -d "$CLONE/.limpet/libtorch/lib" ]; then
    # The workspace's own torch (make setup's): nothing to fetch. A kit of it is the dry run
    # of the others, here, against the CPU (LIMPET_TEST_DEVICE=cpu .gpu/gpu-check.sh).
    mkdir -p "$TORCH_DIR" && ln -sfn "$(readlink -f "$CLONE/.limpet/libtorch")" "$TORCH_DIR/torch"
    touch "$TORCH_DIR/.complete"
fi
if [ ! -f "$TORCH_DIR/.complete" ]; then
    say "fetching PyPI's torch==$TORCH wheel (Linux x86-64, CPython 3.12) for its libtorch"
    rm -rf "$TORCH_DIR" "$KIT_CACHE/wheel"
    "$PYTHON_BIN" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d "$KIT_CACHE/wheel" "torch==$TORCH"
    mkdir -p "$TORCH_DIR"
    "$PYTHON_BIN" - "$KIT_CACHE"/wheel/torch-*.whl "$TORCH_DIR" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(("torch/lib/", "torch/include/", "torch/share/"))]
    z.extractall(dest, names)
PY
    rm -rf "$KIT_CACHE/wheel"
    touch "$TORCH_DIR/.complete"
fi
LIBTORCH="$TORCH_DIR/torch"

say "copying the working tree to a scratch workspace with tch $TCH"
SCRATCH="$KIT_CACHE/src"
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"
(cd "$CLONE" && git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$SCRATCH/" 2>/dev/null || true)
sed -i -E "s/^tch = .*/tch = \"=$TCH\"/; s/^torch-sys = .*/torch-sys = \"=$TCH\"/" "$SCRATCH/Cargo.toml"
rm -f "$SCRATCH/.cargo/config.toml"

say "building trainer/tests/cuda.rs against libtorch $TORCH (release)"
export LIBTORCH LIBTORCH_BYPASS_VERSION_CHECK=1
export CARGO_TARGET_DIR="$KIT_CACHE/target"
export RUSTFLAGS="-C link-arg=-Wl,--allow-shlib-undefined"
(cd "$SCRATCH" && cargo test -p limpet-trainer --release --test cuda --no-run --message-format=json) \
    > "$KIT_CACHE/build.json"
BIN="$("$PYTHON_BIN" -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])' "$KIT_CACHE/build.json" | tail -1)"
[ -n "$BIN" ] || { echo "gpu-kit: the build named no test binary" >&2; exit 1; }

rm -rf "$OUT_DIR" && mkdir -p "$OUT_DIR"
cp "$BIN" "$OUT_DIR/limpet-cuda-tests"
strip "$OUT_DIR/limpet-cuda-tests"
cp "$CLONE/deploy/gpu-check.sh" "$CLONE/bench/hf_train.py" "$OUT_DIR/"
echo "torch $TORCH, tch $TCH, built $(date -u +%Y-%m-%dT%H:%MZ) from $(cd "$CLONE" && git rev-parse --short HEAD)" > "$OUT_DIR/KIT"
SIZE=$(du -sb "$OUT_DIR" | cut -f1)
[ "$SIZE" -le $((64 << 20)) ] || { echo "gpu-kit: .gpu/ is $SIZE bytes, over the 64 MiB a run carries" >&2; exit 1; }
say "kit ready in .gpu/ ($((SIZE >> 20)) MiB): on the GPU machine, run .gpu/gpu-check.sh"
