# Checks that every __shared__ variable of the CUDA backend (backends/cuda) is marked, on the
# line after its declaration, with shared_starts_undefined(<its name>) (backends/cuda/launch.cuh):
# unmarked, the host emulation (tests/cudaemu) would start each block with the previous
# block's values where a GPU has garbage, and the emulated sweep would not see a kernel that
# reads what its block did not write.
# CTest: cudaemu.shared_declarations (cmake -DSOURCE_DIR=<repository> -P check_shared.cmake).
cmake_minimum_required(VERSION 3.25)
if(NOT SOURCE_DIR)
  message(FATAL_ERROR "check_shared.cmake: -DSOURCE_DIR=<repository> is required")
endif()

file(GLOB files "${SOURCE_DIR}/backends/cuda/*.cu" "${SOURCE_DIR}/backends/cuda/*.cuh"
                "${SOURCE_DIR}/backends/cuda/*.h" "${SOURCE_DIR}/backends/cuda/*.cpp")
set(violations "")
set(declarations 0)
foreach(file ${files})
  # The file's lines as a CMake list: its own ';', '[' and ']' (which would split or join list
  # items) stand as '<s>', '<l>' and '<r>' while it is read.
  file(READ "${file}" text)
  string(REPLACE ";" "<s>" text "${text}")
  string(REPLACE "[" "<l>" text "${text}")
  string(REPLACE "]" "<r>" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  list(LENGTH lines count)
  set(index 0)
  foreach(line IN LISTS lines)
    math(EXPR index "${index} + 1")
    # A declaration: __shared__ first on its line (not in a comment), then a type and a name.
    if(line MATCHES "^[ \t]*__shared__[ \t]" AND NOT line MATCHES "^[ \t]*extern")
      math(EXPR declarations "${declarations} + 1")
      file(RELATIVE_PATH where "${SOURCE_DIR}" "${file}")
      if(NOT line MATCHES "([A-Za-z_][A-Za-z0-9_]*)[ \t]*(<l>.*)?<s>")
        string(APPEND violations "\n  ${where}:${index}: cannot read the name of: ${line}")
        continue()
      endif()
      set(name "${CMAKE_MATCH_1}")
      set(next "")
      if(index LESS count)
        list(GET lines ${index} next)  # the line after (list indices start at 0)
      endif()
      if(NOT next MATCHES "^[ \t]*shared_starts_undefined\\(${name}\\)<s>")
        string(APPEND violations
               "\n  ${where}:${index}: __shared__ ${name} is not followed by "
               "shared_starts_undefined(${name});")
      endif()
    endif()
  endforeach()
endforeach()

if(declarations EQUAL 0)
  message(FATAL_ERROR "check_shared.cmake: no __shared__ declaration found under "
                      "${SOURCE_DIR}/backends/cuda (is SOURCE_DIR the repository?)")
endif()
if(violations)
  string(REPLACE "<s>" ";" violations "${violations}")
  string(REPLACE "<l>" "[" violations "${violations}")
  string(REPLACE "<r>" "]" violations "${violations}")
  message(FATAL_ERROR "__shared__ variables the emulation would not refill:${violations}")
endif()
message(STATUS "${declarations} __shared__ declarations, each marked")
