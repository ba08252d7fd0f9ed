# libkda: `make demo` and `make test` configure and build into build/ first.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PYTHON ?= python3
CMAKE_FLAGS ?=
# The CUDA backend (CMakeLists.txt's CUDA block): KDA_WITH_CUDA=AUTO|ON|OFF (empty: the build directory's setting,
# AUTO at first: on only when a supported GPU is visible), KDA_CUDA_ARCHS e.g. 90a,100a (empty: the GPU's own).
KDA_WITH_CUDA ?=
KDA_CUDA_ARCHS ?=
# The x86-64 levels of the CPU path (CMakeLists.txt's KDA_CPU_ISAS): e.g. v3,v4 (empty: the build directory's
# setting, native at first: this machine's level).
KDA_CPU_ISAS ?=
comma := ,
KDA_FLAGS  := $(if $(KDA_WITH_CUDA),-DKDA_WITH_CUDA=$(KDA_WITH_CUDA)) \
              $(if $(KDA_CUDA_ARCHS),-DKDA_CUDA_ARCHS=$(subst ;,$(comma),$(KDA_CUDA_ARCHS))) \
              $(if $(KDA_CPU_ISAS),-DKDA_CPU_ISAS=$(subst ;,$(comma),$(KDA_CPU_ISAS)))
DEMO_ARGS ?=
# Ninja when it is installed (only for a fresh build directory: CMake keeps the generator it was given)
GENERATOR := $(if $(wildcard $(BUILD)/CMakeCache.txt),,$(if $(shell command -v ninja 2>/dev/null),-G Ninja,))

.PHONY: all configure build demo test test-c test-python clean

all: build

configure:
	cmake -S . -B $(BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=Release $(KDA_FLAGS) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The main job: a synthetic problem on the GPU when the build has CUDA and a GPU is usable, else on the CPU (the
# demo says why not CUDA), checked against the oracle.
# Only the library and the CLI are built for it (the tests are not).
demo: configure
	cmake --build $(BUILD) -j $(JOBS) --target kda_cli
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
