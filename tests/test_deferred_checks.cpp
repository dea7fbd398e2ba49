// Deferred checks (core/raw.h): checks of device results that the host runs later, the
// ready ones at an indexing op, all of them at a read from a device.
#include <catch2/catch.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/raw.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;

TEST_CASE("deferred checks: the ready ones in order, then all, the first error rethrown",
          "[core][deferred]") {
  mt::detail::run_deferred_checks();  // none left by another test
  std::vector<std::string> ran;
  bool second_ready = false;
  mt::detail::defer_check([] { return true; }, [&] { ran.push_back("first"); });
  mt::detail::defer_check([&] { return second_ready; },
                          [&] {
                            ran.push_back("second");
                            throw mt::IndexError("second failed");
                          });
  mt::detail::defer_check([] { return true; },
                          [&] {
                            ran.push_back("third");
                            throw mt::ValueError("third failed");
                          });
  // Only the ready ones run; the first error comes out after all of them ran.
  CHECK_THROWS_AS(mt::detail::run_deferred_checks(/*only_ready=*/true), mt::ValueError);
  CHECK(ran == std::vector<std::string>{"first", "third"});
  // The one not ready stays queued until it is, or until everything is run.
  mt::detail::run_deferred_checks(/*only_ready=*/true);
  CHECK(ran.size() == 2);
  CHECK_THROWS_WITH(mt::detail::run_deferred_checks(), "second failed");
  CHECK(ran == std::vector<std::string>{"first", "third", "second"});
  mt::detail::run_deferred_checks();  // nothing left
  CHECK(ran.size() == 3);
  second_ready = true;
}
