# `make chat` and `make test` are all a newcomer needs; both set everything up on first use.
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup model chat lint test test-fast bench clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh
	@touch $@

setup: $(VENV)/.installed

model: setup  ## fetch + convert the embedded default model (once; cached)
	$(BIN)/mlx-specdec fetch

chat: model
	$(BIN)/mlx-specdec chat

test: model lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup  ## ruff: pyflakes and pycodestyle errors
	$(BIN)/ruff check .

test-fast: setup lint  ## no model download: skips the tests marked slow
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: model
	$(BIN)/mlx-specdec bench --methods ar,mlx-lm --output benchmarks/results/latest.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
