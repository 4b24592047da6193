#!/usr/bin/env bash
# Run where PyPI is reachable, in the repository root, before benchmarks/run_gpu.sh on a GPU
# machine without network: downloads the pure-Python wheels of the comparison tools into .whl/
# (about 1.7 MB; git-ignored through .git/info/exclude), which run_gpu.sh installs there.
#   BackPACK (+ unfoldNd): BackPACK rows, and gradlens' convolution kernels use its derivatives;
#   cockpit (+ json-tricks, and setuptools<81 for its pkg_resources import); Opacus.
# Their other needs (einops, numpy, scipy, pandas, seaborn, matplotlib, opt-einsum, torchvision)
# are expected on the GPU machine (they are in the H200 image).
set -eu
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
PY="${PYTHON:-python3}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
    --implementation cp --platform manylinux2014_x86_64 -d .whl \
    backpack-for-pytorch==1.7.1 unfoldNd==0.2.3 cockpit-for-pytorch==1.0.2 json-tricks==3.17.3 \
    opacus==1.6.0 "setuptools<81"
ls -la .whl
echo "now, on the GPU machine: bash benchmarks/run_gpu.sh   (carry .whl along)"
