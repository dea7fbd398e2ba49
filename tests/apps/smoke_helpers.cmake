# Helpers of the apps' smoke tests (mnist_smoke.cmake, charlm_smoke.cmake, simcuda_smoke.cmake,
# emulated_smoke.cmake and tests/distributed/*.cmake), included by them. APP is the program
# under test.

# Runs APP with the arguments; fails the test unless the exit status is `expect` ("0", or
# "nonzero": an exit status other than 0, not a crash). With `run_env` set (NAME=VALUE ...),
# the app runs in that environment. The output (stdout and stderr) goes to out_var.
function(run_app expect out_var)
  set(launcher)
  if(run_env)
    set(launcher ${CMAKE_COMMAND} -E env ${run_env})
  endif()
  get_filename_component(name ${APP} NAME)
  execute_process(COMMAND ${launcher} ${APP} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  message(STATUS "${name} ${ARGN}\n  -> exit ${rc}\n${out}${err}")
  if(expect STREQUAL "0" AND NOT rc EQUAL 0)
    message(FATAL_ERROR "${name} ${ARGN} failed with ${rc}:\n${out}${err}")
  elseif(expect STREQUAL "nonzero" AND (rc EQUAL 0 OR NOT rc MATCHES "^[0-9]+$"))
    message(FATAL_ERROR "${name} ${ARGN} should have failed with an exit status:\n${out}${err}")
  endif()
  set(${out_var} "${out}${err}" PARENT_SCOPE)
endfunction()

# A failed data-parallel run: some rank's error line ("<app>: error on rank N: <what>..."). Every
# rank of such a run throws, but the first to reach MPI_Abort may end the others before they
# print: which ranks' lines appear is a race, so one is required, not all.
function(require_rank_error text what)
  string(FIND "${text}" "error on rank 0: ${what}" at0)
  string(FIND "${text}" "error on rank 1: ${what}" at1)
  if(at0 EQUAL -1 AND at1 EQUAL -1)
    message(FATAL_ERROR "expected 'error on rank 0 or 1: ${what}' in:\n${text}")
  endif()
endfunction()

function(require text what)
  string(FIND "${text}" "${what}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "expected '${what}' in:\n${text}")
  endif()
endfunction()

# A fake MNIST of `train` training and `test` test images that FAKE (fake_mnist) writes in dir.
function(fake_mnist dir train test)
  file(MAKE_DIRECTORY ${dir})
  execute_process(COMMAND ${FAKE} ${dir} ${train} ${test} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "fake_mnist failed (${rc})")
  endif()
endfunction()

# MNIST for a trainer's smoke test: DATA_DIR when it exists, otherwise a small fake dataset
# (2048 training and 512 test images) under WORK_DIR. Sets DATA_DIR, and `fake_var` to TRUE
# or FALSE.
macro(mnist_smoke_data fake_var)
  set(${fake_var} FALSE)
  if(NOT DATA_DIR OR NOT EXISTS "${DATA_DIR}")
    set(DATA_DIR ${WORK_DIR}/data)
    fake_mnist(${DATA_DIR} 2048 512)
    set(${fake_var} TRUE)
  endif()
endmacro()

# The output without what may differ between the devices: log timestamps, timings, rates and
# model FLOP utilisation, the device named in the header lines.
function(comparable text out_var)
  string(REGEX REPLACE "\\[[0-9-]+ [0-9:.]+\\] " "" text "${text}")
  string(REGEX REPLACE "[0-9]+ tokens/s[^\n]*" "" text "${text}")
  string(REGEX REPLACE "\\([0-9.]+ s of steps\\)" "" text "${text}")
  string(REGEX REPLACE " in [0-9.]+ s\n" "\n" text "${text}")  # data loading
  string(REGEX REPLACE " - [0-9.]+m?s - [0-9.]+us/sample" "" text "${text}")
  string(REGEX REPLACE "device (cpu|cuda:0)[^\n]*" "device" text "${text}")
  # What the tensors held depends on the backend's kernels (their temporaries), not the model.
  string(REGEX REPLACE "peak tensor memory [0-9.]+ MiB \\(reserved [0-9.]+ MiB\\)"
                       "peak tensor memory" text "${text}")
  set(${out_var} "${text}" PARENT_SCOPE)
endfunction()
