# CTest onnx.apps: the bundled apps' --export-onnx, checked by independent runtimes. Each
# app trains briefly with --save and --export-onnx; mixtape-onnx-cases then loads the saved
# model, predicts on random inputs, and tests/onnx/check_exports.py runs the app's ONNX file
# on the same inputs (ONNX's checker and strict shape inference, OpenCV's DNN module for the
# float32 MNIST models, where it is required to work, the reference evaluator for all).
#   - mixtape-mnist: the MLP, the CNN and the resnet in float32; the CNN under
#     mixed_bfloat16 and the resnet under mixed_float16;
#   - mixtape-charlm: 2 layers, in float32 and under mixed_bfloat16.
# Exits 77 (skipped) when no Python has onnx.
# cmake -DMNIST=... -DCHARLM=... -DFAKE=... -DCASES=... -DCHECK=... -DWORK_DIR=...
#       [-DDATA_DIR=...] -P this
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/../apps/smoke_helpers.cmake)  # run_app, mnist_smoke_data
include(${CMAKE_CURRENT_LIST_DIR}/find_python.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
mnist_smoke_data(fake)

function(add_case model_file name)
  execute_process(COMMAND ${CASES} model ${model_file} ${name} ${WORK_DIR} ${ARGN}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "mixtape-onnx-cases model ${model_file} ${name} failed (${rc})")
  endif()
endfunction()

set(APP ${MNIST})
foreach(run "mlp;float32" "cnn;float32" "resnet;float32" "cnn;mixed_bfloat16"
            "resnet;mixed_float16")
  list(GET run 0 model)
  list(GET run 1 policy)
  set(name mnist_${model}_${policy})
  run_app(0 out --data-dir ${DATA_DIR} --model ${model} --policy ${policy} --epochs 1
          --limit 512 --verbose 0 --save ${WORK_DIR}/${name}.safetensors
          --export-onnx ${WORK_DIR}/${name}.onnx)
  if(policy STREQUAL "float32")
    add_case(${WORK_DIR}/${name}.safetensors ${name} --opencv)
    list(APPEND opencv_required ${name})
  else()
    add_case(${WORK_DIR}/${name}.safetensors ${name})
  endif()
endforeach()

set(APP ${CHARLM})
set(text "")
foreach(i RANGE 60)
  string(APPEND text "Export ${i}: the graph, the weights, opset 17.\nA runtime reads it ${i} times.\n")
endforeach()
file(WRITE ${WORK_DIR}/text.txt "${text}")
foreach(policy float32 mixed_bfloat16)
  set(name charlm_${policy})
  run_app(0 out --text ${WORK_DIR}/text.txt --layers 2 --heads 2 --width 32 --context 32 --batch 8 --steps 10 --policy
          ${policy} --eval-every 0 --sample 0 --save ${WORK_DIR}/${name}.safetensors
          --export-onnx ${WORK_DIR}/${name}.onnx)
  require("${out}" "ONNX model (opset 17) written to")
  add_case(${WORK_DIR}/${name}.safetensors ${name})
endforeach()

# A directory that does not exist: refused before training, no file left.
set(APP ${MNIST})
run_app(nonzero out --data-dir ${DATA_DIR} --model mlp --epochs 1 --limit 256 --verbose 0
        --export-onnx ${WORK_DIR}/missing/model.onnx)
require("${out}" "--export-onnx: cannot write '${WORK_DIR}/missing/model.onnx': the directory")

if(NOT MIXTAPE_ONNX_PYTHON)
  message("onnx.apps: SKIP: no python3 with the onnx and numpy modules (Debian's "
          "python3-onnx; scripts/deps.sh installs it)")
  cmake_language(EXIT 77)
endif()
execute_process(COMMAND "${MIXTAPE_ONNX_PYTHON}" "${CHECK}" "${WORK_DIR}" --require-opencv
                        ${opencv_required} RESULT_VARIABLE rc)
if(rc EQUAL 77)
  cmake_language(EXIT 77)
elseif(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_exports.py found failures (${rc})")
endif()
