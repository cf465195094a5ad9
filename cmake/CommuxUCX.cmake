# Locates UCX and defines the imported target commux::ucx.
#
# COMMUX_UCX_PROVIDER:
#   wheel  - UCX from PyPI's libucx-cu13 wheel (UCX 1.22 with the CUDA transports), found by asking
#            Python (COMMUX_PYTHON, else Python3_EXECUTABLE, else the repo's .venv, else python3)
#            for the installed `libucx` package.
#   system - UCX installed on the system (Debian libucx-dev: UCX 1.13, CPU only), or under UCX_ROOT.
#   auto   - UCX_ROOT if set, else the wheel if Python has it, else the system.
#   bundled - the UCX auto would choose (the wheel's or the system's), copied into the install
#            (libraries, transport modules, headers; cmake/CommuxBundleUCX.cmake) with
#            $ORIGIN-relative RPATHs: a wheel that needs no UCX of its own (no libucx-cu13).
# Whatever is chosen, one UCX is linked; binaries carry its library directory in their RPATH.
#
# COMMUX_WITH_GDRCOPY (auto, on, off): whether UCX's gdr_copy transport (GPUDirect copies through
# libgdrapi) goes with a bundled UCX. auto: bundled when both UCX's module and libgdrapi are found;
# on: required (configure fails without libgdrapi, whatever the provider); off: never bundled.
# GDRCOPY_ROOT=/path points at a gdrcopy install. The wheel/system providers use UCX as installed.
set(_commux_ucx_providers auto wheel system bundled)
set(_commux_gdrcopy_values auto on off)
set(COMMUX_UCX_PROVIDER "auto" CACHE STRING "Where UCX comes from: auto, wheel, system or bundled")
set_property(CACHE COMMUX_UCX_PROVIDER PROPERTY STRINGS ${_commux_ucx_providers})
set(COMMUX_WITH_GDRCOPY "auto" CACHE STRING "gdr_copy with a bundled UCX: auto, on or off")
set_property(CACHE COMMUX_WITH_GDRCOPY PROPERTY STRINGS ${_commux_gdrcopy_values})
string(TOLOWER "${COMMUX_UCX_PROVIDER}" _commux_provider_lc)
if(NOT _commux_provider_lc IN_LIST _commux_ucx_providers)
  list(JOIN _commux_ucx_providers ", " _valid)
  message(FATAL_ERROR "COMMUX_UCX_PROVIDER='${COMMUX_UCX_PROVIDER}' is not a valid provider; valid: ${_valid}")
endif()
string(TOLOWER "${COMMUX_WITH_GDRCOPY}" _commux_gdrcopy)
if(NOT _commux_gdrcopy IN_LIST _commux_gdrcopy_values)
  list(JOIN _commux_gdrcopy_values ", " _valid)
  message(FATAL_ERROR "COMMUX_WITH_GDRCOPY='${COMMUX_WITH_GDRCOPY}' is not valid; valid: ${_valid}")
endif()
# A wheel's metadata (its dependency on libucx-cu13) is decided before CMake runs, from the
# environment (pyproject.toml's overrides): a bundled wheel is asked for through the environment.
if(SKBUILD AND _commux_provider_lc STREQUAL "bundled" AND NOT "$ENV{COMMUX_UCX_PROVIDER}" STREQUAL "bundled")
  message(FATAL_ERROR "COMMUX_UCX_PROVIDER=bundled in a pip build must come from the environment "
                      "(COMMUX_UCX_PROVIDER=bundled pip wheel .), so that the wheel's metadata drops "
                      "its libucx-cu13 dependency; a -C cmake.define alone would leave it in")
endif()
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
set(_ucx_provider "${_commux_provider_lc}")
set(_ucx_bundled OFF)
if(_ucx_provider STREQUAL "bundled")
  set(_ucx_bundled ON)
  set(_ucx_provider "auto")
endif()
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
if(_ucx_bundled)
  set(COMMUX_UCX_BUNDLE_SOURCE "${_ucx_provider}" CACHE INTERNAL "")
  set(_ucx_provider "bundled")
endif()
set(COMMUX_UCX_PROVIDER_RESOLVED "${_ucx_provider}" CACHE INTERNAL "")
set(COMMUX_UCX_VERSION "${_ucx_major}.${_ucx_minor}" CACHE INTERNAL "")
set(COMMUX_UCX_LIBDIR "${COMMUX_UCX_LIBDIR}" CACHE INTERNAL "")
get_filename_component(COMMUX_UCX_PREFIX "${COMMUX_UCX_INCLUDE_DIR}" DIRECTORY)
set(COMMUX_UCX_PREFIX "${COMMUX_UCX_PREFIX}" CACHE INTERNAL "")
if(_ucx_bundled)
  message(STATUS "commux: UCX ${_ucx_major}.${_ucx_minor} from ${COMMUX_UCX_BUNDLE_SOURCE} (${COMMUX_UCX_LIBDIR}), bundled")
else()
  message(STATUS "commux: UCX ${_ucx_major}.${_ucx_minor} from ${_ucx_provider} (${COMMUX_UCX_LIBDIR})")
endif()

# gdr_copy: libgdrapi is looked for whatever the provider; `on` without it stops here.
find_library(COMMUX_GDRAPI_LIBRARY NAMES gdrapi HINTS ${GDRCOPY_ROOT} $ENV{GDRCOPY_ROOT}
             PATH_SUFFIXES lib lib64)
set(COMMUX_GDRCOPY_BUNDLE OFF CACHE INTERNAL "")
if(_commux_gdrcopy STREQUAL "on" AND NOT COMMUX_GDRAPI_LIBRARY)
  message(FATAL_ERROR "COMMUX_WITH_GDRCOPY=on, but libgdrapi was not found: install gdrcopy (or set "
                      "GDRCOPY_ROOT to its prefix), or pass COMMUX_WITH_GDRCOPY=auto or off")
endif()
if(_ucx_bundled AND NOT _commux_gdrcopy STREQUAL "off")
  set(_gdr_module "${COMMUX_UCX_LIBDIR}/ucx/libuct_cuda_gdrcopy.so.0")
  if(COMMUX_GDRAPI_LIBRARY AND EXISTS "${_gdr_module}")
    set(COMMUX_GDRCOPY_BUNDLE ON CACHE INTERNAL "")
  elseif(_commux_gdrcopy STREQUAL "on")
    message(FATAL_ERROR "COMMUX_WITH_GDRCOPY=on, but the UCX being bundled has no gdr_copy transport "
                        "(${_gdr_module} is absent): use a UCX built with gdrcopy, or pass auto or off")
  endif()
endif()
if(_ucx_bundled)
  message(STATUS "commux: gdr_copy bundled: ${COMMUX_GDRCOPY_BUNDLE} (COMMUX_WITH_GDRCOPY=${_commux_gdrcopy}, "
                 "libgdrapi '${COMMUX_GDRAPI_LIBRARY}')")
endif()

if(NOT TARGET commux::ucx)
  add_library(commux::ucx INTERFACE IMPORTED)
  set_target_properties(commux::ucx PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${COMMUX_UCX_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "${COMMUX_UCX_ucp_LIBRARY};${COMMUX_UCX_uct_LIBRARY};${COMMUX_UCX_ucs_LIBRARY}")
endif()
