#!/usr/bin/env bash
# Installs everything difftrain needs on a Debian 12 machine: compilers and C++ libraries from
# Debian, LibTorch and the Python reference libraries from PyPI into a venv. Idempotent and
# non-interactive; a second run takes seconds.
#
#   DIFFTRAIN_VENV   where the venv lives (default: $HOME/.cache/difftrain/venv)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${DIFFTRAIN_VENV:-$HOME/.cache/difftrain/venv}

apt_packages=(
  build-essential cmake ninja-build ccache pkg-config git python3 python3-venv
  libgtest-dev libgmock-dev libbenchmark-dev
  libxtensor-dev xtl-dev nlohmann-json3-dev libcli11-dev libfmt-dev
  libpng-dev zlib1g-dev libcairo2-dev dataset-fashion-mnist libgloo-dev libicu-dev
  libturbojpeg0-dev libwebp-dev libyaml-cpp-dev libtomlplusplus-dev
  libavformat-dev libavcodec-dev libswscale-dev libavutil-dev
  clang clang-tidy clang-format libclang-rt-14-dev
)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The venv is keyed by the requirement files: a change to them reinstalls, nothing else does.
stamp="$venv/.difftrain-requirements"
want=$(cat "$here/requirements-reference.txt" "$here/constraints.txt" | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating the venv at $venv"
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing LibTorch and the reference libraries (pip)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -r "$here/requirements-reference.txt" -c "$here/constraints.txt"
  echo "$want" > "$stamp"
fi
echo "setup: ready (torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'), venv $venv)"
