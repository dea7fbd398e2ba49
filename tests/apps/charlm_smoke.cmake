# The smoke test of mixtape-charlm (CTest: apps.charlm): a tiny model for a few steps on a
# small text written here, checking the app end to end:
#   - training prints the loss, the tokens per second, the validation loss in bits per
#     character and a sample; --save writes a model file;
#   - mixed_float16 runs with its loss scale; --resume continues at the saved step;
#   - --kernel-census prints the kernels of a step;
#   - bad input, each a one-line error and a non-zero exit that leaves the saved file as it
#     was: a missing file, an empty file, a binary file, a one-character vocabulary, a text
#     shorter than the context, a checkpoint of another width, context or policy, an option out of
#     range.
# Usage: cmake -DAPP=... -DWORK_DIR=... -P charlm_smoke.cmake
cmake_minimum_required(VERSION 3.25)

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

include(${CMAKE_CURRENT_LIST_DIR}/smoke_helpers.cmake)  # run_app, require

# A small text: a few sentences repeated with variations (about 6 KB).
set(text "")
foreach(i RANGE 1 60)
  string(APPEND text "The quick brown fox ${i} jumps over the lazy dog.\nA stitch in time saves nine; ${i} cats.\n")
endforeach()
file(WRITE ${WORK_DIR}/small.txt "${text}")
set(tiny_common --text ${WORK_DIR}/small.txt --layers 1 --heads 2 --batch 4 --warmup 5
    --log-every 10 --eval-every 10 --eval-windows 4 --temperature 0.9 --top-k 5)
set(tiny ${tiny_common} --width 16 --context 16)

run_app(0 out ${tiny} --steps 20 --sample 40 --save ${WORK_DIR}/model.safetensors)
require("${out}" "vocabulary")
require("${out}" "step     20  loss")
require("${out}" "step     10  validation")
require("${out}" "tokens/s")
require("${out}" "; device ")
require("${out}" "validation loss")
require("${out}" "bits/char after 20 steps")
require("${out}" "sample (temperature 0.9, top-k 5):")
if(NOT EXISTS ${WORK_DIR}/model.safetensors)
  message(FATAL_ERROR "--save wrote no file")
endif()
file(SHA256 ${WORK_DIR}/model.safetensors saved_hash)

run_app(0 out ${tiny} --steps 12 --sample 0 --policy mixed_float16)
require("${out}" "loss scale")
require("${out}" "skipped steps")
run_app(0 out ${tiny} --steps 20 --sample 0 --policy mixed_bfloat16)
# The device asked for; the model FLOP utilisation against a peak given.
run_app(0 out ${tiny} --steps 4 --sample 5 --device cpu --peak-tflops 0.001)
require("${out}" "; device cpu (MFU against 0.001 TFLOP/s)")
require("${out}" "tokens/s  MFU ")
# --kernel-census: the second step's kernels, per op (AdamW's one update call per dtype).
run_app(0 out ${tiny} --steps 3 --sample 0 --kernel-census)
require("${out}" "kernels dispatched by step 2 (")
require("${out}" "adam_update                             1")
require("${out}" "total ")

run_app(0 out ${tiny} --steps 30 --sample 0 --resume ${WORK_DIR}/model.safetensors)
require("${out}" "resumed from")
require("${out}" "at step 20")
require("${out}" "bits/char after 30 steps")

# Bad input: one line, non-zero, the saved model untouched.
set(save_again --save ${WORK_DIR}/model.safetensors --steps 5 --sample 0)
run_app(nonzero out --text ${WORK_DIR}/missing.txt ${save_again})
require("${out}" "cannot open")
file(WRITE ${WORK_DIR}/empty.txt "")
run_app(nonzero out --text ${WORK_DIR}/empty.txt ${save_again})
require("${out}" "is empty")
run_app(nonzero out --text ${APP} ${save_again})
require("${out}" "is not a text file")
string(REPEAT "a" 500 aaa)
file(WRITE ${WORK_DIR}/one.txt "${aaa}")
run_app(nonzero out --text ${WORK_DIR}/one.txt ${save_again})
require("${out}" "vocabulary of one character")
file(WRITE ${WORK_DIR}/short.txt "abcdefghijklmnopqrstuvwxyz")
run_app(nonzero out --text ${WORK_DIR}/short.txt --context 16 ${save_again})
require("${out}" "too short")
run_app(nonzero out ${tiny_common} --width 32 --context 16 --resume ${WORK_DIR}/model.safetensors ${save_again})
require("${out}" "width 16")
run_app(nonzero out ${tiny_common} --width 16 --context 32 --resume ${WORK_DIR}/model.safetensors ${save_again})
require("${out}" "context 16")
run_app(nonzero out ${tiny} --policy mixed_bfloat16 --resume ${WORK_DIR}/model.safetensors ${save_again})
require("${out}" "policy float32")
run_app(nonzero out ${tiny_common} --width 17 ${save_again})
require("${out}" "not a multiple of --heads")
# Without a GPU, or built without the CUDA backend: either way an error naming the device.
run_app(nonzero out ${tiny} --device cuda:99 ${save_again})
require("${out}" "cuda:99")
run_app(nonzero out ${tiny} --device tpu ${save_again})
require("${out}" "unknown device 'tpu'")
run_app(nonzero out --preset gpt2-small --width 16 ${save_again})
require("${out}" "16 contradicts --preset gpt2-small, which has --width 768")
run_app(nonzero out --preset gpt3 ${save_again})
require("${out}" "unknown preset 'gpt3'")
run_app(nonzero out ${tiny} --steps 0)
require("${out}" "--steps")
# Numbers that are none, files that are not regular files, text that is not UTF-8 (a full
# decoder: overlong forms, surrogates, code points above U+10FFFF), a step that is no step.
foreach(option --clip --temperature --lr --dropout)
  run_app(nonzero out ${tiny} ${option} nan ${save_again})
  require("${out}" "${option}: needs a number in")
endforeach()
run_app(nonzero out ${tiny} --clip inf ${save_again})
require("${out}" "--clip: needs a number in")
run_app(nonzero out --text ${WORK_DIR} ${save_again})
require("${out}" "it is a directory, not a regular file")
if(EXISTS /dev/zero)
  run_app(nonzero out --text /dev/zero ${save_again})
  require("${out}" "it is a character device, not a regular file")
endif()
find_program(MKFIFO mkfifo)
if(MKFIFO)
  execute_process(COMMAND ${MKFIFO} ${WORK_DIR}/pipe.txt)
  # A FIFO without a writer: refused at once (a timeout fails the test instead of a hang).
  execute_process(COMMAND ${APP} --text ${WORK_DIR}/pipe.txt ${save_again} TIMEOUT 60
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT rc MATCHES "^[0-9]+$")
    message(FATAL_ERROR "--text FIFO: exit ${rc} (a hang ends in a timeout):\n${out}${err}")
  endif()
  require("${out}${err}" "it is a FIFO (named pipe), not a regular file")
endif()
string(ASCII 192 175 overlong)
string(ASCII 237 160 128 surrogate)
string(ASCII 245 128 128 128 too_high)
string(ASCII 244 144 128 128 above_max)
foreach(bad overlong surrogate too_high above_max)
  file(WRITE ${WORK_DIR}/${bad}.txt "${aaa} text ${${bad}} more text ${aaa}")
  run_app(nonzero out --text ${WORK_DIR}/${bad}.txt ${save_again})
  require("${out}" "does not start a valid UTF-8 character")
endforeach()
find_program(PYTHON3 python3)
if(PYTHON3)
  # A checkpoint whose step is -5, or not a number (the header rewritten in place).
  foreach(step "-5" "xx")
    execute_process(
      COMMAND ${PYTHON3} -c "import sys; b = open(sys.argv[1], 'rb').read(); b = b.replace(b'\"step\":\"20\"', b'\"step\":\"' + sys.argv[3].encode() + b'\"', 1); open(sys.argv[2], 'wb').write(b)"
              ${WORK_DIR}/model.safetensors ${WORK_DIR}/bad_step.safetensors ${step}
      RESULT_VARIABLE rc)
    run_app(nonzero out ${tiny} --steps 30 --sample 0 --resume ${WORK_DIR}/bad_step.safetensors)
    require("${out}" "its 'step' is \"${step}\", not a whole number >= 0")
  endforeach()
endif()

file(SHA256 ${WORK_DIR}/model.safetensors after_hash)
if(NOT saved_hash STREQUAL after_hash)
  message(FATAL_ERROR "a failed run changed the saved model file")
endif()
message(STATUS "charlm smoke test passed")
