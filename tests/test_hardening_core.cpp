// Hardening of core (issue 18, items 1, 2, 3, 4 and 14): overflow-checked element counts
// and byte sizes wherever a shape is made, bounds-checked views, allocation failures as
// mixtape errors, the default generator shared by threads, and stale temporaries of atomic
// saves.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <latch>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "mixtape/mixtape.h"

// The allocation-failure tests ask for more memory than any machine has. AddressSanitizer
// aborts on such a request unless it may return null (which is what the library handles).
#if defined(__SANITIZE_ADDRESS__)
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
#endif

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

constexpr std::int64_t p2(int e) { return std::int64_t{1} << e; }

// The message of the mixtape::Error that `fn` throws ("" when it throws none; a non-mixtape
// exception fails the test).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const mt::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("not a mixtape::Error: " << typeid(e).name() << ": " << e.what());
  }
  return "";
}

}  // namespace

// --- Item 1: element counts and byte sizes overflow ------------------------------------------

TEST_CASE("hardening: factories refuse shapes whose size overflows", "[hardening][shape]") {
  // The cases of the issue: SIGFPE, a tensor that segfaults when read, numel() == 0.
  CHECK_THROWS_AS(mt::zeros({p2(31), p2(31)}), mt::ShapeError);
  CHECK_THROWS_WITH(mt::zeros({p2(31), p2(31)}), Contains("zeros") &&
                                                     Contains("[2147483648, 2147483648]") &&
                                                     Contains("overflow"));
  CHECK_THROWS_AS(mt::zeros({p2(40), p2(30)}), mt::ShapeError);
  CHECK_THROWS_WITH(mt::zeros({p2(40), p2(30)}), Contains("[1099511627776, 1073741824]"));
  CHECK_THROWS_AS(mt::uniform({p2(33), p2(31)}), mt::ShapeError);
  CHECK_THROWS_WITH(mt::uniform({p2(33), p2(31)}), Contains("uniform"));
  CHECK_THROWS_AS(mt::normal({p2(33), p2(31)}), mt::ShapeError);
  CHECK_THROWS_AS(mt::from_vector(std::vector<float>{}, {p2(62), 4}), mt::ShapeError);
  CHECK_THROWS_WITH(mt::from_vector(std::vector<float>{}, {p2(62), 4}),
                    Contains("from_vector") && Contains("[4611686018427387904, 4]"));
  CHECK_THROWS_AS(mt::ones({p2(21), p2(21), p2(21)}), mt::ShapeError);
  CHECK_THROWS_AS(mt::full({p2(62), 2}, 1.0, mt::kUInt8), mt::ShapeError);
  CHECK_THROWS_AS(mt::Tensor::empty({p2(32), p2(32)}, mt::kFloat32), mt::ShapeError);
  // The count fits in int64 but the bytes do not.
  CHECK_THROWS_AS(mt::zeros({p2(62)}, mt::kFloat32), mt::ShapeError);
  CHECK_THROWS_WITH(mt::zeros({p2(61)}, mt::kInt64),
                    Contains("zeros") && Contains("int64") && Contains("bytes"));
  // A zero extent makes an empty tensor, however large the other extents.
  const mt::Tensor empty = mt::zeros({0, p2(40)});
  CHECK(empty.numel() == 0);
  CHECK(empty.to_vector<float>().empty());
  CHECK(mt::from_vector(std::vector<float>{}, {p2(48), 0}).numel() == 0);
  // Negative extents are refused (-1 only means "infer" to reshape).
  CHECK_THROWS_AS(mt::zeros({-1}), mt::ShapeError);
  CHECK_THROWS_WITH(mt::zeros({2, -1}), Contains("zeros") && Contains("[2, -1]"));
  CHECK_THROWS_AS(mt::Shape({3, -2}), mt::ShapeError);
}

TEST_CASE("hardening: Shape::numel is overflow-checked", "[hardening][shape]") {
  CHECK_THROWS_AS(mt::Shape({p2(32), p2(32)}).numel(), mt::ShapeError);
  CHECK_THROWS_WITH(mt::Shape({p2(32), p2(32)}).numel(), Contains("[4294967296, 4294967296]"));
  CHECK(mt::Shape({p2(31), p2(31)}).numel() == p2(62));
  CHECK(mt::Shape({0, p2(62), 1}).numel() == 0);
  // Empty, but its contiguous strides (2^63) would not fit: refused like the others.
  CHECK_THROWS_AS(mt::Shape({0, p2(62), 2}).numel(), mt::ShapeError);
  CHECK(mt::Shape({}).numel() == 1);
}

TEST_CASE("hardening: reshape refuses shapes whose size overflows", "[hardening][shape]") {
  const mt::Tensor z = mt::zeros({0});
  // The issue's case: 2^64 elements wrapped to 0 and matched the empty tensor.
  CHECK_THROWS_AS(z.reshape({p2(32), p2(32)}), mt::ShapeError);
  CHECK_THROWS_WITH(z.reshape({p2(32), p2(32)}),
                    Contains("reshape") && Contains("[4294967296, 4294967296]"));
  CHECK_THROWS_AS(z.reshape({p2(32), p2(32), -1}), mt::ShapeError);
  CHECK_THROWS_AS(mt::zeros({4}).reshape({p2(62), p2(2), -1}), mt::ShapeError);
  // Still fine.
  CHECK(z.reshape({0, p2(40)}).shape() == mt::Shape{0, p2(40)});
  CHECK(mt::zeros({2, 6}).reshape({-1, 3}).shape() == mt::Shape{4, 3});
}

TEST_CASE("hardening: views and broadcasts refuse shapes whose size overflows",
          "[hardening][shape]") {
  const mt::Tensor one = mt::zeros({1});
  CHECK_THROWS_AS(one.expand({p2(40), p2(30)}), mt::ShapeError);
  CHECK_THROWS_WITH(one.expand({p2(40), p2(30)}),
                    Contains("expand") && Contains("[1099511627776, 1073741824]"));
  // A broadcast view of 2^31 elements is fine (no memory); the broadcast of two of them
  // has 2^62 elements, 2^64 bytes as float32.
  const mt::Tensor a = mt::zeros({1, 1}).expand({p2(31), 1});
  const mt::Tensor b = mt::zeros({1, 1}).expand({1, p2(31)});
  CHECK(a.numel() == p2(31));
  CHECK_THROWS_AS(mt::add(a, b), mt::ShapeError);
  CHECK_THROWS_WITH(mt::add(a, b), Contains("[2147483648, 2147483648]"));
  CHECK_THROWS_AS(mt::broadcast_shapes({p2(40), 1}, {1, p2(30)}, "t"), mt::ShapeError);
  CHECK_THROWS_WITH(mt::broadcast_shapes({p2(40), 1}, {1, p2(30)}, "myop"), Contains("myop"));
  // slice with a huge step: one element, no overflow in the length or the stride.
  const mt::Tensor s =
      mt::arange(std::int64_t{10}).slice(0, 3, 10, std::numeric_limits<std::int64_t>::max());
  CHECK(s.shape() == mt::Shape{1});
  CHECK(s.item<std::int64_t>() == 3);
}

TEST_CASE("hardening: windows and strides of any size give TensorFlow's extents, no overflow",
          "[hardening][shape]") {
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  const mt::Tensor x = mt::arange(std::int64_t{25}).reshape({1, 5, 5, 1}).to(mt::kFloat32);
  // 'same': ceil(5 / stride) = 1 window (5 + stride - 1 overflowed: 0 windows), at the start.
  CHECK(mt::window_output_extent(5, 2, big, mt::Padding::Same) == 1);
  CHECK(mt::window_output_extent(0, 2, big, mt::Padding::Same) == 0);
  CHECK(mt::window_output_extent(5, 2, big, mt::Padding::Valid) == 1);
  const mt::Tensor y = mt::max_pool2d(x, {2, 2}, {big, big}, mt::Padding::Same);
  CHECK(y.shape() == mt::Shape{1, 1, 1, 1});
  CHECK(y.item<float>() == 6.0f);  // the window over rows 0-1, columns 0-1
  const mt::Tensor w = mt::ones({3, 3, 1, 1});
  // (rows and columns 0-2: 'same' pads nothing where one window fits inside)
  CHECK(mt::conv2d(x, w, {big, big}, mt::Padding::Same).item<float>() ==
        0 + 1 + 2 + 5 + 6 + 7 + 10 + 11 + 12);
  // The padding 'same' adds: none past what the windows need; a window of about 2^63 cannot
  // be padded for (the padded extent would not fit an index).
  CHECK(mt::window_padding(5, 3, 2, mt::Padding::Same).before == 1);
  CHECK(mt::window_padding(5, 3, 2, mt::Padding::Same).after == 1);
  CHECK(mt::window_padding(4, 3, 2, mt::Padding::Same).before == 0);
  CHECK(mt::window_padding(4, 3, 2, mt::Padding::Same).after == 1);
  CHECK(mt::window_padding(5, 2, big, mt::Padding::Same).after == 0);
  CHECK(mt::window_padding(5, p2(40), 1, mt::Padding::Same).after == p2(39));
  CHECK_THAT(error_of([&] {
               mt::max_pool2d(x, {big, big}, {1, 1}, mt::Padding::Same);
             }),
             Contains("max_pool2d") && Contains("9223372036854775807") && Contains("'same'"));
  CHECK(mt::avg_pool2d(x, {p2(40), p2(40)}, {1, 1}, mt::Padding::Same).shape() ==
        mt::Shape{1, 5, 5, 1});
  // Windows that do not overlap (stride >= window) of 2^40 x 2^40 taps: the backward pass's
  // choice of kernel must not form kh * kw (2^80; UndefinedBehaviorSanitizer stops on it).
  mt::Variable xv(x, "x");
  mt::GradientTape tape;
  const mt::Tensor m = mt::max_pool2d(xv, {p2(40), p2(40)}, {p2(40), p2(40)}, mt::Padding::Same);
  CHECK(m.item<float>() == 24.0f);
  const std::vector<float> gx = tape.gradient(mt::sum(m), xv).to_vector<float>();
  CHECK(gx[24] == 1.0f);
  CHECK(std::count(gx.begin(), gx.end(), 0.0f) == 24);
}

TEST_CASE("hardening: safetensors refuses shapes whose size overflows", "[hardening][shape]") {
  const fs::path dir = fs::temp_directory_path() /
                       fmt::format("mixtape-hardening-st-{}", static_cast<long>(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "big.safetensors").string();
  // [0, 2^40, 2^40] has no elements, but its strides (2^80) do not fit in int64.
  std::string header =
      R"({"x":{"dtype":"F32","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  {
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header.size() >> (8 * i)) & 0xFF));
    out << header;
  }
  CHECK_THROWS_AS(mt::load_safetensors(path), mt::IOError);
  CHECK_THROWS_WITH(mt::load_safetensors(path), Contains("big.safetensors") &&
                                                    Contains("[0, 1099511627776, 1099511627776]") &&
                                                    Contains("overflow"));
  fs::remove_all(dir);
}

// --- Item 2: Tensor::view_of checks its geometry against the storage ---------------------------

TEST_CASE("hardening: view_of stays inside the storage", "[hardening][view]") {
  const mt::Tensor base = mt::arange(std::int64_t{4});
  // Out of bounds: the issue's cases, and their neighbours.
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {100}, {1}, 0), mt::IndexError);
  CHECK_THROWS_WITH(mt::Tensor::view_of(base, {100}, {1}, 0),
                    Contains("view_of") && Contains("[100]") && Contains("4 elements"));
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {2}, {1}, -1), mt::IndexError);
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {2}, {1}, 3), mt::IndexError);
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {2, 2}, {2, 2}, 0), mt::IndexError);
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {0}, {1}, 5), mt::IndexError);
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {2}, {p2(62)}, 0), mt::IndexError);
  // Strides whose furthest element overflows int64.
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {3, 3}, {p2(62), p2(62)}, 0), mt::Error);
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {3}, {std::numeric_limits<std::int64_t>::max()}, 1),
                  mt::Error);
  // Malformed geometry.
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {2, 2}, {1}, 0), mt::ShapeError);
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {2}, {-1}, 3), mt::ShapeError);
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {-1}, {1}, 0), mt::ShapeError);
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {p2(32), p2(32)}, {0, 0}, 0), mt::ShapeError);
  CHECK_THROWS_AS(mt::Tensor::view_of(mt::Tensor(), {1}, {1}, 0), mt::Error);

  // Inside: the last element, broadcasts (stride 0), overlapping strides, empty views.
  CHECK(mt::Tensor::view_of(base, {1}, {1}, 3).item<std::int64_t>() == 3);
  CHECK(mt::Tensor::view_of(base, {2, 2}, {1, 2}, 0).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{0, 2, 1, 3});
  CHECK(mt::Tensor::view_of(base, {3, 4}, {0, 1}, 0).to_vector<std::int64_t>().size() == 12);
  CHECK(mt::Tensor::view_of(base, {3, 2}, {1, 1}, 0).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{0, 1, 1, 2, 2, 3});
  CHECK_THROWS_AS(mt::Tensor::view_of(base, {3, 2}, {1, 1}, 1), mt::IndexError);
  CHECK(mt::Tensor::view_of(base, {0}, {1}, 4).numel() == 0);
  CHECK(mt::Tensor::view_of(base, {0, 5}, {p2(62), 1}, 0).numel() == 0);
  CHECK(mt::Tensor::view_of(base, {}, {}, 2).item<std::int64_t>() == 2);
  CHECK(mt::Tensor::view_of(base, {1}, {p2(62)}, 0).item<std::int64_t>() == 0);
  // A view of a view: the offset counts from the start of the storage.
  const mt::Tensor tail = base.slice(0, 2, 4);
  CHECK(mt::Tensor::view_of(tail, {4}, {1}, 0).to_vector<std::int64_t>().size() == 4);
  CHECK_THROWS_AS(mt::Tensor::view_of(tail, {3}, {1}, tail.offset()), mt::IndexError);
}

// --- Item 3: allocation failures ----------------------------------------------------------------

TEST_CASE("hardening: allocation failures are mixtape errors", "[hardening][memory]") {
  // 2^50 bytes: more than any address space holds, whatever the overcommit policy.
  const std::string msg = error_of([] { mt::Tensor::empty({p2(48)}, mt::kFloat32); });
  CHECK_THAT(msg, Contains("1125899906842624 bytes") && Contains("cpu") &&
                      Contains("[281474976710656]") && Contains("float32"));
  CHECK_THROWS_AS(mt::Tensor::empty({p2(48)}, mt::kFloat32), mt::OutOfMemoryError);
  CHECK_THROWS_AS(mt::zeros({p2(47)}, mt::kFloat64), mt::OutOfMemoryError);
  CHECK_THROWS_WITH(mt::zeros({p2(47)}, mt::kFloat64), Contains("zeros"));
  CHECK_THROWS_AS(mt::uniform({p2(48)}), mt::OutOfMemoryError);
  CHECK_THROWS_AS(mt::normal({p2(48)}, 0.0, 1.0, mt::kFloat16), mt::OutOfMemoryError);
  CHECK_THROWS_AS(mt::arange(p2(48)), mt::OutOfMemoryError);
  CHECK_THROWS_AS(mt::arange(0.0, 1e15, 1.0, mt::kFloat64), mt::OutOfMemoryError);
  // The issue's case, 1 TiB: refused on any usual machine; where the system grants it the
  // tensor is simply made (and never touched).
  CHECK(error_of([] { mt::Tensor::empty({p2(38)}, mt::kFloat32); }).find("\n") ==
        std::string::npos);
  // Memory is still usable afterwards.
  CHECK(mt::ones({1000}).to_vector<float>().at(999) == 1.0f);
}

TEST_CASE("hardening: arange counts its elements before it allocates", "[hardening][memory]") {
  CHECK_THROWS_AS(mt::arange(0.0, 1e30), mt::ValueError);
  CHECK_THROWS_WITH(mt::arange(0.0, 1e30), Contains("arange") && Contains("1e+30"));
  CHECK_THROWS_AS(mt::arange(0.0, 1.0, 1e-300), mt::ValueError);
  CHECK_THROWS_AS(mt::arange(-1e19, 1e19, 1.0, mt::kInt64), mt::ValueError);
  CHECK_THROWS_AS(mt::arange(p2(62)), mt::ValueError);
  CHECK(mt::arange(0.0, 1e18, 1e17, mt::kFloat64).to_vector<double>().back() == 9e17);
  CHECK(mt::arange(5.0, 0.0).numel() == 0);
}

// --- Item 4: the default generator shared by threads ------------------------------------------

TEST_CASE("hardening: threads drawing from the default generator lose and repeat nothing",
          "[hardening][random][threads]") {
  constexpr int kDraws = 200'000;
  for (int round = 0; round < 5; ++round) {
    const std::uint64_t seed = 1000 + static_cast<std::uint64_t>(round);
    mt::manual_seed(seed);
    std::vector<std::uint64_t> got[2];
    std::latch start(2);
    auto draw = [&](int k) {
      got[k].reserve(kDraws);
      start.arrive_and_wait();
      for (int i = 0; i < kDraws; ++i) got[k].push_back(mt::default_generator().next_u64());
    };
    std::thread t0(draw, 0), t1(draw, 1);
    t0.join();
    t1.join();
    // Together the threads drew exactly the first 2 * kDraws numbers of the sequence.
    mt::Generator ref(seed);
    std::vector<std::uint64_t> expected(2 * kDraws);
    for (auto& x : expected) x = ref.next_u64();
    std::vector<std::uint64_t> all = got[0];
    all.insert(all.end(), got[1].begin(), got[1].end());
    std::sort(all.begin(), all.end());
    std::sort(expected.begin(), expected.end());
    // Counted rather than compared whole (a failure would print 400,000 numbers).
    std::vector<std::uint64_t> repeated, missing;
    std::set_difference(all.begin(), all.end(), expected.begin(), expected.end(),
                        std::back_inserter(repeated));
    std::set_difference(expected.begin(), expected.end(), all.begin(), all.end(),
                        std::back_inserter(missing));
    INFO("round " << round);
    CHECK(repeated.size() == 0);
    CHECK(missing.size() == 0);
  }
}

TEST_CASE("hardening: a random tensor is one run of the default generator's sequence",
          "[hardening][random][threads]") {
  constexpr std::int64_t kN = 100'000;
  for (int round = 0; round < 5; ++round) {
    const std::uint64_t seed = 2000 + static_cast<std::uint64_t>(round);
    mt::manual_seed(seed);
    mt::Tensor out[2];
    std::latch start(2);
    auto draw = [&](int k) {
      start.arrive_and_wait();
      out[k] = mt::uniform({kN}, 0.0, 1.0, mt::kFloat64);
    };
    std::thread t0(draw, 0), t1(draw, 1);
    t0.join();
    t1.join();
    mt::Generator ref(seed);
    const auto first = mt::uniform({kN}, 0.0, 1.0, mt::kFloat64, mt::Device::cpu(), &ref);
    const auto second = mt::uniform({kN}, 0.0, 1.0, mt::kFloat64, mt::Device::cpu(), &ref);
    const auto a = out[0].to_vector<double>(), b = out[1].to_vector<double>();
    const auto f = first.to_vector<double>(), s = second.to_vector<double>();
    // Either thread may have gone first; each got a whole run.
    CHECK(((a == f && b == s) || (a == s && b == f)));
  }
}

TEST_CASE("hardening: two threads building layers without seeds each get whole runs",
          "[hardening][random][threads]") {
  // The issue's race: layers built on two threads at once, their initializers drawing from
  // the default generator. Each kernel must be one consecutive run of its sequence: the
  // kernels of the two threads are those of the same layers built one after another on
  // one thread, in some order.
  constexpr int kLayers = 24;
  auto build = [] {
    auto dense = ml::Dense(48);
    dense(mt::ones({2, 40}));
    return dense->kernel().value().to_vector<float>();
  };
  for (int round = 0; round < 3; ++round) {
    const std::uint64_t seed = 3000 + static_cast<std::uint64_t>(round);
    mt::manual_seed(seed);
    std::vector<std::vector<float>> expected;
    for (int i = 0; i < 2 * kLayers; ++i) expected.push_back(build());
    mt::manual_seed(seed);
    std::vector<std::vector<float>> got[2];
    std::latch start(2);
    auto run = [&](int k) {
      start.arrive_and_wait();
      for (int i = 0; i < kLayers; ++i) got[k].push_back(build());
    };
    std::thread t0(run, 0), t1(run, 1);
    t0.join();
    t1.join();
    std::vector<std::vector<float>> all = got[0];
    all.insert(all.end(), got[1].begin(), got[1].end());
    std::sort(all.begin(), all.end());
    std::sort(expected.begin(), expected.end());
    // Counted rather than compared whole (a failure would print 48 kernels).
    std::vector<std::vector<float>> unexpected;
    std::set_difference(all.begin(), all.end(), expected.begin(), expected.end(),
                        std::back_inserter(unexpected));
    INFO("round " << round);
    CHECK(all.size() == expected.size());
    CHECK(unexpected.size() == 0);
  }
}

TEST_CASE("hardening: a generator holds its lock across a run of draws",
          "[hardening][random][threads]") {
  mt::Generator gen(7), ref(7);
  std::vector<std::uint64_t> run;
  std::atomic<bool> other_done{false};
  std::thread other;
  {
    auto hold = gen.lock();
    other = std::thread([&] {
      gen.next_u64();  // waits for the lock
      other_done = true;
    });
    for (int i = 0; i < 1000; ++i) run.push_back(gen.next_u64());
    CHECK_FALSE(other_done.load());
  }
  other.join();
  CHECK(other_done.load());
  for (std::uint64_t x : run) CHECK(x == ref.next_u64());
  ref.next_u64();  // the other thread's draw
  CHECK(gen.next_u64() == ref.next_u64());
}

// --- Item 14: stale temporaries of an atomic save ----------------------------------------------

namespace {

// The PID of a process that has exited (and been reaped).
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// A child process that lives until killed.
struct LiveChild {
  pid_t pid;
  LiveChild() : pid(::fork()) {
    if (pid == 0) {
      for (;;) ::pause();
    }
  }
  ~LiveChild() {
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
  }
};

void touch(const fs::path& p) { std::ofstream(p) << "partial"; }

}  // namespace

TEST_CASE("hardening: a save removes stale temporaries of its target", "[hardening][safetensors]") {
  const fs::path dir = fs::temp_directory_path() /
                       fmt::format("mixtape-hardening-tmp-{}", static_cast<long>(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path target = dir / "w.safetensors";
  const pid_t dead = dead_pid(), dead2 = dead_pid();
  LiveChild live;
  const fs::path stale = dir / fmt::format("w.safetensors.tmp-{}", dead);
  const fs::path stale2 = dir / fmt::format("w.safetensors.tmp-{}", dead2);
  const fs::path alive = dir / fmt::format("w.safetensors.tmp-{}", live.pid);
  const fs::path other_target = dir / fmt::format("v.safetensors.tmp-{}", dead);
  const fs::path longer_name = dir / fmt::format("w.safetensors.bak.tmp-{}", dead);
  const fs::path not_a_pid = dir / "w.safetensors.tmp-12ab";
  for (const auto& p : {stale, stale2, alive, other_target, longer_name, not_a_pid}) touch(p);

  mt::save_safetensors(target.string(), {{"x", mt::ones({3})}});
  CHECK(mt::load_safetensors(target.string()).at("x").to_vector<float>() ==
        std::vector<float>{1, 1, 1});
  CHECK_FALSE(fs::exists(stale));
  CHECK_FALSE(fs::exists(stale2));
  CHECK(fs::exists(alive));  // a live process may be saving right now
  CHECK(fs::exists(other_target));
  CHECK(fs::exists(longer_name));
  CHECK(fs::exists(not_a_pid));
  // The save's own temporary is gone too.
  CHECK_FALSE(fs::exists(dir / fmt::format("w.safetensors.tmp-{}", static_cast<long>(::getpid()))));
  fs::remove_all(dir);
}
