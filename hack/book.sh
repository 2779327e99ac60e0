#!/usr/bin/env bash
# The book (docs/): builds it with mdBook into target/book, installing mdBook into the cache first
# if it is missing (a pinned version, built from crates.io: about a minute on 2 cores, once).
# `bash hack/book.sh serve` serves it on 127.0.0.1:3000 instead (needs mdBook's default features:
# NANO_GPU_MDBOOK=/path/to/mdbook). Links, anchors and the reference pages are checked by
# `cargo test -p nano-gpu-tests --test docs`.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.5.4
cache=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}
root=$cache/mdbook-$version
mdbook=${NANO_GPU_MDBOOK:-$root/bin/mdbook}
if [[ ! -x $mdbook ]]; then
  echo "book: installing mdBook $version into $root"
  cargo install --locked mdbook --version "$version" --no-default-features --features search \
    --root "$root" --quiet
fi
if [[ ${1:-} == serve ]]; then
  exec "$mdbook" serve docs --hostname 127.0.0.1 --port 3000
fi
"$mdbook" build docs 2>&1
echo "book: target/book/index.html"
