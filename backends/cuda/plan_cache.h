// Private to the CUDA backend: what the library plans of backends/cuda/gemm.cpp (cuBLASLt) and
// backends/cuda/conv.cpp (cuDNN) share: the descriptors a plan owns, and the cache of plans
// keyed by the numbers of their problem.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>

namespace mixtape::cuda_backend {

// A library descriptor (a cublasLtMatrixLayout_t, a cudnnTensorDescriptor_t, ...) owned by
// one plan: destroyed with it by kDestroy, never copied. It passes as the descriptor itself;
// out() is the address the library's Create function fills.
template <typename H, auto kDestroy>
class Owned {
 public:
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (h_) kDestroy(h_);
  }
  operator H() const { return h_; }
  H* out() { return &h_; }

 private:
  H h_ = nullptr;
};

// The numbers that identify a plan's problem (slots a cache does not use stay 0).
struct PlanKey {
  std::array<std::int64_t, 19> v{};
  bool operator==(const PlanKey&) const = default;
};
struct PlanKeyHash {
  std::size_t operator()(const PlanKey& k) const {
    std::uint64_t h = 0x9e3779b97f4a7c15ULL;
    for (std::int64_t x : k.v)
      h ^= static_cast<std::uint64_t>(x) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return static_cast<std::size_t>(h);
  }
};

// Plans by key. A plan is never destroyed while its cache lives, so references stay valid.
template <typename Plan>
using PlanCache = std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash>;

// The plan of `key`, made by make() (a std::unique_ptr<Plan>) on first use. The caller holds
// the lock that guards `cache`.
template <typename Plan, typename Make>
Plan& find_or_make(PlanCache<Plan>& cache, const PlanKey& key, Make&& make) {
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make()).first;
  return *it->second;
}

}  // namespace mixtape::cuda_backend
