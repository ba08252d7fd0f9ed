# FindNCCL: NCCL's header and library, for examples/cp_nccl.c (libkda itself never links NCCL).
#
# Looks in NCCL_ROOT (a variable or the environment's NCCL_ROOT / NCCL_HOME), then beside the CUDA toolkit
# (find_package(CUDAToolkit) first; the toolkit may ship NCCL), then in the system's paths (Debian's libnccl-dev).
# Defines NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION and the imported target NCCL::nccl.
set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
if(CUDAToolkit_FOUND)
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  list(APPEND _nccl_include_hints ${CUDAToolkit_INCLUDE_DIRS})
  list(APPEND _nccl_library_hints ${CUDAToolkit_LIBRARY_DIR})
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_include_hints} ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY nccl HINTS ${_nccl_library_hints} ${_nccl_hints} PATH_SUFFIXES lib lib64)
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_v REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  string(REGEX REPLACE ".*NCCL_MAJOR +([0-9]+).*NCCL_MINOR +([0-9]+).*NCCL_PATCH +([0-9]+).*" "\\1.\\2.\\3"
         NCCL_VERSION "${_nccl_v}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                              INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
