#!/usr/bin/env bash
# Installs what limpet needs to build and run, into a cache outside the clone so that every
# clone on the machine shares it:
#   - libtorch, from PyPI's torch wheel of the version tch expects, in a Python venv (the same
#     venv gives the tests Python's torch, safetensors and transformers, and moto's local EC2
#     API server);
#   - scikit-learn's digits.csv.gz, taken out of its wheel (scikit-learn itself is not installed);
#   - with --bench, the peers only the benchmarks run (torchft).
# Then writes a make fragment with the paths. Safe to run again: finished parts are skipped.
set -euo pipefail

TORCH_VERSION=2.13.0            # tch 0.26 is built against this libtorch
SKLEARN_VERSION=1.7.2
MOTO_VERSION=5.2.5              # a local EC2 API server for the fleet tests
TRANSFORMERS_VERSION=5.23.0     # the other side of the Hugging Face interop tests
PYARROW_VERSION=26.0.1          # writes the Parquet files the tokenize tests read
TORCHFT_VERSION=0.2.0           # a peer in `make bench` (bench elastic); only with --bench
DIGITS_SHA256=09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22

CACHE="${LIMPET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/limpet}"
VENV="$CACHE/torch-$TORCH_VERSION"
DATA="$CACHE/data"
ENV_MK="$CACHE/env-$TORCH_VERSION.mk"
PYTHON_BIN="${PYTHON:-python3}"

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'setup: %s\n' "$*" >&2; exit 1; }

command -v "$PYTHON_BIN" >/dev/null || die "no $PYTHON_BIN: install Python 3.10 or newer"
command -v cargo >/dev/null || die "no cargo: install the Rust toolchain (rustup)"
# Debian packages the build and the tests need: systemd-analyze checks the shipped unit,
# protoc generates raft-rs's messages for prost at build time, patchelf sets the release
# tarball's rpath (`make dist`, and its test).
install_package() { # PACKAGE WHY WHAT-IS-MISSING
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing $1 ($2)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >&2 || die "apt-get install $1 failed"
    else
        die "no $3: install it (Debian: apt-get install $1)"
    fi
}
need_package() { # COMMAND PACKAGE WHY
    command -v "$1" >/dev/null || install_package "$2" "$3" "$1"
}
need_package systemd-analyze systemd "for checking the systemd unit"
need_package protoc protobuf-compiler "protoc, for raft-rs's prost codec"
need_package ip iproute2 "ip, for the tests that give each agent a network namespace"
need_package patchelf patchelf "the release tarball's rpath"
need_package readelf binutils "readelf, for the test that reads the binaries' NEEDED libraries"
# A C++ compiler builds torch-sys's bindings and the trainer's helper (trainer/build.rs).
need_package c++ g++ "a C++ compiler, for torch-sys and trainer/build.rs"
mkdir -p "$CACHE" "$DATA"

# One setup at a time: a second clone waits instead of racing on the same venv.
exec 9>"$CACHE/.setup.lock"
flock 9

if [ ! -f "$VENV/.complete" ]; then
    # Only to make the venv: a machine whose cache is complete needs no venv module.
    "$PYTHON_BIN" -c 'import ensurepip, venv' 2>/dev/null ||
        install_package python3-venv "Python's venv, which holds the torch wheel" "Python venv module"
    say "installing torch==$TORCH_VERSION from PyPI into $VENV (about 4 GB, once per machine)"
    rm -rf "$VENV"
    "$PYTHON_BIN" -m venv "$VENV" || die "python -m venv failed (Debian: apt-get install python3-venv)"
    "$VENV/bin/pip" install -q --no-input --disable-pip-version-check --progress-bar off \
        "torch==$TORCH_VERSION" safetensors numpy >&2
    touch "$VENV/.complete"
fi

if ! "$VENV/bin/python" -c "import moto.server, moto.s3.responses, moto.ssm.responses, py_partiql_parser, yaml" 2>/dev/null; then
    say "installing moto==$MOTO_VERSION into $VENV (local EC2, S3 and SSM APIs for the fleet and checkpoint tests)"
    "$VENV/bin/pip" install -q --no-input --disable-pip-version-check --progress-bar off \
        "moto[server,ec2,s3,ssm]==$MOTO_VERSION" >&2
fi

if ! "$VENV/bin/python" -c "import transformers; assert transformers.__version__ == '$TRANSFORMERS_VERSION'" 2>/dev/null; then
    say "installing transformers==$TRANSFORMERS_VERSION into $VENV (the Hugging Face interop tests)"
    "$VENV/bin/pip" install -q --no-input --disable-pip-version-check --progress-bar off \
        "transformers==$TRANSFORMERS_VERSION" >&2
fi

if ! "$VENV/bin/python" -c "import pyarrow; assert pyarrow.__version__ == '$PYARROW_VERSION'" 2>/dev/null; then
    say "installing pyarrow==$PYARROW_VERSION into $VENV (Parquet files for the tokenize tests)"
    "$VENV/bin/pip" install -q --no-input --disable-pip-version-check --progress-bar off \
        "pyarrow==$PYARROW_VERSION" >&2
fi

if [ "${1:-}" = "--bench" ] &&
    ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('torchft') == '$TORCHFT_VERSION'" 2>/dev/null; then
    say "installing torchft==$TORCHFT_VERSION into $VENV (a peer of bench elastic)"
    "$VENV/bin/pip" install -q --no-input --disable-pip-version-check --progress-bar off \
        "torchft==$TORCHFT_VERSION" >&2
fi

TORCH_DIR=$("$VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
[ -f "$TORCH_DIR/lib/libtorch_cpu.so" ] || die "torch in $VENV has no lib/libtorch_cpu.so"

if ! echo "$DIGITS_SHA256  $DATA/digits.csv.gz" | sha256sum -c --status 2>/dev/null; then
    say "fetching digits.csv.gz from the scikit-learn==$SKLEARN_VERSION wheel"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$VENV/bin/pip" download -q --no-deps --only-binary=:all: --disable-pip-version-check \
        --progress-bar off -d "$tmp" "scikit-learn==$SKLEARN_VERSION" >&2
    "$VENV/bin/python" - "$tmp" "$DATA/digits.csv.gz.part" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/scikit_learn-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("sklearn/datasets/data/digits.csv.gz"))
PY
    echo "$DIGITS_SHA256  $DATA/digits.csv.gz.part" | sha256sum -c --status \
        || die "digits.csv.gz from scikit-learn $SKLEARN_VERSION has an unexpected checksum"
    mv "$DATA/digits.csv.gz.part" "$DATA/digits.csv.gz"
fi

# Plain cargo in this clone finds libtorch through .cargo/config.toml and these links.
CLONE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$CLONE/.limpet"
ln -sfn "$TORCH_DIR" "$CLONE/.limpet/libtorch"
# A wrapper, not a link: a venv's interpreter finds its packages from the path it was
# started by, so a link to it starts a Python without them.
rm -f "$CLONE/.limpet/python"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$VENV/bin/python" > "$CLONE/.limpet/python"
chmod +x "$CLONE/.limpet/python"

cat > "$ENV_MK.part" <<MK
# Written by deploy/setup.sh; paths of this machine's limpet dependencies.
LIBTORCH := $TORCH_DIR
LIMPET_PYTHON := $VENV/bin/python
LIMPET_DIGITS := $DATA/digits.csv.gz
MK
mv "$ENV_MK.part" "$ENV_MK"
say "setup complete: libtorch at $TORCH_DIR"
