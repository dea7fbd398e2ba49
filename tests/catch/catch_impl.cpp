// Catch2's implementation (its runner, reporters, matchers), compiled once for every test
// program of the suite (tests/CMakeLists.txt: mixtape_catch), and the one function of it that
// the programs' mains call (tests/catch/run_session.h). Single-header Catch2 declares its
// Session only where it compiles the implementation (CATCH_CONFIG_RUNNER), which would put
// the whole of it into each main file.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "tests/catch/run_session.h"

namespace mixtape_tests {

int run_session(int argc, char** argv) { return Catch::Session().run(argc, argv); }

}  // namespace mixtape_tests
