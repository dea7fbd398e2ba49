// error_of<E>(f): the message of the exception of type E that f throws; the test fails when f
// throws nothing of that type.
#pragma once

#include <catch2/catch.hpp>
#include <string>

namespace mixtape_test {

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("no exception of the expected type was thrown");
  return {};
}

}  // namespace mixtape_test
