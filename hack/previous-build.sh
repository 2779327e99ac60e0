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
# Its binaries go to a target directory of their own (in the checkout's, they would take the place of
# its own at the top of debug/), but everything else cargo makes goes to the checkout's build directory
# (`build.build-dir`), so the dependencies the checkout built already are used as they are. Cargo
# reuses one only if its features are the same, and the two versions' packages turn on different
# ones (dev-dependencies, crates added since): a crate of our own, built beside the previous version's
# packages, turns on what the checkout's build does (tests/src/bin/feature-pin.rs reads both unit
# graphs). Without it, tokio, syn and everything above them compiled again.
target=$CACHE/commits/target
build_dir=${CARGO_BUILD_BUILD_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}}
packages=(-p nano-gpu-allocator -p nano-gpu-agent)
# cargo's unit graph (what a build would compile, with each unit's features; nothing is built) is
# unstable: RUSTC_BOOTSTRAP lets the stable cargo print it.
unit_graph() { RUSTC_BOOTSTRAP=1 cargo build --quiet --unit-graph -Z unstable-options "$@"; }
# The tool from the checkout's build as the tests use it (with `cargo run -p`, cargo would compile it
# with other features, and some dependencies anew): nothing to do after README command 1.
pin=${CARGO_TARGET_DIR:-$ROOT/target}/debug/feature-pin
if (cd "$ROOT" && cargo build --quiet --locked --workspace --all-targets >&2 &&
  unit_graph --locked --workspace --all-targets >"$src/.current.json" &&
  cd "$src" && unit_graph --locked "${packages[@]}" --bins >"$src/.previous.json" &&
  "$pin" manifest "$src/.current.json" "$src/.previous.json" >"$src/.pin.toml"); then
  mkdir -p "$src/feature-pin"
  mv "$src/.pin.toml" "$src/feature-pin/Cargo.toml"
  : >"$src/feature-pin/lib.rs"
  echo 'fn main() {}' >"$src/feature-pin/build.rs"
  sed -i 's/^members = \[/members = ["feature-pin", /' "$src/Cargo.toml"
  grep -q '"feature-pin"' "$src/Cargo.toml" || die "could not add the feature pin to ${commit:0:7}'s workspace"
  packages+=(-p nano-gpu-feature-pin)
  # The pin adds a package to the lock file (and may add dependencies a feature turns on), so the
  # build below cannot be --locked; the versions already locked stay as they are.
  locked=()
  if (cd "$src" && unit_graph "${packages[@]}" --bins >"$src/.previous.json"); then
    "$pin" compare "$src/.current.json" "$src/.previous.json" | head -1 | sed 's/^/previous-build: /' >&2 || true
  fi
else
  log "the checkout's features could not be read: its dependencies will be compiled again"
  locked=(--locked)
fi
log "building nano-gpu-allocator and nano-gpu-agent of ${commit:0:7} ..."
# Its own crates at the checkout's opt-level (it set the allocator's to 2: its lib and binary took
# about 350 s more to compile).
(cd "$src" && CARGO_TARGET_DIR=$target CARGO_BUILD_BUILD_DIR=$build_dir CARGO_INCREMENTAL=0 cargo build \
  --config 'profile.dev.package.nano-gpu-allocator.opt-level=0' "${locked[@]}" "${packages[@]}" --bins >&2) ||
  die "building ${commit:0:7} failed"
rm -rf "$OUT"
mkdir -p "$OUT/bin"
cp "$target/debug/nano-gpu-allocator" "$target/debug/nano-gpu-agent" "$OUT/bin/"
cp -r "$src/deploy" "$OUT/deploy"
rm -rf "$target"
touch "$OUT/.complete"
log "built in $((SECONDS - start)) s: $OUT"
echo "$OUT"
