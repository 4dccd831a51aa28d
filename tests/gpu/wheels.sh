#!/bin/sh
# The wheels the prepared GPU check needs beside the GPU machine's image, for CPython 3.12 on
# x86-64 Linux, pinned to one version each, into ./.whl (ignored by git; about 29 MB).
#
# The image (/work/.library/device/KINDS.md) has Python 3.12, torch, torchvision, transformers,
# onnx, onnxruntime, numpy, grpcio, protobuf, cuda-bindings, cuda-pathfinder, nvidia-ml-py,
# setuptools, certifi, aiohttp and more. Wheels installed with --target /tmp/site come first on
# PYTHONPATH and shadow the image's copies, so only these travel:
# - what plugserve and its clients need and the image lacks: httptools, orjson, pysimdjson,
#   google-re2 (RegexFullMatch's RE2), llguidance (the generate extra),
#   grpcio-health-checking, grpcio-reflection, openai with
#   httpx2/httpcore2/truststore/sniffio/distro/jiter/pydantic/pydantic-core/annotated-types/
#   typing-inspection, tritonclient and python-rapidjson;
# - tritonclient.http's own needs (the gpuops part's REST round trips): geventhttpclient,
#   gevent, greenlet, zope.event, zope.interface, brotli (4.6 MB);
# - what plugserve needs newer than an image may hold: grpcio and protobuf (the generated
#   _pb2 modules need protobuf >= 6.31 and grpcio >= 1.80), typing-extensions >= 4.16
#   (pydantic 2.14), idna >= 3.18 (httpx2), anyio >= 4.10 (openai): pure Python or
#   self-contained, and no CUDA library of the image depends on them.
# Not carried, because the image's own must stay in charge: cuda-bindings and cuda-pathfinder
# (cuda-core, cupy and torch's extras load them; tritonclient's cuda_shared_memory imports
# cuda.bindings.runtime, which the image's has), nvidia-ml-py (the per-GPU metrics use NVML
# calls every version has) and setuptools (torch.utils.cpp_extension imports it).
# setuptools >= 77 (pyproject's build requirement) goes to .whl/build/ instead: the install
# line builds plugserve in pip's isolated build environment from there (--find-links), so it
# never reaches /tmp/site.
# usage, from the repository root, on a machine with network: sh tests/gpu/wheels.sh
set -eu
DEST=${1:-.whl}
mkdir -p "$DEST/build"
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "$@"
}
download -d "$DEST" \
  grpcio==1.85.3 grpcio-health-checking==1.81.1 grpcio-reflection==1.81.1 protobuf==6.33.6 \
  httptools==0.9.0 orjson==3.13.0 pysimdjson==7.0.2 llguidance==1.9.1 google-re2==1.1.20251105 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20 \
  anyio==4.16.0 sniffio==1.3.1 distro==1.9.0 jiter==0.19.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 tritonclient==2.73.0 python-rapidjson==1.25 \
  geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 \
  brotli==1.2.1
download -d "$DEST/build" setuptools==84.2.1
ls "$DEST" "$DEST/build"
