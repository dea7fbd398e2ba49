// The API sweep: tables of bad inputs and the error each must raise (its type and words of
// its message). Each tests/test_sweep_*.cpp file holds the rows of one part of the library
// and runs them with run_sweep(); together they are the bad-input sweep of the public API.
//
//   run_sweep({
//       expect<mt::ShapeError>("zeros: element count overflows",
//                              [] { mt::zeros({1LL << 31, 1LL << 31}); },
//                              {"zeros", "[2147483648, 2147483648]", "overflow"}),
//       ...
//   });
//
// A row passes when its call throws an exception of the expected type (or a type derived
// from it) whose message holds every word, on one line (see multiline()). A call that returns, or
// throws anything that is not a mixtape::Error, fails the row; the row's name says which.
#pragma once

#include <catch2/catch.hpp>
#include <exception>
#include <functional>
#include <string>
#include <typeinfo>
#include <vector>

#include "mixtape/core/error.h"

namespace sweep {

struct Case {
  std::string name;
  std::function<void()> call;
  std::string expected_type;                      // for messages
  std::function<bool(const mixtape::Error&)> is;  // true when the error has that type
  std::vector<std::string> words;                 // each must be in the message
  bool one_line = true;  // false for the errors that list several places (dataset fetches)
};

template <typename E>
Case expect(std::string name, std::function<void()> call, std::vector<std::string> words) {
  return Case{std::move(name), std::move(call), typeid(E).name(),
              [](const mixtape::Error& e) { return dynamic_cast<const E*>(&e) != nullptr; },
              std::move(words)};
}

// The same row, for an error whose message is several lines by design.
inline Case multiline(Case c) {
  c.one_line = false;
  return c;
}

inline void run_sweep(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    INFO("sweep case: " << c.name);
    std::string message;
    bool typed = false;
    try {
      c.call();
      FAIL_CHECK("no exception (expected " << c.expected_type << ")");
      continue;
    } catch (const mixtape::Error& e) {
      message = e.what();
      typed = c.is(e);
      if (!typed) FAIL_CHECK("wrong error type " << typeid(e).name() << ": " << message);
    } catch (const std::exception& e) {
      FAIL_CHECK("not a mixtape::Error: " << typeid(e).name() << ": " << e.what());
      continue;
    } catch (...) {
      FAIL_CHECK("a non-standard exception");
      continue;
    }
    INFO("message: " << message);
    if (c.one_line) CHECK(message.find('\n') == std::string::npos);
    for (const std::string& w : c.words) CHECK(message.find(w) != std::string::npos);
  }
}

}  // namespace sweep
