// The mixtape test executable's main: Catch2's runner (compiled once, tests/catch/) over the
// test cases of tests/*.cpp.
#include "tests/catch/run_session.h"

int main(int argc, char** argv) { return mixtape_tests::run_session(argc, argv); }
