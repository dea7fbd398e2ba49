# Checks that every docs/examples/<name>.cpp is quoted whole, byte for byte, in some
# docs/*.md file, so that the documentation shows the code the test suite compiles and
# runs. Usage: cmake -DDOCS_DIR=<repo>/docs -P check_doc_examples.cmake
file(GLOB examples ${DOCS_DIR}/examples/*.cpp)
file(GLOB pages ${DOCS_DIR}/*.md)
set(all_pages "")
foreach(page ${pages})
  file(READ ${page} text)
  string(APPEND all_pages "${text}")
endforeach()
set(missing "")
foreach(example ${examples})
  file(READ ${example} code)
  string(FIND "${all_pages}" "```cpp\n${code}```" at)
  if(at EQUAL -1)
    get_filename_component(name ${example} NAME)
    list(APPEND missing ${name})
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "docs/examples not quoted verbatim (in a ```cpp block) by any docs/*.md "
                      "(python3 scripts/sync_doc_examples.py copies them in): "
                      "${missing}")
endif()
list(LENGTH examples n)
message(STATUS "docs.examples: ${n} examples quoted verbatim")
