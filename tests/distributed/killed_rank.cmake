# distributed.killed_rank: the last of 2 ranks dies by SIGKILL after a few steps of
# data-parallel training (the hidden [.kill] case of tests/distributed/test_distributed.cpp)
# while rank 0 waits for it in an all-reduce. The job must end within 30 s, with a non-zero
# exit status and a message naming the rank that died (mpirun's).
# Usage: cmake "-DMPIRUN=mpiexec;-n;2" -DTESTS=<mixtape_distributed_tests> -P killed_rank.cmake
string(TIMESTAMP start "%s")
execute_process(COMMAND ${MPIRUN} ${TESTS} "[.kill]" --warn NoTests
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
string(TIMESTAMP stop "%s")
math(EXPR seconds "${stop} - ${start}")
message(STATUS "exit ${rc} after ${seconds} s:\n${out}${err}")
if(rc EQUAL 0 OR NOT rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "the job should have ended with a non-zero exit status; got '${rc}'")
endif()
if(seconds GREATER 30)
  message(FATAL_ERROR "the job took ${seconds} s to end after a rank died (limit 30 s)")
endif()
string(REGEX MATCH "rank 1 with PID [0-9]+ on node [^ ]+ exited on signal 9" named "${out}${err}")
if(NOT named)
  message(FATAL_ERROR "no message names the rank that died (rank 1, signal 9)")
endif()
