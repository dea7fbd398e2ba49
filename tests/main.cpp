// Catch2's main for the mixtape test executable.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
