# The smoke test of mixtape-mnist (CTest: apps.mnist): short runs on a subset of MNIST
# (the real files when DATA_DIR exists, otherwise a small fake dataset made by FAKE) that
# check the trainer end to end:
#   - fit with --save, --metrics-out, --plot, --trace-dtypes; the test accuracy line;
#   - --resume continues exactly: epoch 2 after resuming from epoch 1 logs the same loss
#     and accuracy as epoch 2 of the uninterrupted run;
#   - the custom GradientTape loop under mixed_float16 (loss scale in the epoch line);
#   - bad input: a missing data directory, an unknown option, a checkpoint of another
#     model, an unwritable metrics file: a one-line error and a non-zero exit;
#   - the command line (CLI11): --help lists the options with their descriptions; a
#     mistyped option gets a "did you mean" hint; a bad integer, an out-of-range or NaN
#     number and a positional argument are refused with one line naming the flag and value.
# Usage: cmake -DAPP=... -DFAKE=... -DWORK_DIR=... [-DDATA_DIR=...] -P mnist_smoke.cmake
cmake_minimum_required(VERSION 3.25)

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(fake FALSE)
if(NOT DATA_DIR OR NOT EXISTS "${DATA_DIR}")
  set(DATA_DIR ${WORK_DIR}/data)
  file(MAKE_DIRECTORY ${DATA_DIR})
  execute_process(COMMAND ${FAKE} ${DATA_DIR} 2048 512 RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "fake_mnist failed (${rc})")
  endif()
  set(fake TRUE)
endif()
message(STATUS "mnist smoke test: data in ${DATA_DIR} (fake: ${fake})")

# Runs the app; fails the test unless the exit status is `expect` ("0" or "nonzero").
function(run_app expect out_var)
  execute_process(COMMAND ${APP} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  message(STATUS "mixtape-mnist ${ARGN}\n  -> exit ${rc}\n${out}${err}")
  if(expect STREQUAL "0" AND NOT rc EQUAL 0)
    message(FATAL_ERROR "mixtape-mnist ${ARGN} failed with ${rc}:\n${out}${err}")
  elseif(expect STREQUAL "nonzero" AND rc EQUAL 0)
    message(FATAL_ERROR "mixtape-mnist ${ARGN} should have failed:\n${out}${err}")
  endif()
  set(${out_var} "${out}${err}" PARENT_SCOPE)
endfunction()

function(require text what)
  string(FIND "${text}" "${what}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "expected '${what}' in:\n${text}")
  endif()
endfunction()

# A refused command line: one line, "mixtape-mnist: ... (see --help)".
function(require_one_line text)
  string(STRIP "${text}" text)
  string(FIND "${text}" "\n" at)
  if(NOT at EQUAL -1 OR NOT text MATCHES "^mixtape-mnist: .*\\(see --help\\)$")
    message(FATAL_ERROR "expected one line 'mixtape-mnist: ... (see --help)', got:\n${text}")
  endif()
endfunction()

# The metrics of one epoch in a CSV written by --metrics-out, without the timing columns.
function(epoch_metrics csv epoch out_var)
  file(STRINGS ${csv} lines)
  foreach(line ${lines})
    if(line MATCHES "^${epoch},")
      string(REGEX REPLACE ",[^,]*,[^,]*$" "" line "${line}")  # drop seconds, us_per_sample
      set(${out_var} "${line}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "no epoch ${epoch} in ${csv}")
endfunction()

# A constant learning rate: the default cosine schedule spans --epochs, so the 1-epoch run
# below would decay differently from the 2-epoch one.
set(common --data-dir ${DATA_DIR} --limit 2048 --batch-size 64 --seed 3 --verbose 2
    --schedule constant)

# --- fit, checkpoints, metrics, plot ---------------------------------------------------------
run_app(0 out ${common} --epochs 2 --save ${WORK_DIR}/straight.safetensors
        --metrics-out ${WORK_DIR}/straight.csv --plot ${WORK_DIR}/curves.svg --trace-dtypes)
require("${out}" "Epoch 2/2")
require("${out}" "Test accuracy:")
require("${out}" "dense")
foreach(f straight.safetensors straight.csv curves.svg)
  if(NOT EXISTS ${WORK_DIR}/${f})
    message(FATAL_ERROR "${f} was not written")
  endif()
endforeach()
file(READ ${WORK_DIR}/curves.svg svg)
require("${svg}" "<svg")
require("${svg}" "polyline")
file(STRINGS ${WORK_DIR}/straight.csv csv_lines)
list(LENGTH csv_lines n)
if(NOT n EQUAL 3)
  message(FATAL_ERROR "straight.csv has ${n} lines, expected a header and 2 epochs")
endif()
string(REGEX MATCH "Test accuracy: ([0-9.]+)" _ "${out}")
if(fake AND CMAKE_MATCH_1 LESS 0.9)
  message(FATAL_ERROR "test accuracy ${CMAKE_MATCH_1} on the fake data (expected > 0.9)")
endif()

# --- resume: epoch 2 after a restart equals epoch 2 of the straight run ------------------------
run_app(0 out ${common} --epochs 1 --save ${WORK_DIR}/half.safetensors)
run_app(0 out ${common} --epochs 2 --resume ${WORK_DIR}/half.safetensors
        --metrics-out ${WORK_DIR}/resumed.csv)
require("${out}" "Resumed from")
epoch_metrics(${WORK_DIR}/straight.csv 2 straight)
epoch_metrics(${WORK_DIR}/resumed.csv 2 resumed)
if(NOT straight STREQUAL resumed)
  message(FATAL_ERROR "resumed epoch 2 differs:\n  straight: ${straight}\n  resumed:  ${resumed}")
endif()

# --- the custom loop under mixed_float16 ----------------------------------------------------------
run_app(0 out ${common} --epochs 1 --custom-loop --policy mixed_float16 --limit 1024)
require("${out}" "loss_scale")
require("${out}" "Test accuracy:")

# --- bad input ---------------------------------------------------------------------------------
run_app(nonzero out --data-dir ${WORK_DIR}/no-such-dir --epochs 1)
require("${out}" "no-such-dir")
run_app(nonzero out --epochs 1 --no-such-option)
require("${out}" "unknown option")
run_app(nonzero out ${common} --epochs 1 --model cnn --resume ${WORK_DIR}/half.safetensors)
require("${out}" "half.safetensors")
run_app(nonzero out ${common} --epochs 1 --metrics-out ${WORK_DIR}/no-such-dir/m.csv)
require("${out}" "m.csv")
run_app(nonzero out --policy mixed_float8)
require("${out}" "mixed_float16")

# --- the command line ----------------------------------------------------------------------------
# The runs that must be refused name a missing data directory, so that a check that let them
# through would fail quickly (and with another message) instead of training.
set(nodata --data-dir ${WORK_DIR}/no-such-dir)
run_app(0 out --help)
require("${out}" "Usage: mixtape-mnist [OPTIONS]")
foreach(line "--model NAME" "--policy NAME" "--device NAME" "--epochs N" "epochs to train (default 5)"
        "--batch-size N" "default 128 (8192 for --model guide)" "--learning-rate X"
        "--schedule NAME" "cosine (default: decays to 0 over the run) or constant" "--seed N"
        "--data-dir DIR" "--dataset NAME" "--custom-loop" "--save PATH" "--resume PATH"
        "--metrics-out PATH" "--plot PATH" "--validation-split X" "--limit N" "--units N"
        "--trace-dtypes" "--verbose N" "0 quiet, 1 progress bar (default), 2 one line per epoch"
        "--help" "takes its last value")
  require("${out}" "${line}")
endforeach()
run_app(nonzero out ${nodata} --epoch 1)
require_one_line("${out}")
require("${out}" "unknown option '--epoch'; did you mean --epochs?")
run_app(nonzero out ${nodata} --learning_rate 0.01)
require("${out}" "did you mean --learning-rate?")
run_app(nonzero out ${nodata} --batch-size 3x)
require_one_line("${out}")
require("${out}" "--batch-size")
require("${out}" "'3x'")
run_app(nonzero out ${nodata} --epochs -1)
require_one_line("${out}")
require("${out}" "--epochs: needs an integer >= 0; got '-1'")
run_app(nonzero out ${nodata} --epochs 0x10)
require("${out}" "'0x10'")
run_app(nonzero out ${nodata} --learning-rate 11)
require_one_line("${out}")
require("${out}" "--learning-rate")
require("${out}" "'11'")
run_app(nonzero out ${nodata} --validation-split nan)
require_one_line("${out}")
require("${out}" "--validation-split")
require("${out}" "'nan'")
run_app(nonzero out ${nodata} --model resnet)
require_one_line("${out}")
require("${out}" "unknown model 'resnet'")
run_app(nonzero out ${nodata} --plot curves.png)
require("${out}" "curves.png")
run_app(nonzero out ${nodata} --epochs 1 extra)
require_one_line("${out}")
require("${out}" "unexpected argument 'extra'")
message(STATUS "mnist smoke test passed")
