#!/usr/bin/env bash
# Builds the release tarball `limpet-VERSION-linux-x86_64.tar.gz` that deploy/cloud-init.yaml
# installs (`tar -C / -xzf`): laid out as it lands on a host,
#   usr/local/bin/limpetd, limpet            stripped; rpath $ORIGIN/../lib/limpet
#   usr/local/lib/limpet/*.so*               the libtorch libraries the binaries load (found
#                                            with ldd: whatever is not the system's)
#   etc/systemd/system/limpetd.service       the unit
#   usr/local/share/limpet/                  the Grafana dashboard, cloud-init template, docs
# plus a .sha256 beside it (the value cloud-init's release_sha256 wants).
#
#   deploy/dist.sh [--bin-dir DIR] [--out DIR]
#
# --bin-dir: where limpetd and limpet were built (default target/release; `make dist` builds
# them). --out: where the tarball goes (default dist/).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN_DIR="$ROOT/target/release"
OUT="$ROOT/dist"
while [ $# -gt 0 ]; do
    case "$1" in
        --bin-dir) BIN_DIR=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        *) echo "dist: unknown argument $1 (use --bin-dir DIR, --out DIR)" >&2; exit 64 ;;
    esac
done

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'dist: %s\n' "$*" >&2; exit 1; }

command -v patchelf >/dev/null || die "no patchelf: run deploy/setup.sh (Debian: apt-get install patchelf)"
for b in limpetd limpet; do
    [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b is not built (make dist builds it)"
done
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)
[ -n "$VERSION" ] || die "no version in $ROOT/Cargo.toml"
NAME="limpet-$VERSION-linux-$(uname -m)"

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
# Directories as they should be on a host: the archive's entries for usr/, etc/ and the
# rest must not change what the host's own directories allow.
umask 022
mkdir -p "$STAGE/usr/local/bin" "$STAGE/usr/local/lib/limpet" "$STAGE/etc/systemd/system" \
    "$STAGE/usr/local/share/limpet/docs" "$STAGE/usr/local/share/limpet/grafana"
chmod 755 "$STAGE"/usr "$STAGE"/etc

say "binaries from $BIN_DIR (stripped)"
for b in limpetd limpet; do
    strip -o "$STAGE/usr/local/bin/$b" "$BIN_DIR/$b"
    # The build's rpath names the build machine's libtorch; on a host it is beside the binary.
    patchelf --set-rpath '$ORIGIN/../lib/limpet' "$STAGE/usr/local/bin/$b"
done

say "the libraries they load"
# Every library ldd resolves outside the system's directories: libtorch, libc10 and what they
# pull in from the torch wheel. They find each other through their own $ORIGIN rpath.
libs=$(for b in limpetd limpet; do ldd "$BIN_DIR/$b"; done |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 }' |
    grep -v -E '^/(lib|lib64|usr/lib|usr/lib64)/' | sort -u)
[ -n "$libs" ] || die "ldd found no libtorch libraries for $BIN_DIR/limpetd"
for l in $libs; do
    cp -L "$l" "$STAGE/usr/local/lib/limpet/"
    chmod 644 "$STAGE/usr/local/lib/limpet/$(basename "$l")"
done

cp "$ROOT/deploy/systemd/limpetd.service" "$STAGE/etc/systemd/system/"
cp "$ROOT/deploy/grafana/limpet.json" "$STAGE/usr/local/share/limpet/grafana/"
cp "$ROOT/deploy/cloud-init.yaml" "$ROOT/README.md" "$STAGE/usr/local/share/limpet/"
cp "$ROOT"/docs/*.md "$STAGE/usr/local/share/limpet/docs/"

mkdir -p "$OUT"
TARBALL="$OUT/$NAME.tar.gz"
say "packing $TARBALL ($(du -sh "$STAGE" | cut -f1) unpacked)"
# Named entries, not `.`: extracted at /, an entry for `.` would set the mode of / itself.
tar -C "$STAGE" --owner=0 --group=0 --numeric-owner -czf "$TARBALL.part" usr etc
mv "$TARBALL.part" "$TARBALL"
(cd "$OUT" && sha256sum "$NAME.tar.gz" > "$NAME.tar.gz.sha256")
say "done: $TARBALL ($(du -h "$TARBALL" | cut -f1)), sha256 $(cut -d' ' -f1 "$TARBALL.sha256")"
echo "$TARBALL"
