# The trainers on the CUDA backend's own kernels without a GPU (CTest: apps.emulated). CHARLM
# and MNIST are the apps linked with the host emulation of the backend's kernels (tests/cudaemu:
# backends/cuda/*.cu compiled as host C++, over the simulated GPU of tests/simcuda). Each
# configuration runs with --device cpu and with --device cuda; the second must say it trained
# on cuda:0 and print the same lines as the first, with each number within a tolerance of the
# CPU's: the kernels sum in other orders and round in other places than the CPU's (the
# conformance sweep bounds each one; this is their sum over a training run), so a whole
# training step on the GPU's kernels is checked: the tiled attention with dropout, LayerNorm,
# the fused linear op, the fused cross-entropy, the multi-tensor AdamW, the loss scale kept on
# the device, FP8 casts and products, step capture, the datasets' copies to the device, the
# matmuls through gemm.cpp on the emulated cuBLASLt; not cuDNN, nor the libraries' own
# arithmetic. The CPU run must train (its loss falls),
# so that what is compared is not a model at rest.
# Usage: cmake -DCHARLM=... -DMNIST=... -DFAKE=... -DWORK_DIR=... -P emulated_smoke.cmake
cmake_minimum_required(VERSION 3.25)

include(${CMAKE_CURRENT_LIST_DIR}/smoke_helpers.cmake)  # run_app, require, comparable, fake_mnist
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

# A decimal number as an integer count of millionths (CMake's arithmetic is integer).
function(micro number out_var)
  if(NOT number MATCHES "^(-?)([0-9]+)(\\.([0-9]*))?$")
    message(FATAL_ERROR "not a decimal number: ${number}")
  endif()
  set(sign "${CMAKE_MATCH_1}")
  set(whole "${CMAKE_MATCH_2}")
  string(SUBSTRING "${CMAKE_MATCH_4}000000" 0 6 fraction)
  string(REGEX REPLACE "^0+([0-9])" "\\1" whole "${whole}")
  string(REGEX REPLACE "^0+([0-9])" "\\1" fraction "${fraction}")
  math(EXPR value "${sign}(${whole} * 1000000 + ${fraction})")
  set(${out_var} ${value} PARENT_SCOPE)
endfunction()

# Fails unless `gpu` is `cpu` with every number within rtol_permille / 1000 of the larger
# magnitude plus one unit of the last printed digit (0.0001) of the CPU's; accuracies within
# 0.01 (just over one image of the MNIST runs' 128 test images).
function(require_close cpu gpu rtol_permille)
  set(number "(accuracy: )?-?[0-9]+(\\.[0-9]+)?")
  string(REGEX REPLACE "${number}" "#" cpu_shape "${cpu}")
  string(REGEX REPLACE "${number}" "#" gpu_shape "${gpu}")
  string(REGEX MATCHALL "${number}" cpu_numbers "${cpu}")
  string(REGEX MATCHALL "${number}" gpu_numbers "${gpu}")
  set(failure "")
  if(NOT cpu_shape STREQUAL gpu_shape)
    set(failure "the lines differ; ")
  else()
    foreach(c g IN ZIP_LISTS cpu_numbers gpu_numbers)
      set(atol 100)
      if(c MATCHES "^accuracy: ")
        set(atol 10000)
      endif()
      string(REGEX REPLACE "^accuracy: " "" c "${c}")
      string(REGEX REPLACE "^accuracy: " "" g "${g}")
      micro(${c} a)
      micro(${g} b)
      string(REGEX REPLACE "^-" "" abs_a "${a}")
      string(REGEX REPLACE "^-" "" abs_b "${b}")
      math(EXPR diff "${a} - ${b}")
      string(REGEX REPLACE "^-" "" diff "${diff}")
      set(larger ${abs_a})
      if(abs_b GREATER abs_a)
        set(larger ${abs_b})
      endif()
      math(EXPR bound "${larger} * ${rtol_permille} / 1000 + ${atol}")
      if(diff GREATER bound)
        string(APPEND failure "${g} where the CPU printed ${c}; ")
      endif()
    endforeach()
  endif()
  if(failure)
    file(WRITE ${WORK_DIR}/cpu.txt "${cpu}")
    file(WRITE ${WORK_DIR}/cuda.txt "${gpu}")
    message(FATAL_ERROR "${ARGN}: --device cuda (emulated kernels) printed otherwise than "
                        "--device cpu: ${failure}(the comparable parts in ${WORK_DIR}/cpu.txt and "
                        "cuda.txt)")
  endif()
endfunction()

# Runs APP with the arguments on both devices and compares (require_close); `falling` is the
# text before the loss values whose first and last in the CPU's output show the training.
function(close_on_both rtol_permille falling)
  run_app(0 on_cpu --device cpu ${ARGN})
  run_app(0 on_gpu --device cuda ${ARGN})
  require("${on_gpu}" "cuda:0")
  comparable("${on_cpu}" cpu_text)
  comparable("${on_gpu}" gpu_text)
  string(REGEX MATCHALL "${falling}[0-9.]+" losses "${cpu_text}")
  list(LENGTH losses count)
  if(count LESS 2)
    message(FATAL_ERROR "${ARGN}: fewer than two '${falling}' values in:\n${on_cpu}")
  endif()
  list(GET losses 0 first)
  list(GET losses -1 last)
  string(REGEX REPLACE ".*[^0-9.]" "" first "${first}")
  string(REGEX REPLACE ".*[^0-9.]" "" last "${last}")
  micro(${first} first)
  micro(${last} last)
  if(NOT last LESS first)
    message(FATAL_ERROR "${ARGN}: the CPU run did not train ('${falling}' ${first} -> ${last})")
  endif()
  require_close("${cpu_text}" "${gpu_text}" ${rtol_permille} ${ARGN})
endfunction()

# Measured when this was written: the losses of the 16-bit runs below within 0.012% of the
# CPU's, the FP8 run's within 0.1%; the bounds are 0.1% and 0.5%. A mask of the tiled
# attention's dropout one row off in the forward pass moves a loss by 0.33%, and fails.
# The character-level GPT: head widths 64 and 32 (the tiled tensor-core attention kernels),
# attention dropout, float16 with the loss scale and a captured step, FP8 products (whose
# quantisation turns the kernels' small differences into larger ones: fewer steps), float32
# (the tiled float32 attention kernels, with dropout).
set(text "")
foreach(i RANGE 1 60)
  string(APPEND text "The quick brown fox ${i} jumps over the lazy dog.\n"
                     "A stitch in time saves nine; ${i} cats.\n")
endforeach()
file(WRITE ${WORK_DIR}/small.txt "${text}")
set(APP ${CHARLM})
set(gpt --text ${WORK_DIR}/small.txt --layers 2 --width 64 --context 64 --batch 4 --lr 3e-3
    --warmup 5 --clip 1.0 --log-every 5 --eval-every 10 --eval-windows 4 --sample 0)
close_on_both(1 "loss " ${gpt} --heads 1 --dropout 0.1 --policy mixed_bfloat16 --steps 30)
close_on_both(1 "loss " ${gpt} --heads 2 --policy mixed_float16 --capture-step --steps 30)
close_on_both(5 "loss " ${gpt} --heads 2 --policy mixed_float8 --steps 10)
close_on_both(1 "loss " ${gpt} --heads 2 --dropout 0.1 --policy float32 --steps 20)

# The MNIST trainer on a small fake dataset: fit (batches copied to the device by a prefetch
# thread), the custom GradientTape loop, the CNN (convolution and pooling) with a captured
# step, FP8. Accuracies move in steps of one image (1/128 of the test set).
set(DATA_DIR ${WORK_DIR}/data)
fake_mnist(${DATA_DIR} 512 128)
set(APP ${MNIST})
set(small --data-dir ${DATA_DIR} --epochs 2 --verbose 2)
close_on_both(1 "loss: " ${small} --model mlp --policy mixed_float16)
close_on_both(1 "loss: " ${small} --model mlp --policy mixed_float16 --custom-loop)
close_on_both(1 "loss: " --data-dir ${DATA_DIR} --epochs 1 --limit 256 --verbose 2
              --model cnn --policy mixed_bfloat16 --capture-step --augment shift)
close_on_both(1 "loss: " ${small} --model mlp --policy mixed_float8)
