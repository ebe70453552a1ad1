# The serving image: Triton's own tritonserver and python backend, with this project installed into the
# image's system Python (3.12), the interpreter the python backend stub embeds. Every compose service uses it.
#   docker build -t triton-llm .   (see docs/docker.md)
ARG TRITON_TAG=25.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-py3

# The torch pin of requirements.txt, installed from this index: the same version as a CUDA build (the
# dev machines resolve the pin to the CPU wheel). cu130: CUDA 13, as in the 25.10 image and onnxruntime-gpu.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# The image has TensorRT's C++ libraries (for its tensorrt backend) but no Python bindings, which build_engine
# and the tensorrt runner need: the image's TensorRT version, CUDA 13 build. Its wheels live on NVIDIA's index
# (the PyPI entries are stubs that fetch from there).
ARG TENSORRT_PACKAGE=tensorrt-cu13==10.13.3.9
# Replaces the CPU onnxruntime pin of requirements.txt (the two cannot be installed side by side).
ARG ONNXRUNTIME_PACKAGE=onnxruntime-gpu==1.31.1
# For the compose `load` profile (load_tests/locustfile.py).
ARG LOCUST_PACKAGE=locust==2.47.0

# Ubuntu 24.04 marks its Python externally managed (PEP 668); this image is the environment.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LLM_MODEL_CACHE=/models/SmolLM2-135M-Instruct

# curl: the compose healthcheck. g++: the CPU kernels compile once per CPU (backend/engine/kernels/).
RUN apt-get update && apt-get install -y --no-install-recommends curl g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/llm
COPY requirements.txt requirements-nodeps.txt ./
# nvidia-pytriton is left out: it only carries a tritonserver for machines without this image.
RUN python3 -m pip install "$(grep -E '^torch==' requirements.txt)" --index-url "$TORCH_INDEX_URL" \
 && grep -vE '^onnxruntime==' requirements.txt > /tmp/requirements.txt \
 && python3 -m pip install -r /tmp/requirements.txt "$ONNXRUNTIME_PACKAGE" "$LOCUST_PACKAGE" \
 && python3 -m pip install "$TENSORRT_PACKAGE" --extra-index-url https://pypi.nvidia.com \
 && grep -vE '^nvidia-pytriton' requirements-nodeps.txt > /tmp/requirements-nodeps.txt \
 && python3 -m pip install --no-deps -r /tmp/requirements-nodeps.txt

COPY . .
# The stub runs Python isolated (PYTHONPATH is ignored): an install makes `backend` importable by model.py.
RUN python3 -m pip install --no-deps -e .
# The CPU kernels for the build host's CPU (another CPU builds its own at the launcher's start, with a progress line)
RUN python3 -m backend.engine.kernels.cpu_kernels
# NVIDIA Dynamo (compose profile `dynamo`) in its own venv over this interpreter: the engine's packages are
# shared, Dynamo stays out of the system site (scripts/dynamo_env.sh, as `make dynamo-venv` does).
RUN DYNAMO_VENV=/opt/dynamo DYNAMO_SYSTEM_SITE=1 PY=python3 bash scripts/dynamo_env.sh
# Serve as a user without root: it owns what the server writes, the models volume (a new named volume
# takes this directory's owner) and the kernel and GEMM caches under /opt/llm/.cache.
RUN useradd --create-home --shell /usr/sbin/nologin llm && mkdir -p /models /opt/llm/.cache \
 && chown -R llm:llm /models /opt/llm/.cache
USER llm

EXPOSE 8000 8001 8002 8080
CMD ["python3", "-m", "backend.triton.launcher", "--model-repository", "/models/repository", "--host", "0.0.0.0"]
