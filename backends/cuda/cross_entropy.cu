// The softmax cross-entropy on CUDA (ops softmax_cross_entropy and its backward), a first
// plain form: a warp per row (the maximum and the sum of exponentials with shuffles, the sum
// in float64 as the CPU's), the gradient recomputing the softmax from the saved
// log-sum-exp. A label outside [0, c) gives NaN for its row (the kernel cannot throw).
// Written without a GPU at hand; the conformance sweep checks it.
#include <cmath>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/warp.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

template <typename T>
__global__ void cross_entropy_forward_kernel(const T* __restrict__ x,
                                             const int64_t* __restrict__ labels,
                                             compute_of<T>* __restrict__ loss,
                                             compute_of<T>* __restrict__ lse, int64_t n,
                                             int64_t c) {
  using C = compute_of<T>;
  for_each_warp_item(n, [&](int64_t i, int lane) {
    const T* xr = x + i * c;
    C m = -static_cast<C>(INFINITY);
    for (int64_t j = lane; j < c; j += kWarp) m = fmax(m, load(xr[j]));
    m = warp_max(m);
    // The sum of exponentials in float64, as the CPU backend adds it: the loss of a
    // 50,000-class row keeps float32's precision.
    double s = 0.0;
    for (int64_t j = lane; j < c; j += kWarp) s += static_cast<double>(d_exp(load(xr[j]) - m));
    s = warp_sum(s);
    if (lane == 0) {
      const C l = m + static_cast<C>(log(s));
      const int64_t y = labels[i];
      lse[i] = l;
      loss[i] = y >= 0 && y < c ? l - load(xr[y]) : static_cast<C>(NAN);
    }
  });
}

template <typename T>
__global__ void cross_entropy_backward_kernel(const T* __restrict__ x,
                                              const int64_t* __restrict__ labels,
                                              const compute_of<T>* __restrict__ lse,
                                              const compute_of<T>* __restrict__ dloss,
                                              T* __restrict__ dx, int64_t n, int64_t c) {
  using C = compute_of<T>;
  for_each_warp_item(n, [&](int64_t i, int lane) {
    const T* xr = x + i * c;
    const C l = lse[i], g = dloss[i];
    const int64_t y = labels[i];
    const bool ok = y >= 0 && y < c;
    for (int64_t j = lane; j < c; j += kWarp) {
      const C v = g * d_exp(load(xr[j]) - l) - (j == y ? g : C(0));
      dx[i * c + j] = store<T>(ok ? v : static_cast<C>(NAN));
    }
  });
}

template <typename T>
void cross_entropy_host(const Tensor& logits, const Tensor& labels, const Tensor& loss,
                        const Tensor& lse) {
  using C = compute_of<T>;
  const int64_t n = logits.dim(0), c = logits.dim(1);
  if (n == 0) return;
  OnDevice on(loss);
  launch_1d({"softmax_cross_entropy kernel", n * kWarp, on.s}, cross_entropy_forward_kernel<T>,
            static_cast<const T*>(logits.const_data_ptr()),
            static_cast<const int64_t*>(labels.const_data_ptr()), static_cast<C*>(loss.data_ptr()),
            static_cast<C*>(lse.data_ptr()), n, c);
}

template <typename T>
void cross_entropy_backward_host(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                                 const Tensor& dloss, const Tensor& dlogits) {
  using C = compute_of<T>;
  const int64_t n = logits.dim(0), c = logits.dim(1);
  if (n == 0) return;
  OnDevice on(dlogits);
  launch_1d({"softmax_cross_entropy backward kernel", n * kWarp, on.s},
            cross_entropy_backward_kernel<T>, static_cast<const T*>(logits.const_data_ptr()),
            static_cast<const int64_t*>(labels.const_data_ptr()),
            static_cast<const C*>(lse.const_data_ptr()),
            static_cast<const C*>(dloss.const_data_ptr()), static_cast<T*>(dlogits.data_ptr()), n,
            c);
}

}  // namespace

void register_cross_entropy_kernels() {
  MIXTAPE_CUDA_KERNEL(softmax_cross_entropy, cross_entropy_host);
  MIXTAPE_CUDA_KERNEL(softmax_cross_entropy_backward, cross_entropy_backward_host);
}

}  // namespace mixtape::cuda_backend
