# distributed.mnist: the MNIST trainer under `mpirun -np 2` against one process: the same
# options reach the same accuracy band, rank 0 alone prints and writes, the custom loop and
# a loss-scaled policy train data-parallel, and a batch smaller than the world fails fast.
# Usage: cmake -DAPP=<mpirun> -DMNIST=<mixtape-mnist> -DFAKE=<fake_mnist> -DWORK_DIR=...
#        [-DDATA_DIR=...] -P mnist_mpi.cmake
include(${CMAKE_CURRENT_LIST_DIR}/../apps/smoke_helpers.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
mnist_smoke_data(fake)
set(common --data-dir ${DATA_DIR} --limit 2048 --batch-size 64 --seed 3 --verbose 2 --epochs 2)

function(test_accuracy text out_var)
  string(REGEX MATCH "Test accuracy: ([0-9.]+)" m "${text}")
  if(NOT m)
    message(FATAL_ERROR "no test accuracy in:\n${text}")
  endif()
  set(${out_var} ${CMAKE_MATCH_1} PARENT_SCOPE)
endfunction()

# One process (mpirun is not needed: world size 1).
set(SAVED_APP ${APP})
set(APP ${MNIST})
run_app(0 single ${common} --metrics-out ${WORK_DIR}/single.csv)
test_accuracy("${single}" acc1)
set(APP ${SAVED_APP})

# Two ranks, each on half of every batch of 64.
run_app(0 two -np 2 ${MNIST} ${common} --metrics-out ${WORK_DIR}/two.csv
        --save ${WORK_DIR}/two.safetensors)
test_accuracy("${two}" acc2)
string(REGEX MATCHALL "Test accuracy" printed "${two}")
list(LENGTH printed times)
if(NOT times EQUAL 1)
  message(FATAL_ERROR "the test accuracy was printed ${times} times (rank 0 alone prints)")
endif()
foreach(f two.csv two.safetensors)
  if(NOT EXISTS ${WORK_DIR}/${f})
    message(FATAL_ERROR "rank 0 did not write ${f}")
  endif()
endforeach()
# The same accuracy band: within 2 points of one process (the same global batches and
# initial weights; float32 sums in another order).
# (The trainer prints 4 decimals, "0.9552" or "1.0000" (the fake data): compared as whole
# numbers of 0.0001, leading zeros dropped.)
foreach(which 1 2)
  string(REGEX REPLACE "^([01])\\.([0-9][0-9][0-9][0-9])$" "\\1\\2" a${which} "${acc${which}}")
  string(REGEX REPLACE "^0+([0-9])" "\\1" a${which} "${a${which}}")
  if(NOT a${which} MATCHES "^[0-9]+$")
    message(FATAL_ERROR "cannot read the test accuracy '${acc${which}}'")
  endif()
endforeach()
math(EXPR d "${a1} - ${a2}")
if(d LESS -200 OR d GREATER 200)
  message(FATAL_ERROR "2 ranks reached ${acc2}, one process ${acc1}: not the same band")
endif()
message(STATUS "test accuracy: one process ${acc1}, 2 ranks ${acc2}")

# The custom GradientTape loop with loss scaling, data-parallel.
run_app(0 custom -np 2 ${MNIST} ${common} --epochs 1 --custom-loop --policy mixed_float16)
require("${custom}" "loss_scale")

# A global batch smaller than the world: an error, and the job ends.
run_app(nonzero bad -np 3 ${MNIST} ${common} --batch-size 2)
require("${bad}" "smaller than the 3 ranks")

# Ranks given different options (mpirun's "A : B" form): the job stops with the difference
# named, through fit and through the custom loop (issue: these crashed in malloc or with
# SIGBUS when the collectives trusted every rank's layout). Every rank throws; which of them
# print before MPI_Abort ends the job is a race (require_rank_error).
foreach(loop fit custom)
  set(extra)
  if(loop STREQUAL "custom")
    set(extra --custom-loop)
  endif()
  run_app(nonzero batch_${loop} -np 1 ${MNIST} ${common} ${extra} --epochs 1
          : -np 1 ${MNIST} ${common} ${extra} --epochs 1 --batch-size 32)
  require_rank_error("${batch_${loop}}" "")
  require("${batch_${loop}}" "first at 'batch 64' (rank 0) against 'batch 32' (rank 1)")
  run_app(nonzero limit_${loop} -np 1 ${MNIST} ${common} ${extra} --epochs 1
          : -np 1 ${MNIST} ${common} ${extra} --epochs 1 --limit 1024)
  require_rank_error("${limit_${loop}}" "")
  require("${limit_${loop}}" "first at '2048 training images' (rank 0) against '1024 training")
endforeach()

# Different --seed: rank 0's wins (the weights and every shuffle), in the custom loop too:
# the same losses as two ranks started with rank 0's seed.
run_app(0 seed_same -np 2 ${MNIST} ${common} --epochs 1 --custom-loop --seed 5)
run_app(0 seed_diff -np 1 ${MNIST} ${common} --epochs 1 --custom-loop --seed 5
        : -np 1 ${MNIST} ${common} --epochs 1 --custom-loop --seed 6)
string(REGEX MATCH "loss: [0-9.]+ - accuracy: [0-9.]+ - val_loss: [0-9.]+" same "${seed_same}")
string(REGEX MATCH "loss: [0-9.]+ - accuracy: [0-9.]+ - val_loss: [0-9.]+" diff "${seed_diff}")
if(NOT same OR NOT same STREQUAL diff)
  message(FATAL_ERROR "ranks with seeds 5 and 6 logged '${diff}', ranks with seed 5 '${same}'")
endif()
