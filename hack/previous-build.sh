#!/usr/bin/env bash
# Builds the version an upgrade starts from, for the upgrade test (tests/tests/upgrade.rs): its
# nano-gpu-allocator and nano-gpu-agent, and its deploy/, from this clone's history, into a cache
# keyed by the commit.
#
# nano-gpu has no release yet (CHANGELOG.md), so a commit stands for the previous version:
# PREVIOUS below. Once releases exist it names the newest one's commit.
#
# Usage: hack/previous-build.sh [COMMIT]  -> prints the directory (bin/, deploy/) on stdout
# Env:   NANO_GPU_CACHE  cache root (default ~/.cache/nano-gpu)
set -euo pipefail

# cac7fa4 (2026-11-27): before the extender's filter answered one node and held its cards, and
# before the allocator's watches streamed their lists.
PREVIOUS=cac7fa434d71a9fc9da1b3d99e4d2d16f4b5d413

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
log() { echo "previous-build: $*" >&2; }
die() { log "error: $*"; exit 1; }

want=${1:-$PREVIOUS}
# A full commit name already built needs no history (a shallow clone lacks it).
if [[ $want =~ ^[0-9a-f]{40}$ && -f $CACHE/commits/$want/.complete ]]; then echo "$CACHE/commits/$want"; exit 0; fi
commit=$(git -C "$ROOT" rev-parse --verify --quiet "$want^{commit}") ||
  die "commit $want is not in this clone ($ROOT): a shallow clone lacks it (git fetch --unshallow)"
OUT=$CACHE/commits/$commit
done_() { [[ -f $OUT/.complete ]]; }
if done_; then echo "$OUT"; exit 0; fi

mkdir -p "$CACHE/commits"
exec 9>"$CACHE/commits/.build.lock" && flock 9
if done_; then echo "$OUT"; exit 0; fi

start=$SECONDS
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git -C "$ROOT" archive "$commit" | tar -x -C "$src"
log "building nano-gpu-allocator and nano-gpu-agent of ${commit:0:7} ..."
# Its binaries go to a target directory of their own (in the checkout's, they would take the place of
# its own at the top of debug/), but everything else cargo makes goes to the checkout's build directory
# (`build.build-dir`): the dependencies the checkout built already are used as they are, so a build
# that follows the checkout's compiles mostly the previous version's own crates.
target=$CACHE/commits/target
build_dir=${CARGO_BUILD_BUILD_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}}
(cd "$src" && CARGO_TARGET_DIR=$target CARGO_BUILD_BUILD_DIR=$build_dir CARGO_INCREMENTAL=0 cargo build --locked \
  -p nano-gpu-allocator -p nano-gpu-agent --bins >&2) || die "building ${commit:0:7} failed"
rm -rf "$OUT"
mkdir -p "$OUT/bin"
cp "$target/debug/nano-gpu-allocator" "$target/debug/nano-gpu-agent" "$OUT/bin/"
cp -r "$src/deploy" "$OUT/deploy"
rm -rf "$target"
touch "$OUT/.complete"
log "built in $((SECONDS - start)) s: $OUT"
echo "$OUT"
