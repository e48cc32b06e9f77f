# Installs difftrain into a scratch prefix, then configures, builds and runs a tiny consumer
# project that only does `find_package(difftrain)` + `target_link_libraries(app difftrain::difftrain)`.
# Then moves the installed package elsewhere and does it again with no Torch_DIR: the package finds
# this machine's LibTorch through DIFFTRAIN_PYTHON's torch, not the path it was installed with.
file(REMOVE_RECURSE ${WORK_DIR})
# The consumer's builds go through the compiler cache as the project's do (the settings travel in
# the environment: the consumer project itself knows nothing of them). Paths are made relative to
# the checkout, so the next clone's run hits the cache.
if(CCACHE)
  set(ENV{CMAKE_CXX_COMPILER_LAUNCHER} ${CCACHE})
  set(ENV{CCACHE_BASEDIR} ${SOURCE_DIR})
  set(ENV{CCACHE_SLOPPINESS} pch_defines,time_macros,include_file_mtime,include_file_ctime)
endif()
set(prefix ${WORK_DIR}/prefix)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (${rc}):\n${out}")
  endif()
  message(STATUS "${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run_step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# Every public header is installed, byte for byte.
file(GLOB_RECURSE headers RELATIVE ${SOURCE_DIR}/include ${SOURCE_DIR}/include/difftrain/*.hpp)
foreach(h IN LISTS headers)
  if(NOT EXISTS ${prefix}/include/${h})
    message(FATAL_ERROR "consumer test: ${h} is missing from the installed prefix")
  endif()
  file(SHA256 ${SOURCE_DIR}/include/${h} want)
  file(SHA256 ${prefix}/include/${h} got)
  if(NOT want STREQUAL got)
    message(FATAL_ERROR "consumer test: the installed ${h} differs from the source's")
  endif()
endforeach()
list(LENGTH headers count)
message(STATUS "${count} headers installed")
run_step("configure consumer" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build
         -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
         -DCMAKE_PREFIX_PATH=${prefix} -DTorch_DIR=${Torch_DIR})
run_step("build consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run_step("run consumer" ${WORK_DIR}/build/consumer)
if(NOT last_output MATCHES "consumer ok")
  message(FATAL_ERROR "consumer test: unexpected output:\n${last_output}")
endif()

file(RENAME ${prefix} ${WORK_DIR}/moved)
run_step("configure consumer of the moved package" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer
         -B ${WORK_DIR}/build-moved -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
         -DCMAKE_PREFIX_PATH=${WORK_DIR}/moved -DDIFFTRAIN_PYTHON=${PYTHON} -DPRECOMPILED=OFF)
run_step("build consumer of the moved package" ${CMAKE_COMMAND} --build ${WORK_DIR}/build-moved)
run_step("run consumer of the moved package" ${WORK_DIR}/build-moved/consumer)
if(NOT last_output MATCHES "consumer ok")
  message(FATAL_ERROR "consumer test (moved package): unexpected output:\n${last_output}")
endif()
file(GLOB_RECURSE config ${WORK_DIR}/moved/*difftrainConfig.cmake)
file(READ ${config} text)
string(FIND "${text}" "${Torch_DIR}" baked)
if(NOT baked EQUAL -1)
  message(FATAL_ERROR "consumer test: the installed config names the installing machine's Torch")
endif()
