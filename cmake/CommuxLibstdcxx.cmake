# commux's libraries link the C++ runtime (libstdc++) as a shared library, always.
#
# A private static copy in each library breaks in the process that loads them beside torch (which
# uses the shared libstdc++.so.6): the copies' iostreams and locales do not agree. It was seen on
# a GPU machine whose build linked libstdc++ statically into libcommux, libcommux_c10d and _C: with
# COMMUX_DEBUG set, every rank crashed (SIGSEGV) formatting its first log line; here, built with
# LDFLAGS=-static-libstdc++, each log line stopped at its first number. Two ways a build ends up
# static, both handled:
#   * -static-libstdc++ in the flags (LDFLAGS, CXXFLAGS): dropped, with a warning;
#   * a toolchain that offers libstdc++.a but no libstdc++.so to link against (a trimmed image):
#     the shared runtime libstdc++.so.6 is linked by its path instead (COMMUX_LIBSTDCXX, added to
#     every commux library through commux_warnings); where there is none, configuring fails.
# python/tests/test_package.py checks the installed libraries (NEEDED libstdc++.so.6, none of
# libstdc++'s own symbols exported); scripts/gpu_check.sh's install step does too.
set(COMMUX_LIBSTDCXX "")
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
  foreach(_v CMAKE_SHARED_LINKER_FLAGS CMAKE_MODULE_LINKER_FLAGS CMAKE_EXE_LINKER_FLAGS CMAKE_CXX_FLAGS)
    if("${${_v}}" MATCHES "-static-libstdc\\+\\+")
      string(REGEX REPLACE "-static-libstdc\\+\\+" "" ${_v} "${${_v}}")
      message(WARNING "commux: dropped -static-libstdc++ from ${_v}: commux links the shared "
                      "libstdc++, as torch does (a static copy breaks iostreams in the process)")
    endif()
  endforeach()
  separate_arguments(_commux_cxx_flags UNIX_COMMAND "${CMAKE_CXX_FLAGS}")
  foreach(_name libstdc++.so libstdc++.so.6 libstdc++.a)
    execute_process(COMMAND ${CMAKE_CXX_COMPILER} ${_commux_cxx_flags} -print-file-name=${_name}
                    OUTPUT_VARIABLE _path OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    string(MAKE_C_IDENTIFIER "${_name}" _key)
    set(_commux_${_key} "")
    if(IS_ABSOLUTE "${_path}" AND EXISTS "${_path}")
      set(_commux_${_key} "${_path}")
    endif()
  endforeach()
  # Only where this toolchain would link libstdc++ statically: it has the archive, not the .so.
  if(NOT _commux_libstdc___so AND _commux_libstdc___a)
    if(_commux_libstdc___so_6)
      set(COMMUX_LIBSTDCXX "${_commux_libstdc___so_6}")
      message(STATUS "commux: ${CMAKE_CXX_COMPILER} has no libstdc++.so to link against; "
                     "linking ${COMMUX_LIBSTDCXX}")
    else()
      message(FATAL_ERROR "commux: ${CMAKE_CXX_COMPILER} would link libstdc++ statically (it "
                          "finds ${_commux_libstdc___a} but no libstdc++.so or libstdc++.so.6), "
                          "and a static copy breaks commux beside torch; install the compiler's "
                          "libstdc++ development package (e.g. libstdc++-13-dev)")
    endif()
  endif()
endif()
