#!/usr/bin/env bash
# A local base image for docker/Dockerfile, built from Debian packages and PyPI only, for a machine
# that can reach those but no container registry (`python:3.11-slim` cannot be pulled there):
#
#   docker/base.sh [IMAGE]          # default asyncwebrl-base:bookworm; then
#   docker build --build-arg BASE_IMAGE=asyncwebrl-base:bookworm --build-arg TORCH_BUILD=base ...
#
# Debian bookworm's minimal root filesystem (debootstrap) with its Python 3.11 in a virtual
# environment at /opt/venv (first on PATH, so the Dockerfile's `pip` and `python` are the same as in
# python:3.11-slim), imported with `docker import`. PyTorch's CPU index is out of reach on such a
# machine too, so the CPU torch wheel pip finds for the host (TORCH_WHEEL, or the one in the wheel
# folder pip is configured with) is installed here, and the Dockerfile's TORCH_BUILD=base keeps it.
# The host's extra CA certificates (/usr/local/share/ca-certificates: a TLS-inspecting proxy's) are
# trusted in the image, so that its builds reach PyPI wherever the host does.
# Needs root, debootstrap and a Docker engine (DOCKER_HOST is honoured).
set -euo pipefail

image=${1:-asyncwebrl-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
torch_version=$(sed -n 's/^torch==//p' "$(dirname "$0")/../constraints/cpu.txt")
wheel=${TORCH_WHEEL:-}
if [[ -z $wheel ]]; then
  for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
    found=$(ls "$dir"/torch-"$torch_version"+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
    [[ -n $found ]] && wheel=$found && break
  done
fi
if [[ -z $wheel || ! -f $wheel ]]; then
  echo "no CPU torch $torch_version wheel for Python 3.11: set TORCH_WHEEL=PATH" >&2
  exit 2
fi
for tool in debootstrap docker; do
  command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install debootstrap docker.io)" >&2; exit 2; }
done

root=$(mktemp -d /tmp/awrl-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot "$root" python3 -m venv /opt/venv
cp "$wheel" "$root/tmp/"
chroot "$root" env -u PIP_FIND_LINKS PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
  /opt/venv/bin/pip install -q "/tmp/$(basename "$wheel")"
# What a slim image leaves out: package caches, lists, docs and the wheel.
rm -rf "$root"/tmp/* "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root/etc/resolv.conf"
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$image" >/dev/null
echo "$image: $(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec) (python $(
  docker run --rm "$image" python -c 'import platform, torch; print(platform.python_version(), "torch", torch.__version__)'))"
