#!/usr/bin/env bash
# Builds the two images, <registry>/nano-gpu/allocator and <registry>/nano-gpu/agent
# (Dockerfile.allocator, Dockerfile.agent), with docker, podman or buildah, whichever works here,
# and pushes them if asked.
#
#   hack/build-images.sh [--registry R] [--tag T] [--push] [--dry-run]
#
#   --registry R   prefix of the image names, e.g. registry.example.com/team (default: none, the
#                  names deploy/ uses: nano-gpu/allocator, nano-gpu/agent)
#   --tag T        default: the workspace's version (Cargo.toml), which deploy/ names
#   --push         push both images after building them
#   --dry-run      print what would be run, run nothing (no container engine needed)
#
# The last lines printed are the `images:` stanza of a kustomize overlay that installs these images
# (README, "Installing with kustomize"). The images are for this machine's architecture.
#
# Base images come from the registries the Dockerfiles name. Where those registries are out of reach,
# NANO_GPU_LOCAL_BASE=1 makes the bases here instead: a Debian bookworm root filesystem made with
# debootstrap from Debian's mirror (with gcc for the builder stage), and the host's Rust toolchain
# copied into the builder. The Dockerfiles are the same either way; only BUILDER_IMAGE and
# RUNTIME_IMAGE change.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "build-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The workspace's version: [workspace.package] version in Cargo.toml.
version() { sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml"; }

REGISTRY="" TAG="" PUSH=0 DRY=0
while (($#)); do
  case $1 in
    --registry) REGISTRY=${2:?--registry needs a value}; shift 2 ;;
    --tag) TAG=${2:?--tag needs a value}; shift 2 ;;
    --push) PUSH=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) die "unexpected argument $1: the tag is --tag $1 (see --help)" ;;
  esac
done
TAG=${TAG:-$(version)}
[[ -n $TAG ]] || die "no tag: --tag T, or a version in Cargo.toml's [workspace.package]"
[[ $TAG =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "--tag $TAG is not an image tag"
REGISTRY=${REGISTRY%/}
[[ -z $REGISTRY || $REGISTRY =~ ^[a-z0-9]([a-z0-9._:-]*[a-z0-9])?(/[a-z0-9._-]+)*$ ]] ||
  die "--registry $REGISTRY is not a registry or repository prefix (e.g. registry.example.com/team)"
name() { echo "${REGISTRY:+$REGISTRY/}nano-gpu/$1:$TAG"; }

if ((DRY)); then
  run() { echo "+ $*"; }
elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  ENGINE=docker
elif command -v podman >/dev/null; then
  ENGINE=podman
elif command -v buildah >/dev/null; then
  ENGINE=buildah
else
  die "no container engine (docker daemon, podman or buildah); install one, e.g. apt-get install buildah"
fi
if ((!DRY)); then run() { "$@"; }; fi
ENGINE=${ENGINE:-docker}
build() {
  case $ENGINE in
    docker) run docker build "$@" ;;
    podman) run podman build --network host "$@" ;;
    # chroot isolation: works where nested containers and cgroups are not available.
    buildah) run buildah bud --isolation chroot --network host --layers "$@" ;;
  esac
}
push() {
  case $ENGINE in
    docker | podman) run "$ENGINE" push "$1" ;;
    buildah) run buildah push "$1" "docker://$1" ;;
  esac
}

args=()
if [[ ${NANO_GPU_LOCAL_BASE:-0} == 1 ]] && ((!DRY)); then
  command -v buildah >/dev/null || die "NANO_GPU_LOCAL_BASE=1 needs buildah"
  command -v debootstrap >/dev/null || die "NANO_GPU_LOCAL_BASE=1 needs debootstrap"
  work=${NANO_GPU_CACHE:-$HOME/.cache/nano-gpu}/images
  mkdir -p "$work"
  # image NAME ROOTFS: an image of a root filesystem.
  image() {
    local c
    c=$(buildah from scratch)
    buildah copy "$c" "$2" / >/dev/null
    buildah commit --rm "$c" "$1" >/dev/null
  }
  if ! buildah inspect localhost/nano-gpu-runtime-base:bookworm >/dev/null 2>&1; then
    log "making the runtime base (debootstrap minbase)"
    debootstrap --variant=minbase bookworm "$work/runtime-rootfs" http://deb.debian.org/debian >&2
    image localhost/nano-gpu-runtime-base:bookworm "$work/runtime-rootfs"
  fi
  if ! buildah inspect localhost/nano-gpu-builder:1.95 >/dev/null 2>&1; then
    log "making the builder base (debootstrap + gcc + the host's Rust toolchain)"
    debootstrap --variant=minbase --include=gcc,libc6-dev,ca-certificates bookworm \
      "$work/builder-rootfs" http://deb.debian.org/debian >&2
    # The host's trusted CAs (a proxy on the way to crates.io may need its own).
    cp /etc/ssl/certs/ca-certificates.crt "$work/builder-rootfs/etc/ssl/certs/ca-certificates.crt"
    sysroot=$(rustc --print sysroot)
    mkdir -p "$work/builder-rootfs/usr/local/rust"
    cp -a "$sysroot/." "$work/builder-rootfs/usr/local/rust/"
    ln -sf /usr/local/rust/bin/cargo "$work/builder-rootfs/usr/local/bin/cargo"
    ln -sf /usr/local/rust/bin/rustc "$work/builder-rootfs/usr/local/bin/rustc"
    image localhost/nano-gpu-builder:1.95 "$work/builder-rootfs"
  fi
  args+=(--build-arg BUILDER_IMAGE=localhost/nano-gpu-builder:1.95
         --build-arg RUNTIME_IMAGE=localhost/nano-gpu-runtime-base:bookworm)
fi

for part in allocator agent; do
  image=$(name "$part")
  log "building $image"
  start=$(date +%s)
  build "${args[@]}" -f "$ROOT/Dockerfile.$part" -t "$image" "$ROOT"
  log "$image built in $(( $(date +%s) - start )) s"
  if ((PUSH)); then
    push "$image"
    log "$image pushed"
  fi
done
# The overlay's stanza for these images.
echo "images:"
for part in agent allocator; do
  echo "  - name: nano-gpu/$part"
  if [[ -n $REGISTRY ]]; then echo "    newName: $REGISTRY/nano-gpu/$part"; fi
  echo "    newTag: \"$TAG\""
done
