# Sets MIXTAPE_ONNX_PYTHON to a Python 3 that imports onnx and numpy (Debian's python3-onnx
# installs them for /usr/bin/python3; a python3 earlier on PATH may lack them), or to ""
# when there is none.
set(MIXTAPE_ONNX_PYTHON "")
find_program(_path_python3 python3)
foreach(candidate ${_path_python3} /usr/bin/python3)
  if(candidate AND EXISTS "${candidate}" AND NOT MIXTAPE_ONNX_PYTHON)
    execute_process(COMMAND "${candidate}" -c "import onnx, numpy"
                    RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
    if(rc EQUAL 0)
      set(MIXTAPE_ONNX_PYTHON "${candidate}")
    endif()
  endif()
endforeach()
