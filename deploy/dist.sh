#!/usr/bin/env bash
# Builds the release tarballs that deploy/cloud-init.yaml installs (`tar -C / -xzf`), in two
# variants named as such:
#   limpet-VERSION-linux-ARCH-cuda.tar.gz   for GPU hosts (cloud-init's default): libtorch's
#                                           CUDA backend and the CUDA libraries of the
#                                           nvidia wheels it loads, besides the CPU ones
#   limpet-VERSION-linux-ARCH-cpu.tar.gz    for CPU hosts: the binaries without libtorch_cuda
#                                           among their NEEDED libraries, and what libtorch_cpu
#                                           loads (with PyPI's wheel: the CUDA runtime and
#                                           CUPTI it links, not the CUDA backend)
# each laid out as it lands on a host,
#   usr/local/bin/limpetd, limpet            stripped; rpath $ORIGIN/../lib/limpet
#   usr/local/lib/limpet/*.so*               the libtorch libraries the binaries load (found
#                                            with ldd: whatever is not the system's; for CUDA
#                                            also what those libraries dlopen beside
#                                            themselves), rpath $ORIGIN
#   etc/systemd/system/limpetd.service       the unit
#   usr/local/share/limpet/                  the Grafana dashboard, cloud-init template, docs,
#                                            the preemption traces (traces/)
# plus a .sha256 beside each (the value cloud-init's release_sha256 wants).
#
#   deploy/dist.sh [--bin-dir DIR] [--out DIR] [--variant cpu|cuda|all] [--stage-only] [--fast]
#
# --bin-dir: where limpetd and limpet were built (default target/release; `make dist` builds
# them). --out: where the tarballs go (default dist/). --variant: which (default: both, or
# only cpu, with a warning, when the libtorch has no libtorch_cuda.so). --stage-only: lay each variant out in OUT/NAME/
# and print that directory instead of packing (the tests run the staged tree). --fast: gzip's
# fastest level (a larger tarball in a third of the time: what the tests pack).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN_DIR="$ROOT/target/release"
OUT="$ROOT/dist"
VARIANTS="cpu cuda"
ASKED=""   # a variant named on the command line must be built; the default skips what cannot be
PACK=1
GZIP_LEVEL=-6
while [ $# -gt 0 ]; do
    case "$1" in
        --bin-dir) BIN_DIR=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --variant)
            case "$2" in
                cpu|cuda) VARIANTS=$2; ASKED=$2 ;;
                all) VARIANTS="cpu cuda"; ASKED=all ;;
                *) echo "dist: --variant $2: one of cpu, cuda, all" >&2; exit 64 ;;
            esac
            shift 2 ;;
        --stage-only) PACK=0; shift ;;
        --fast) GZIP_LEVEL=-1; shift ;;
        *) echo "dist: unknown argument $1 (use --bin-dir DIR, --out DIR, --variant cpu|cuda|all, --stage-only, --fast)" >&2; exit 64 ;;
    esac
done

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'dist: %s\n' "$*" >&2; exit 1; }

command -v patchelf >/dev/null || die "no patchelf: run deploy/setup.sh (Debian: apt-get install patchelf)"
for b in limpetd limpet; do
    [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b is not built (make dist builds it)"
    # A workspace build turns on limpet-lab's `lab` feature (local clusters, drills, chaos
    # hooks) in the product crates too; a release carries none of it. (The tests pack their
    # own lab build where no product build is at hand, and say so.)
    if "$BIN_DIR/$b" --version 2>/dev/null | grep -q 'lab build' && [ "${LIMPET_DIST_ALLOW_LAB:-}" != 1 ]; then
        die "$BIN_DIR/$b is a lab build ($("$BIN_DIR/$b" --version)): make dist builds the product alone (cargo build --release -p limpet-daemon --bins)"
    fi
done
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)
[ -n "$VERSION" ] || die "no version in $ROOT/Cargo.toml"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# The libraries a binary loads from outside the system's directories (none found: empty).
outside_libs() { # BINARY...
    local out
    out=$(for b in "$@"; do ldd "$b"; done)
    if echo "$out" | grep -q 'not found'; then
        die "ldd cannot resolve every library of $*: $(echo "$out" | grep 'not found' | tr -s ' \t' ' ')"
    fi
    echo "$out" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' |
        { grep -v -E '^/(lib|lib64|usr/lib|usr/lib64)/' || true; } | sort -u
}

# The CPU variant's binaries: the build's, without libtorch_cuda.so among their NEEDED
# libraries (nothing references its symbols: dropping it leaves a CPU libtorch).
mkdir -p "$WORK/cpu-bin"
for b in limpetd limpet; do
    cp "$BIN_DIR/$b" "$WORK/cpu-bin/$b"
    patchelf --remove-needed libtorch_cuda.so "$WORK/cpu-bin/$b"
done

stage() { # VARIANT STAGE
    local variant=$1 stage=$2 bins libs l
    # Directories as they should be on a host: the archive's entries for usr/, etc/ and the
    # rest must not change what the host's own directories allow.
    umask 022
    mkdir -p "$stage/usr/local/bin" "$stage/usr/local/lib/limpet" "$stage/etc/systemd/system" \
        "$stage/usr/local/share/limpet/docs" "$stage/usr/local/share/limpet/grafana" \
        "$stage/usr/local/share/limpet/traces"
    chmod 755 "$stage"/usr "$stage"/etc
    if [ "$variant" = cuda ]; then bins=$BIN_DIR; else bins=$WORK/cpu-bin; fi
    say "$variant: binaries from $bins (stripped)"
    for b in limpetd limpet; do
        strip -o "$stage/usr/local/bin/$b" "$bins/$b"
        # The build's rpath names the build machine's libtorch; on a host it is beside the binary.
        patchelf --set-rpath '$ORIGIN/../lib/limpet' "$stage/usr/local/bin/$b"
    done
    libs=$(outside_libs "$bins/limpetd" "$bins/limpet")
    [ -n "$libs" ] || die "ldd found no libtorch libraries for $bins/limpetd"
    if [ "$variant" = cuda ]; then
        grep -q '/libtorch_cuda\.so$' <<< "$libs" ||
            die "the binaries do not load libtorch_cuda.so: build against a libtorch with CUDA (PyPI's Linux torch wheel has it)"
        # The CUDA libraries dlopen siblings ldd cannot see (cuDNN's engines, nvrtc's
        # builtins): every library of the nvidia wheels' directories ldd touched comes along.
        libs=$( { echo "$libs"; for d in $(echo "$libs" | grep '/nvidia/' | xargs -r -n1 dirname | sort -u); do
            find "$d" -maxdepth 1 -name '*.so*' \( -type f -o -type l \); done; } | sort -u)
    fi
    say "$variant: the libraries they load ($(echo "$libs" | wc -l))"
    for l in $libs; do
        cp -L "$l" "$stage/usr/local/lib/limpet/"
        chmod 644 "$stage/usr/local/lib/limpet/$(basename "$l")"
        # Flattened into one directory: each finds the others beside itself (the wheel's
        # rpaths name its own layout, ../../nvidia/...).
        if [ "$variant" = cuda ]; then
            patchelf --set-rpath '$ORIGIN' "$stage/usr/local/lib/limpet/$(basename "$l")" ||
                say "warning: could not set the rpath of $(basename "$l") (it keeps the wheel's)"
        fi
    done
    cp "$ROOT/deploy/systemd/limpetd.service" "$stage/etc/systemd/system/"
    cp "$ROOT/deploy/grafana/limpet.json" "$stage/usr/local/share/limpet/grafana/"
    cp "$ROOT/deploy/cloud-init.yaml" "$ROOT/README.md" "$stage/usr/local/share/limpet/"
    cp "$ROOT"/docs/*.md "$stage/usr/local/share/limpet/docs/"
    cp "$ROOT"/daemon/traces/* "$stage/usr/local/share/limpet/traces/"
}

mkdir -p "$OUT"
BUILT_LIBS=$(outside_libs "$BIN_DIR/limpetd")
if [ -z "$ASKED" ] && ! grep -q '/libtorch_cuda\.so$' <<< "$BUILT_LIBS"; then
    say "warning: this libtorch has no CUDA backend: only the cpu variant is built"
    VARIANTS=cpu
fi
for variant in $VARIANTS; do
    NAME="limpet-$VERSION-linux-$(uname -m)-$variant"
    if [ "$PACK" = 0 ]; then
        rm -rf "${OUT:?}/$NAME"
        stage "$variant" "$OUT/$NAME"
        say "staged: $OUT/$NAME ($(du -sh "$OUT/$NAME" | cut -f1))"
        echo "$OUT/$NAME"
        continue
    fi
    STAGE="$WORK/$variant"
    stage "$variant" "$STAGE"
    TARBALL="$OUT/$NAME.tar.gz"
    say "packing $TARBALL ($(du -sh "$STAGE" | cut -f1) unpacked)"
    # Named entries, not `.`: extracted at /, an entry for `.` would set the mode of / itself.
    tar -C "$STAGE" --owner=0 --group=0 --numeric-owner -I "gzip $GZIP_LEVEL" -cf "$TARBALL.part" usr etc
    mv "$TARBALL.part" "$TARBALL"
    (cd "$OUT" && sha256sum "$NAME.tar.gz" > "$NAME.tar.gz.sha256")
    say "done: $TARBALL ($(du -h "$TARBALL" | cut -f1)), sha256 $(cut -d' ' -f1 "$TARBALL.sha256")"
    rm -rf "$STAGE"
    echo "$TARBALL"
done
