# Checks that every file of the library includes only its own layer and the layers below it
# (docs/building.md, "Targets"): core nothing above core, io (safetensors, atomic files) only
# autograd and core, the backends only core (the CUDA one also distributed's interface for device
# collectives), autograd and distributed only core, dataset (the input pipeline) only
# autograd and core, nn (precision, layers, optim) only autograd, distributed, dataset, io and
# core, onnx (onnx_export/) only nn and below, data (datasets/) only dataset, autograd and
# core. The CMake
# targets enforce the same for what links; this catches a header included across layers.
# CTest: layering.includes (cmake -DSOURCE_DIR=<repository> -P check_layers.cmake).
cmake_minimum_required(VERSION 3.25)
if(NOT SOURCE_DIR)
  message(FATAL_ERROR "check_layers.cmake: -DSOURCE_DIR=<repository> is required")
endif()

# layer: folders (sources and public headers) and the include prefixes they may use.
set(core_dirs core include/mixtape/core)
set(core_allowed core/ mixtape/core/)
set(autograd_dirs autograd include/mixtape/autograd)
set(autograd_allowed ${core_allowed} autograd/ mixtape/autograd/)
set(io_dirs io include/mixtape/io)
set(io_allowed ${autograd_allowed} io/ mixtape/io/)
set(cpu_dirs backends/cpu)
set(cpu_allowed ${core_allowed} backends/cpu/)
set(distributed_dirs distributed include/mixtape/distributed)
set(distributed_allowed ${core_allowed} distributed/ mixtape/distributed/)
set(cuda_dirs backends/cuda)
set(cuda_allowed ${core_allowed} backends/cuda/ mixtape/distributed/device_collectives.h
                 mixtape/distributed/distributed.h)
set(backend_headers_dirs include/mixtape/backends)
set(backend_headers_allowed ${core_allowed})
set(dataset_dirs data include/mixtape/data)
set(dataset_allowed ${autograd_allowed} data/ mixtape/data/)
set(nn_dirs precision layers optim include/mixtape/precision include/mixtape/layers
            include/mixtape/optim)
set(nn_allowed ${dataset_allowed} ${distributed_allowed} ${io_allowed} precision/ layers/ optim/
               mixtape/precision/ mixtape/layers/ mixtape/optim/)
set(onnx_dirs onnx_export include/mixtape/onnx)
set(onnx_allowed ${nn_allowed} onnx_export/ mixtape/onnx/)
set(data_dirs datasets include/mixtape/datasets)
set(data_allowed ${dataset_allowed} datasets/ mixtape/datasets/)

set(violations "")
set(checked 0)
foreach(layer core io autograd distributed cpu cuda backend_headers dataset nn onnx data)
  foreach(dir ${${layer}_dirs})
    file(GLOB files "${SOURCE_DIR}/${dir}/*.cpp" "${SOURCE_DIR}/${dir}/*.h"
                    "${SOURCE_DIR}/${dir}/*.cu" "${SOURCE_DIR}/${dir}/*.cuh")
    foreach(file ${files})
      math(EXPR checked "${checked} + 1")
      file(STRINGS "${file}" includes REGEX "^#include \"")
      foreach(line ${includes})
        string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" header "${line}")
        set(ok FALSE)
        foreach(prefix ${${layer}_allowed})
          string(FIND "${header}" "${prefix}" at)
          if(at EQUAL 0)
            set(ok TRUE)
          endif()
        endforeach()
        if(NOT ok)
          file(RELATIVE_PATH rel "${SOURCE_DIR}" "${file}")
          list(APPEND violations "${rel} (${layer}) includes ${header}")
        endif()
      endforeach()
    endforeach()
  endforeach()
endforeach()

if(checked LESS 50)
  message(FATAL_ERROR "check_layers.cmake: only ${checked} files found under ${SOURCE_DIR}")
endif()
if(violations)
  list(JOIN violations "\n  " text)
  message(FATAL_ERROR "includes across layers:\n  ${text}")
endif()
message(STATUS "check_layers.cmake: ${checked} files include only their layer and those below")
