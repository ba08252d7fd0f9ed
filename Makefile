# libkda: `make demo` and `make test` configure and build into build/ first.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PYTHON ?= python3
CMAKE_FLAGS ?=
DEMO_ARGS ?=
# Ninja when it is installed (only for a fresh build directory: CMake keeps the generator it was given)
GENERATOR := $(if $(wildcard $(BUILD)/CMakeCache.txt),,$(if $(shell command -v ninja 2>/dev/null),-G Ninja,))

.PHONY: all build demo test test-c test-python clean

all: build

build:
	cmake -S . -B $(BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

# The main job: a synthetic problem on the GPU when one is usable, else on the CPU, checked against the oracle.
demo: build
	./$(BUILD)/kda demo $(DEMO_ARGS)

# C tests (CTest; GPU tests report themselves skipped without a GPU), then the Python package's tests.
test: test-c test-python

test-c: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-python: build
	@$(PYTHON) -c "import numpy, pytest" 2>/dev/null || $(PYTHON) -m pip install --quiet numpy pytest
	KDA_LIBRARY=$(CURDIR)/$(BUILD)/libkda.so PYTHONPATH=$(CURDIR)/python $(PYTHON) -m pytest -q -rs tests/python

clean:
	rm -rf $(BUILD)
