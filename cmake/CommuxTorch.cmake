# Locates the torch installed in the Python that builds the extension and defines
# commux::torch (headers, libraries, the C++ ABI flag). find_package(Torch) is not used: its
# config probes for a CUDA toolkit even when nothing here compiles CUDA code, and it would pin
# absolute paths of one CUDA install into our targets.
#
# Sets COMMUX_TORCH_DIR, COMMUX_TORCH_VERSION and COMMUX_TORCH_CUDA (torch.version.cuda or "").
if(NOT COMMUX_PYTHON)
  message(FATAL_ERROR "commux: COMMUX_PYTHON (the Python with torch) is required for the torch backend")
endif()
execute_process(
  COMMAND "${COMMUX_PYTHON}" -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch.compiled_with_cxx11_abi())); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _torch_out OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _torch_rc ERROR_VARIABLE _torch_err)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "commux: cannot import torch with ${COMMUX_PYTHON}: ${_torch_err}")
endif()
string(REPLACE "\n" ";" _torch_out "${_torch_out}")
list(GET _torch_out 0 COMMUX_TORCH_DIR)
list(GET _torch_out 1 COMMUX_TORCH_VERSION)
list(GET _torch_out 2 _torch_abi)
list(LENGTH _torch_out _n)
set(COMMUX_TORCH_CUDA "")
if(_n GREATER 3)
  list(GET _torch_out 3 COMMUX_TORCH_CUDA)
endif()
message(STATUS "commux: torch ${COMMUX_TORCH_VERSION} at ${COMMUX_TORCH_DIR} (cxx11 abi ${_torch_abi}, cuda '${COMMUX_TORCH_CUDA}')")

add_library(commux_torch INTERFACE)
add_library(commux::torch ALIAS commux_torch)
target_include_directories(commux_torch SYSTEM INTERFACE
  "${COMMUX_TORCH_DIR}/include"
  "${COMMUX_TORCH_DIR}/include/torch/csrc/api/include")
target_compile_definitions(commux_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_torch_abi})
foreach(lib c10 torch_cpu torch)
  find_library(COMMUX_TORCH_LIB_${lib} ${lib} PATHS "${COMMUX_TORCH_DIR}/lib" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(commux_torch INTERFACE "${COMMUX_TORCH_LIB_${lib}}")
endforeach()
find_library(COMMUX_TORCH_LIB_torch_python torch_python PATHS "${COMMUX_TORCH_DIR}/lib"
             NO_DEFAULT_PATH REQUIRED)

# torch's headers decide the C++ standard of code that includes them: torch >= 2.14 requires C++20
# (ATen.h errors out below it); older releases build with C++17, which keeps older compilers usable.
if(COMMUX_TORCH_VERSION VERSION_GREATER_EQUAL 2.14)
  set(COMMUX_TORCH_CXX_STANDARD 20)
else()
  set(COMMUX_TORCH_CXX_STANDARD 17)
endif()
