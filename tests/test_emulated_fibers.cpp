// The fibers of the host emulation of a GPU's thread blocks (tests/cudaemu/fibers.h): their
// barriers, the orders in which they run between barriers, and the errors they report. The
// orders are what lets the conformance sweep over the emulated CUDA kernels see a race: a
// block whose threads read what another writes without a barrier between gets a result that
// depends on the order, as the racy block below does.
#include <algorithm>
#include <catch2/catch.hpp>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "tests/cudaemu/fibers.h"

using mixtape::cuda_emu::Fibers;

namespace {

constexpr int kCount = 64;

// The order in which the fibers first run.
std::vector<int> first_runs(Fibers::Order order, std::uint64_t seed = 0) {
  Fibers fibers(kCount);
  fibers.set_order(order, seed);
  std::vector<int> seen;
  fibers.run([&](int i) { seen.push_back(i); });
  return seen;
}

// Each fiber writes its slot and reads its neighbour's, with or without a barrier between:
// what each read.
std::vector<int> neighbours(Fibers::Order order, bool barrier) {
  Fibers fibers(kCount);
  fibers.set_order(order, 5);
  Fibers::Barrier met{kCount};
  std::vector<int> slot(kCount, -1), read(kCount, -2);
  fibers.run([&](int i) {
    slot[static_cast<std::size_t>(i)] = i;
    if (barrier) fibers.arrive_and_wait(met);
    read[static_cast<std::size_t>(i)] = slot[static_cast<std::size_t>((i + 1) % kCount)];
  });
  return read;
}

}  // namespace

TEST_CASE("emulated fibers run by index, backwards, or shuffled each round", "[cudaemu]") {
  std::vector<int> forward(kCount);
  std::iota(forward.begin(), forward.end(), 0);
  const std::vector<int> reverse(forward.rbegin(), forward.rend());
  CHECK(first_runs(Fibers::Order::forward) == forward);
  CHECK(first_runs(Fibers::Order::reverse) == reverse);

  const auto shuffled = first_runs(Fibers::Order::shuffled, 11);
  CHECK(shuffled != forward);
  CHECK(shuffled != reverse);
  CHECK(std::is_permutation(shuffled.begin(), shuffled.end(), forward.begin()));
  CHECK(first_runs(Fibers::Order::shuffled, 11) == shuffled);  // the seed decides
  CHECK(first_runs(Fibers::Order::shuffled, 12) != shuffled);

  // A fresh permutation at each round: who arrives first at a barrier is not who leaves it
  // first (the last to arrive goes on at once; the others run in the next round's order).
  Fibers fibers(kCount);
  fibers.set_order(Fibers::Order::shuffled, 11);
  Fibers::Barrier met{kCount};
  std::vector<int> before, after;
  fibers.run([&](int i) {
    before.push_back(i);
    fibers.arrive_and_wait(met);
    after.push_back(i);
  });
  REQUIRE(after.size() == before.size());
  CHECK(after.front() == before.back());
  CHECK(std::vector<int>(after.begin() + 1, after.end()) !=
        std::vector<int>(before.begin(), before.end() - 1));
}

TEST_CASE("a race between emulated fibers shows as a result that depends on the order",
          "[cudaemu]") {
  // Without the barrier, forward order reads the neighbours' slots before they are written
  // (but the last fiber's, slot 0); backwards, after.
  const auto racy_forward = neighbours(Fibers::Order::forward, false);
  const auto racy_reverse = neighbours(Fibers::Order::reverse, false);
  CHECK(racy_forward[0] == -1);
  CHECK(racy_forward[kCount - 1] == 0);
  CHECK(racy_reverse[0] == 1);
  CHECK(racy_forward != racy_reverse);
  CHECK(neighbours(Fibers::Order::shuffled, false) != racy_reverse);

  // With it, every order reads every neighbour's slot.
  std::vector<int> want(kCount);
  for (int i = 0; i < kCount; ++i) want[static_cast<std::size_t>(i)] = (i + 1) % kCount;
  for (const auto order : {Fibers::Order::forward, Fibers::Order::reverse, Fibers::Order::shuffled})
    CHECK(neighbours(order, true) == want);
}

TEST_CASE("emulated fibers report barriers that never complete and rethrow errors", "[cudaemu]") {
  Fibers fibers(4);
  Fibers::Barrier odd{4};  // only two of the four arrive
  CHECK_THROWS_AS(fibers.run([&](int i) {
    if (i % 2) fibers.arrive_and_wait(odd);
  }),
                  std::logic_error);

  Fibers::Barrier met{4};
  CHECK_THROWS_WITH(fibers.run([&](int i) {
    fibers.arrive_and_wait(met);
    if (i == 2) throw std::runtime_error("thread 2 failed");
  }),
                    "thread 2 failed");
  int ran = 0;  // the fibers run again after both
  fibers.run([&](int) { ++ran; });
  CHECK(ran == 4);
}
