# distributed.charlm: the character-level GPT trainer under `mpirun -np 2`: two ranks train
# one model (rank 0 alone prints), ranks started with different seeds take rank 0's, and ranks
# given a different batch, width or text stop together, each naming the first difference.
# Usage: cmake -DAPP=<mpirun> -DCHARLM=<mixtape-charlm> -DWORK_DIR=... -P charlm_mpi.cmake
include(${CMAKE_CURRENT_LIST_DIR}/../apps/smoke_helpers.cmake)  # run_app, require
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

set(text "")
foreach(i RANGE 1 60)
  string(APPEND text "The quick brown fox ${i} jumps over the lazy dog.\nA stitch in time ${i}.\n")
endforeach()
file(WRITE ${WORK_DIR}/small.txt "${text}")
file(WRITE ${WORK_DIR}/other.txt "${text}${text}")
set(tiny --layers 1 --heads 2 --width 16 --context 16 --steps 4 --warmup 2 --log-every 2
    --eval-every 0 --eval-windows 4 --sample 0)

run_app(0 two -np 2 ${CHARLM} --text ${WORK_DIR}/small.txt ${tiny} --batch 8)
require("${two}" "2 ranks")
require("${two}" "bits/char after 4 steps")

# Different seeds: rank 0's wins, the run trains.
run_app(0 seeds -np 1 ${CHARLM} --text ${WORK_DIR}/small.txt ${tiny} --batch 8 --seed 1
        : -np 1 ${CHARLM} --text ${WORK_DIR}/small.txt ${tiny} --batch 8 --seed 2)
require("${seeds}" "bits/char after 4 steps")

# Ranks that disagree: the job stops with an error naming the first difference (every rank
# throws it; which of them print before MPI_Abort ends the job is a race: require_rank_error).
function(disagree name what_0 what_1 first)
  run_app(nonzero out -np 1 ${CHARLM} ${tiny} ${what_0} : -np 1 ${CHARLM} ${tiny} ${what_1})
  require_rank_error("${out}" "the ranks were given different text or options")
  require("${out}" "${first}")
endfunction()
disagree(batch "--text;${WORK_DIR}/small.txt;--batch;8" "--text;${WORK_DIR}/small.txt;--batch;4"
         "first at 'batch 8' (rank 0) against 'batch 4' (rank 1)")
disagree(text "--text;${WORK_DIR}/small.txt;--batch;8" "--text;${WORK_DIR}/other.txt;--batch;8"
         "(rank 1): rank 0 has text of")
disagree(lr "--text;${WORK_DIR}/small.txt;--lr;0.001" "--text;${WORK_DIR}/small.txt;--lr;0.002"
         "first at 'lr 0.001' (rank 0) against 'lr 0.002' (rank 1)")
