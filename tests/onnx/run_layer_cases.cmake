# CTest onnx.layers: writes the layer cases (mixtape-onnx-cases layers WORK_DIR), then checks
# them with tests/onnx/check_exports.py, and that it fails the control case (a model changed
# after its export). Exits 77 (skipped) when no Python has onnx.
# cmake -DCASES=<mixtape-onnx-cases> -DCHECK=<check_exports.py> -DWORK_DIR=<dir> -P this
cmake_minimum_required(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/find_python.cmake)
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
execute_process(COMMAND "${CASES}" layers "${WORK_DIR}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mixtape-onnx-cases layers failed (${rc})")
endif()
if(NOT MIXTAPE_ONNX_PYTHON)
  message("onnx.layers: SKIP: no python3 with the onnx and numpy modules (Debian's "
          "python3-onnx; scripts/deps.sh installs it)")
  # CTest maps this exit status to a skip (SKIP_RETURN_CODE).
  cmake_language(EXIT 77)
endif()
execute_process(COMMAND "${MIXTAPE_ONNX_PYTHON}" "${CHECK}" "${WORK_DIR}" RESULT_VARIABLE rc)
if(rc EQUAL 77)
  cmake_language(EXIT 77)
elseif(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_exports.py found failures (${rc})")
endif()
# The control case (a model changed after its export) must fail.
execute_process(COMMAND "${MIXTAPE_ONNX_PYTHON}" "${CHECK}" "${WORK_DIR}/control"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "check_exports.py passed a model changed after its export (${rc})")
endif()
