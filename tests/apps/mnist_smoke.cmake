# The smoke test of mixtape-mnist (CTest: apps.mnist): short runs on a subset of MNIST
# (the real files when DATA_DIR exists, otherwise a small fake dataset made by FAKE) that
# check the trainer end to end:
#   - fit with --save, --metrics-out, --plot, --trace-dtypes; the test accuracy line;
#   - --resume continues exactly: epoch 2 after resuming from epoch 1 logs the same loss
#     and accuracy as epoch 2 of the uninterrupted run;
#   - the custom GradientTape loop under mixed_float16 (loss scale in the epoch line);
#   - bad input: a missing data directory, an unknown option, a checkpoint of another
#     model, an unwritable metrics file: a one-line error and a non-zero exit;
#   - checked before training (no model summary, no epoch line): --save, --plot and
#     --metrics-out into a missing directory or onto a directory, a missing --resume file, a
#     label outside 0..9, a data dir file that is a dangling link (while the cache holds the
#     files), a --validation-split that leaves no training image; a failed run leaves no
#     metrics file;
#   - the resnet's default epochs: 15 on Fashion-MNIST, 5 on MNIST;
#   - the command line (CLI11): --help lists the options with their descriptions; a
#     mistyped option gets a "did you mean" hint; a bad integer, an out-of-range or NaN
#     number and a positional argument are refused with one line naming the flag and value.
# Usage: cmake -DAPP=... -DFAKE=... -DWORK_DIR=... [-DDATA_DIR=...] -P mnist_smoke.cmake
cmake_minimum_required(VERSION 3.25)

include(${CMAKE_CURRENT_LIST_DIR}/smoke_helpers.cmake)  # run_app, require, mnist_smoke_data
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
mnist_smoke_data(fake)
message(STATUS "mnist smoke test: data in ${DATA_DIR} (fake: ${fake})")

# A run refused before training: nothing of the model or an epoch was printed.
function(require_before_training text)
  foreach(word "Total params" "Epoch 1/" "Test accuracy")
    string(FIND "${text}" "${word}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "expected a failure before training, but the output has '${word}':\n${text}")
    endif()
  endforeach()
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

# --- the saved file is a whole model: load_model reads it without the trainer's code ----------
execute_process(COMMAND ${LOAD_MODEL} ${WORK_DIR}/straight.safetensors RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "load_model example on straight.safetensors -> exit ${rc}\n${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "load_model could not read the trainer's file:\n${out}${err}")
endif()
require("${out}" "669,706")  # the mlp's parameters

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

# --- the residual network (a functional graph with Add and BatchNormalization) ----------------
run_app(0 out ${common} --epochs 1 --model resnet --policy mixed_bfloat16 --limit 512)
require("${out}" "Connected to")
require("${out}" "(Add)")
require("${out}" "(RandomTranslation)")  # --augment auto: shift on MNIST
require("${out}" "Test accuracy:")
# Augmentation on another model, mirrors too; and none.
run_app(0 out ${common} --epochs 1 --model cnn --augment shift+flip --limit 512)
require("${out}" "(RandomFlip)")
run_app(0 out ${common} --epochs 1 --model resnet --augment none --limit 256)
if(out MATCHES "RandomTranslation")
  message(FATAL_ERROR "--augment none still built a RandomTranslation layer:\n${out}")
endif()

# Without --epochs the resnet trains 15 epochs on Fashion-MNIST (what it needs for 92.5%), 5
# on MNIST. Fashion-MNIST from a small fake dataset (the loader refuses MNIST's own files
# as Fashion-MNIST's, and a new machine has no Fashion-MNIST).
execute_process(COMMAND ${FAKE} ${WORK_DIR}/fake-fashion 256 64 RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "fake_mnist failed (${rc})")
endif()
run_app(0 out --data-dir ${WORK_DIR}/fake-fashion --dataset fashion --model resnet
        --augment none --limit 64 --batch-size 64 --verbose 2)
require("${out}" "Epoch 15/15")
run_app(0 out --data-dir ${DATA_DIR} --model resnet --augment none --limit 64 --batch-size 64
        --verbose 2)
require("${out}" "Epoch 5/5")

# --- bad input ---------------------------------------------------------------------------------
run_app(nonzero out --data-dir ${WORK_DIR}/no-such-dir --epochs 1)
require("${out}" "no-such-dir")
run_app(nonzero out --epochs 1 --no-such-option)
require("${out}" "unknown option")
run_app(nonzero out ${common} --epochs 1 --model cnn --resume ${WORK_DIR}/half.safetensors)
require("${out}" "half.safetensors")
run_app(nonzero out ${common} --epochs 1 --metrics-out ${WORK_DIR}/no-such-dir/m.csv)
require("${out}" "m.csv")
run_app(nonzero out --policy mixed_float4)
require("${out}" "mixed_float16")

# --- checked before training ---------------------------------------------------------------------
# Outputs that cannot be written: a missing directory, a directory in the file's place.
foreach(flag --save --plot --metrics-out)
  set(name out.csv)
  if(flag STREQUAL "--plot")
    set(name curves.svg)
  endif()
  run_app(nonzero out ${common} --epochs 1 ${flag} ${WORK_DIR}/no-such-dir/${name})
  require("${out}" "mixtape-mnist: error: ${flag}: cannot write '${WORK_DIR}/no-such-dir/${name}'")
  require("${out}" "the directory '${WORK_DIR}/no-such-dir' does not exist")
  require_before_training("${out}")
endforeach()
file(MAKE_DIRECTORY ${WORK_DIR}/a-dir.svg)
foreach(flag --save --plot --metrics-out)
  run_app(nonzero out ${common} --epochs 1 ${flag} ${WORK_DIR}/a-dir.svg)
  require("${out}" "${flag}: cannot write '${WORK_DIR}/a-dir.svg': it is a directory")
  require_before_training("${out}")
endforeach()
run_app(nonzero out ${common} --epochs 1 --resume ${WORK_DIR}/no-such.safetensors)
require("${out}" "--resume: cannot read '${WORK_DIR}/no-such.safetensors'")
require_before_training("${out}")
# A run that fails leaves no metrics file (nor an emptied one) behind.
file(WRITE ${WORK_DIR}/kept.csv "from an earlier run\n")
run_app(nonzero out --data-dir ${WORK_DIR}/no-such-dir --epochs 1 --metrics-out ${WORK_DIR}/new.csv)
run_app(nonzero out --data-dir ${WORK_DIR}/no-such-dir --epochs 1 --metrics-out ${WORK_DIR}/kept.csv)
if(EXISTS ${WORK_DIR}/new.csv)
  message(FATAL_ERROR "a failed run left the metrics file new.csv behind")
endif()
file(READ ${WORK_DIR}/kept.csv kept)
require("${kept}" "from an earlier run")
# A --validation-split that leaves no training image.
run_app(nonzero out ${common} --epochs 1 --limit 1 --validation-split 0.5)
require("${out}" "--validation-split 0.5 of 1 training image leaves none to train on")
require_before_training("${out}")

# A label outside 0..9 (fake data with label 12 at index 100 of the training labels): refused
# when loaded, naming the file and the position.
execute_process(COMMAND ${FAKE} ${WORK_DIR}/bad-labels 256 64 100 12 RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "fake_mnist (bad labels) failed (${rc})")
endif()
run_app(nonzero out --data-dir ${WORK_DIR}/bad-labels --epochs 1 --verbose 2)
require("${out}" "${WORK_DIR}/bad-labels/train-labels-idx1-ubyte.gz: label 12 at index 100")
require_before_training("${out}")

# A data dir file that is a dangling symbolic link is an error, even when the cache holds a
# good copy (which it must not fall back to).
execute_process(COMMAND ${FAKE} ${WORK_DIR}/cache/mnist 256 64 RESULT_VARIABLE rc)
execute_process(COMMAND ${FAKE} ${WORK_DIR}/dangling 256 64 RESULT_VARIABLE rc2)
if(NOT rc EQUAL 0 OR NOT rc2 EQUAL 0)
  message(FATAL_ERROR "fake_mnist (cache, dangling) failed (${rc}, ${rc2})")
endif()
file(REMOVE ${WORK_DIR}/dangling/train-images-idx3-ubyte.gz)
file(CREATE_LINK ${WORK_DIR}/no-such-file ${WORK_DIR}/dangling/train-images-idx3-ubyte.gz
     SYMBOLIC)
set(run_env --unset=MIXTAPE_DATA_DIR MIXTAPE_CACHE_DIR=${WORK_DIR}/cache)
run_app(nonzero out --data-dir ${WORK_DIR}/dangling --epochs 1 --verbose 2)
require("${out}" "${WORK_DIR}/dangling/train-images-idx3-ubyte.gz: is a dangling symbolic link")
require_before_training("${out}")
run_app(0 out --epochs 1 --verbose 2 --batch-size 64)  # the cache itself is fine
require("${out}" "Test accuracy")
unset(run_env)

# --- the command line ----------------------------------------------------------------------------
# The runs that must be refused name a missing data directory, so that a check that let them
# through would fail quickly (and with another message) instead of training.
set(nodata --data-dir ${WORK_DIR}/no-such-dir)
run_app(0 out --help)
require("${out}" "Usage: mixtape-mnist [OPTIONS]")
foreach(line "--model NAME" "--policy NAME" "--device NAME" "--epochs N" "epochs to train (default 5; 15 for the resnet on Fashion-MNIST)"
        "--batch-size N" "default 128 (8192 for --model guide)" "--learning-rate X"
        "--schedule NAME" "cosine (default: decays to 0 over the run) or constant" "--augment NAME" "--seed N"
        "--data-dir DIR" "--dataset NAME" "--custom-loop" "--save PATH" "--resume PATH"
        "--metrics-out PATH" "--plot PATH" "--validation-split X" "--limit N" "--units N"
        "--trace-dtypes" "--verbose N" "0 quiet, 1 progress bar (default), 2 one line per epoch"
        "--help" "takes its last value")
  require("${out}" "${line}")
endforeach()
run_app(nonzero out ${nodata} --augment rotate)
require("${out}" "augment")
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
run_app(nonzero out ${nodata} --epochs 4294967296)
require_one_line("${out}")
require("${out}" "--epochs: needs an integer <= 2147483647; got '4294967296'")
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
run_app(nonzero out ${nodata} --model vgg)
require_one_line("${out}")
require("${out}" "unknown model 'vgg'")
run_app(nonzero out ${nodata} --plot curves.png)
require("${out}" "curves.png")
run_app(nonzero out ${nodata} --epochs 1 extra)
require_one_line("${out}")
require("${out}" "unexpected argument 'extra'")
message(STATUS "mnist smoke test passed")
