# The trainers' GPU paths on a simulated GPU (CTest: apps.simcuda). CHARLM and MNIST are the
# apps linked with tests/simcuda/sim_cuda_backend.cpp (host memory, the CPU's kernels, for the
# CUDA device type) instead of the CUDA backend. Each configuration runs twice, with
# --device cpu and with --device cuda; the second must say it trained on cuda:0 and print what
# the first prints, the timings and the device's name aside: the same losses, validation,
# accuracies, loss scales and samples. So every GPU branch of the apps and of the library they
# take (the device-side loss scale and its flags read late, checks kept on the device, the
# datasets' copies and prefetch to the device, FP8 products, captured steps) computes what the
# CPU path computes, and none mixes a CPU tensor into a GPU computation (that is an error on
# the simulated GPU as on a real one). With MPIEXEC (CTest: distributed.simcuda), the MNIST
# trainer data-parallel on 2 ranks instead, each on a simulated GPU of its own (the
# DistributedOptimizer on GPU tensors, which no machine of this project with one GPU runs).
# Usage: cmake -DCHARLM=... -DMNIST=... -DFAKE=... -DWORK_DIR=... [-DDATA_DIR=...]
#        [-DMPIEXEC=...] -P simcuda_smoke.cmake
cmake_minimum_required(VERSION 3.25)

include(${CMAKE_CURRENT_LIST_DIR}/smoke_helpers.cmake)  # run_app, require, comparable, ...
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
mnist_smoke_data(fake)

# Runs APP (after `launch`, the program under mpiexec) with the arguments on both devices and
# compares.
function(same_on_both what)
  run_app(0 on_cpu ${launch} --device cpu ${ARGN})
  run_app(0 on_gpu ${launch} --device cuda ${ARGN})
  require("${on_gpu}" "${what}")
  require("${on_gpu}" "cuda:0")
  comparable("${on_cpu}" cpu_text)
  comparable("${on_gpu}" gpu_text)
  if(NOT cpu_text STREQUAL gpu_text)
    file(WRITE ${WORK_DIR}/cpu.txt "${cpu_text}")
    file(WRITE ${WORK_DIR}/cuda.txt "${gpu_text}")
    message(FATAL_ERROR "${ARGN}: --device cuda (simulated) printed otherwise than --device "
                        "cpu (the comparable parts in ${WORK_DIR}/cpu.txt and cuda.txt)")
  endif()
endfunction()

if(MPIEXEC)
  set(APP ${MPIEXEC})
  set(launch -np 2 ${MNIST})
  same_on_both("2 ranks" --data-dir ${DATA_DIR} --limit 1024 --epochs 1 --verbose 2 --model mlp
               --policy mixed_float16)
  return()
endif()
set(launch)

# The character-level GPT: a tiny model on a small text, every policy, captured and not.
set(text "")
foreach(i RANGE 1 60)
  string(APPEND text "The quick brown fox ${i} jumps over the lazy dog.\nA stitch in time saves nine; ${i} cats.\n")
endforeach()
file(WRITE ${WORK_DIR}/small.txt "${text}")
set(APP ${CHARLM})
set(tiny --text ${WORK_DIR}/small.txt --layers 2 --heads 2 --width 32 --context 16 --batch 8
    --steps 8 --log-every 4 --eval-every 4 --eval-windows 4 --sample 24)
same_on_both("loss scale" ${tiny} --policy mixed_float16)
same_on_both("loss scale" ${tiny} --policy mixed_float16 --capture-step)
same_on_both("validation loss" ${tiny} --policy mixed_bfloat16)
same_on_both("validation loss" ${tiny} --policy float32 --capture-step)
same_on_both("validation loss" ${tiny} --policy mixed_float8_delayed)
# A steady-state step on the GPU queues its work and waits for none of it: the census step
# reads no device value back (the loss, the loss scale's and the finiteness checks' flags and
# the clipping norm stay on the device or are read a step late), under every policy, captured
# or not.
foreach(policy float32 mixed_bfloat16 mixed_float16 mixed_float8)
  foreach(capture "" --capture-step)
    run_app(0 out --device cuda ${tiny} --policy ${policy} ${capture} --kernel-census)
    require("${out}" "host reads of device values             0\n")
  endforeach()
endforeach()

# The MNIST trainer: fit (its batches copied to the device by a prefetch thread there), the
# custom GradientTape loop, a captured step with augmentation, FP8.
set(APP ${MNIST})
set(small --data-dir ${DATA_DIR} --limit 1024 --epochs 1 --verbose 2)
same_on_both("Test accuracy" ${small} --model mlp --policy mixed_float16)
same_on_both("Test accuracy" ${small} --model mlp --policy mixed_float16 --custom-loop)
same_on_both("Test accuracy" ${small} --model cnn --policy mixed_bfloat16 --capture-step
             --augment shift)
same_on_both("Test accuracy" ${small} --model mlp --policy mixed_float8 --trace-dtypes)
