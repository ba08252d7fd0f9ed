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

# A skipped test prints its reason; CTest does not show it, so the skipped tests and their reasons are listed after.
test-c: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS); rc=$$?; sh $(CURDIR)/tests/skip_reasons.sh .; exit $$rc

# The Python tests run with $(PYTHON) when it has numpy and pytest or can pip-install them, else in a virtual
# environment made in $(BUILD)/venv (a system Python that refuses installs: PEP 668). -rs: each skip's reason.
test-python: build
	@py=$$(sh scripts/python-for-tests.sh "$(PYTHON)" "$(CURDIR)/$(BUILD)/venv") && \
	echo "KDA_LIBRARY=$(CURDIR)/$(BUILD)/libkda.so PYTHONPATH=$(CURDIR)/python $$py -m pytest -q -rs tests/python" && \
	KDA_LIBRARY=$(CURDIR)/$(BUILD)/libkda.so PYTHONPATH=$(CURDIR)/python $$py -m pytest -q -rs tests/python

clean:
	rm -rf $(BUILD)
