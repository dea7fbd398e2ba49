# Helpers of the apps' smoke tests (mnist_smoke.cmake, charlm_smoke.cmake), included by
# both. APP is the program under test.

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

function(require text what)
  string(FIND "${text}" "${what}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "expected '${what}' in:\n${text}")
  endif()
endfunction()
