# Steps of CTest's install tests (tests/CMakeLists.txt):
#
#   cmake -DMODE=install -DBUILD_TREE=<mixtape build> -DPREFIX=<dir> [-DBUILD_TYPE=...]
#         -P run_consumer.cmake
#     installs the build tree into a fresh PREFIX (cmake --install);
#
#   cmake -DMODE=package|subdirectory -DSOURCE_DIR=<tests/consumer> -DBINARY_DIR=<dir>
#         [-DPREFIX=<install prefix>] [-DMIXTAPE_SOURCE_DIR=<repo>] [-DBUILD_TYPE=Release]
#         [-DGENERATOR=...] [-DMAKE_PROGRAM=...] [-DCXX_COMPILER=...]
#         [-DCUDA_TOOLKIT_ROOT=...] -P run_consumer.cmake
#
#     configures, builds and runs the consumer project (this folder):
# package:       find_package(mixtape) from PREFIX; a fresh build every run.
# subdirectory:  add_subdirectory(MIXTAPE_SOURCE_DIR) with CUDA, tests, benchmarks and apps
#                off, compiled at -O0 as a unity build; the build folder is kept, so a
#                re-run only rebuilds what changed.
cmake_minimum_required(VERSION 3.25)

function(require)
  foreach(var ${ARGN})
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
      message(FATAL_ERROR "run_consumer.cmake (${MODE}): -D${var}=... is required")
    endif()
  endforeach()
endfunction()

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "run_consumer.cmake (${MODE}): ${what} failed (${rc})")
  endif()
endfunction()

require(MODE)
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

if(MODE STREQUAL "install")
  require(BUILD_TREE PREFIX)
  file(REMOVE_RECURSE "${PREFIX}")
  run_step(install "${CMAKE_COMMAND}" --install "${BUILD_TREE}" --prefix "${PREFIX}"
           --config "${BUILD_TYPE}")
  return()
endif()

require(SOURCE_DIR BINARY_DIR)

set(configure_args -S "${SOURCE_DIR}" -B "${BINARY_DIR}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
                   "-DMIXTAPE_CONSUMER_MODE=${MODE}")
if(GENERATOR)
  list(APPEND configure_args -G "${GENERATOR}")
endif()
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CUDA_TOOLKIT_ROOT)
  list(APPEND configure_args "-DCUDAToolkit_ROOT=${CUDA_TOOLKIT_ROOT}")
endif()

if(MODE STREQUAL "package")
  require(PREFIX)
  if(NOT EXISTS "${PREFIX}")
    message(FATAL_ERROR "run_consumer.cmake: ${PREFIX} does not exist (was install run?)")
  endif()
  file(REMOVE_RECURSE "${BINARY_DIR}")
  # Only the install prefix: the build tree's package registry is not consulted.
  list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${PREFIX}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
elseif(MODE STREQUAL "subdirectory")
  if(MIXTAPE_SOURCE_DIR)
    list(APPEND configure_args "-DMIXTAPE_SOURCE_DIR=${MIXTAPE_SOURCE_DIR}")
  endif()
  list(APPEND configure_args -DMIXTAPE_CUDA=OFF -DMIXTAPE_BUILD_TESTS=OFF
       -DMIXTAPE_BUILD_BENCHMARKS=OFF -DMIXTAPE_BUILD_APPS=OFF)
  # The library compiled without optimisation: this mode checks that add_subdirectory()
  # configures, builds and links it, which the optimiser does not change, and a second
  # optimised build of the whole library was the suite's longest test (the optimised build is
  # the main one). The consumer's few small ops run as well at -O0.
  string(TOUPPER "${BUILD_TYPE}" config)
  list(APPEND configure_args "-DCMAKE_CXX_FLAGS_${config}=-O0")
  # And as a unity build, each library's sources joined into one file (batch size 0), so that
  # the headers are parsed once a library: about 100 s of CPU time against 265 file by file
  # (2 cores, -O0), and a check that the sources stay joinable, as a user's project that sets
  # CMAKE_UNITY_BUILD needs: no two files of a library may define one name in an anonymous
  # namespace (joined whole, any batches a project sets are joinable too).
  list(APPEND configure_args -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=0)
else()
  message(FATAL_ERROR
          "run_consumer.cmake: MODE must be install, package or subdirectory, not '${MODE}'")
endif()

cmake_host_system_information(RESULT jobs QUERY NUMBER_OF_LOGICAL_CORES)
message(STATUS "consumer (${MODE}): configure")
run_step(configure "${CMAKE_COMMAND}" ${configure_args})
message(STATUS "consumer (${MODE}): build")
run_step(build "${CMAKE_COMMAND}" --build "${BINARY_DIR}" --config "${BUILD_TYPE}" --parallel ${jobs})

# Single-config generators put the program in BINARY_DIR, multi-config ones below it.
set(program "")
foreach(candidate "${BINARY_DIR}/mixtape-consumer" "${BINARY_DIR}/${BUILD_TYPE}/mixtape-consumer"
                  "${BINARY_DIR}/mixtape-consumer.exe" "${BINARY_DIR}/${BUILD_TYPE}/mixtape-consumer.exe")
  if(EXISTS "${candidate}")
    set(program "${candidate}")
    break()
  endif()
endforeach()
if(NOT program)
  message(FATAL_ERROR "run_consumer.cmake (${MODE}): mixtape-consumer was not built")
endif()
# A CPU program links no CUDA library (the CUDA backend is mixtape::cuda, which it does not
# link).
if(CMAKE_HOST_SYSTEM_NAME STREQUAL "Linux")
  execute_process(COMMAND ldd "${program}" OUTPUT_VARIABLE libraries RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND libraries MATCHES "lib(cudart|cublas|cublasLt|cudnn)[^ ]*")
    message(FATAL_ERROR "run_consumer.cmake (${MODE}): the CPU program links ${CMAKE_MATCH_0}")
  endif()
  file(SIZE "${program}" bytes)
  math(EXPR mib "${bytes} / 1048576")
  message(STATUS "consumer (${MODE}): ${program}: ${mib} MiB, no CUDA library")
endif()
message(STATUS "consumer (${MODE}): run ${program}")
run_step(run "${program}")
