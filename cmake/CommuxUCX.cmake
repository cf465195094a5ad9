# Locates UCX and defines the imported target commux::ucx.
#
# COMMUX_UCX_PROVIDER:
#   wheel  - UCX from PyPI's libucx-cu13 wheel (UCX 1.22 with the CUDA transports), found by asking
#            Python (COMMUX_PYTHON, else Python3_EXECUTABLE, else the repo's .venv, else python3)
#            for the installed `libucx` package.
#   system - UCX installed on the system (Debian libucx-dev: UCX 1.13, CPU only), or under UCX_ROOT.
#   auto   - UCX_ROOT if set, else the wheel if Python has it, else the system.
# Whatever is chosen, one UCX is linked; binaries carry its library directory in their RPATH.
set(COMMUX_UCX_PROVIDER "auto" CACHE STRING "Where UCX comes from: auto, wheel or system")
set_property(CACHE COMMUX_UCX_PROVIDER PROPERTY STRINGS auto wheel system)
if(NOT DEFINED UCX_ROOT AND DEFINED ENV{UCX_ROOT})
  set(UCX_ROOT "$ENV{UCX_ROOT}")
endif()

function(_commux_wheel_prefix out)
  set(candidates "")
  if(COMMUX_PYTHON)
    list(APPEND candidates "${COMMUX_PYTHON}")
  endif()
  if(Python3_EXECUTABLE)
    list(APPEND candidates "${Python3_EXECUTABLE}")
  endif()
  if(DEFINED ENV{VIRTUAL_ENV})
    list(APPEND candidates "$ENV{VIRTUAL_ENV}/bin/python")
  endif()
  list(APPEND candidates "${PROJECT_SOURCE_DIR}/.venv/bin/python")
  find_program(_commux_sys_python NAMES python3 python)
  if(_commux_sys_python)
    list(APPEND candidates "${_commux_sys_python}")
  endif()
  foreach(py IN LISTS candidates)
    if(EXISTS "${py}")
      execute_process(
        COMMAND "${py}" -c "import libucx, os; print(os.path.dirname(libucx.__file__))"
        OUTPUT_VARIABLE prefix OUTPUT_STRIP_TRAILING_WHITESPACE
        RESULT_VARIABLE rc ERROR_QUIET)
      if(rc EQUAL 0 AND EXISTS "${prefix}/include/ucp/api/ucp.h")
        set(${out} "${prefix}" PARENT_SCOPE)
        return()
      endif()
    endif()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()

set(_ucx_prefix "")
set(_ucx_provider "${COMMUX_UCX_PROVIDER}")
if(_ucx_provider STREQUAL "auto")
  if(UCX_ROOT)
    set(_ucx_provider "system")
  else()
    _commux_wheel_prefix(_ucx_prefix)
    if(_ucx_prefix)
      set(_ucx_provider "wheel")
    else()
      set(_ucx_provider "system")
    endif()
  endif()
endif()

if(_ucx_provider STREQUAL "wheel")
  if(NOT _ucx_prefix)
    _commux_wheel_prefix(_ucx_prefix)
  endif()
  if(NOT _ucx_prefix)
    message(FATAL_ERROR "COMMUX_UCX_PROVIDER=wheel, but no Python found has the libucx package: "
                        "pip install libucx-cu13 (scripts/setup.sh does this in .venv)")
  endif()
  set(_ucx_hints "${_ucx_prefix}")
  set(_ucx_nodefault NO_DEFAULT_PATH)
elseif(_ucx_provider STREQUAL "system")
  set(_ucx_hints "${UCX_ROOT}")
  set(_ucx_nodefault "")
  if(UCX_ROOT)
    set(_ucx_nodefault NO_DEFAULT_PATH)
  endif()
else()
  message(FATAL_ERROR "COMMUX_UCX_PROVIDER must be auto, wheel or system (got '${COMMUX_UCX_PROVIDER}')")
endif()

find_path(COMMUX_UCX_INCLUDE_DIR ucp/api/ucp.h HINTS ${_ucx_hints} PATH_SUFFIXES include ${_ucx_nodefault})
foreach(lib ucp uct ucs)
  find_library(COMMUX_UCX_${lib}_LIBRARY NAMES ${lib} HINTS ${_ucx_hints} PATH_SUFFIXES lib lib64 ${_ucx_nodefault})
  if(NOT COMMUX_UCX_${lib}_LIBRARY)
    message(FATAL_ERROR "UCX library lib${lib} not found (provider ${_ucx_provider}, hints '${_ucx_hints}'). "
                        "Run scripts/setup.sh, or set UCX_ROOT.")
  endif()
endforeach()
if(NOT COMMUX_UCX_INCLUDE_DIR)
  message(FATAL_ERROR "UCX headers (ucp/api/ucp.h) not found (provider ${_ucx_provider}).")
endif()

file(STRINGS "${COMMUX_UCX_INCLUDE_DIR}/ucp/api/ucp_version.h" _ucx_ver REGEX "define UCP_API_(MAJOR|MINOR)")
string(REGEX REPLACE ".*UCP_API_MAJOR +([0-9]+).*" "\\1" _ucx_major "${_ucx_ver}")
string(REGEX REPLACE ".*UCP_API_MINOR +([0-9]+).*" "\\1" _ucx_minor "${_ucx_ver}")
get_filename_component(COMMUX_UCX_LIBDIR "${COMMUX_UCX_ucp_LIBRARY}" DIRECTORY)
set(COMMUX_UCX_PROVIDER_RESOLVED "${_ucx_provider}" CACHE INTERNAL "")
set(COMMUX_UCX_LIBDIR "${COMMUX_UCX_LIBDIR}" CACHE INTERNAL "")
get_filename_component(COMMUX_UCX_PREFIX "${COMMUX_UCX_INCLUDE_DIR}" DIRECTORY)
set(COMMUX_UCX_PREFIX "${COMMUX_UCX_PREFIX}" CACHE INTERNAL "")
message(STATUS "commux: UCX ${_ucx_major}.${_ucx_minor} from ${_ucx_provider} (${COMMUX_UCX_LIBDIR})")

if(NOT TARGET commux::ucx)
  add_library(commux::ucx INTERFACE IMPORTED)
  set_target_properties(commux::ucx PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${COMMUX_UCX_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "${COMMUX_UCX_ucp_LIBRARY};${COMMUX_UCX_uct_LIBRARY};${COMMUX_UCX_ucs_LIBRARY}")
endif()
