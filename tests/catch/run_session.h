// The test programs' entry into Catch2 (tests/catch/catch_impl.cpp, where the implementation
// is compiled once for all of them).
#pragma once

namespace mixtape_tests {

// Catch2's session over the command line: runs the test cases it selects and returns Catch2's
// exit status (0 when every assertion held; otherwise the failed assertions' count, at most
// 255, or non-zero for a command line it refuses).
int run_session(int argc, char** argv);

}  // namespace mixtape_tests
