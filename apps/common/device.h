// The device an app trains on (--device), and the peak arithmetic rate of a GPU for the
// model FLOP utilisation the apps print. Shared by the bundled apps.
#pragma once

#include <fmt/format.h>
#include <mixtape/mixtape.h>

#include <cctype>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace apps {

// --device: auto (cuda when a GPU is present), cpu, cuda, cuda:N. Under mpirun, "auto" and
// "cuda" take the GPU of the rank's place on its machine. A device that is not there is a
// DeviceError naming it (a program built without the CUDA backend says so).
inline mixtape::Device pick_device(const std::string& name) {
  namespace mt = mixtape;
  if (name != "auto" && !mt::has_backend(mt::DeviceType::CUDA) &&
      (name == "cuda" || mt::Device::parse(name).is_cuda()))
    throw mt::DeviceError(fmt::format(
        "--device {}: this program has no CUDA backend (mixtape was built without nvcc); use "
        "--device cpu",
        name));
  const bool have_cuda = mt::has_backend(mt::DeviceType::CUDA) &&
                         mt::backend_for(mt::DeviceType::CUDA).device_count() > 0;
  const int gpu = have_cuda ? mt::distributed::local_rank() %
                                  mt::backend_for(mt::DeviceType::CUDA).device_count()
                            : 0;
  if (name == "auto") return have_cuda ? mt::Device::cuda(gpu) : mt::Device::cpu();
  if (name == "cuda") {
    mt::check_device(mt::Device::cuda(gpu));
    return mt::Device::cuda(gpu);
  }
  const mt::Device d = mt::Device::parse(name);
  mt::check_device(d);  // a clear DeviceError when it is not there
  return d;
}

// Whether `part` is in `name` as whole words ("NVIDIA L40" holds "L40", not "L4").
inline bool holds_words(const std::string& name, const std::string& part) {
  const auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; };
  for (std::size_t at = name.find(part); at != std::string::npos; at = name.find(part, at + 1)) {
    const std::size_t end = at + part.size();
    if ((at == 0 || !word_char(name[at - 1])) && (end == name.size() || !word_char(name[end])))
      return true;
  }
  return false;
}

// The dense peak of a GPU for matrix products in `compute` (float16 and bfloat16: the
// tensor cores' rate; float32: the CUDA cores' rate), in TFLOP/s, from NVIDIA's data sheets
// (without sparsity); nullopt for a device or dtype the table does not know (the CPU among
// them: give --peak-tflops).
inline std::optional<double> peak_tflops(const mixtape::DeviceProperties& gpu,
                                         mixtape::DType compute) {
  struct Row {
    const char* name;  // words of the device's name
    double half, single;
  };
  // The more specific names first ("H100 PCIe" before "H100").
  static const std::vector<Row> table = {
      {"H200 NVL", 835.5, 60.0},  {"H200", 989.4, 66.9},     {"GH200", 989.4, 66.9},
      {"H100 PCIe", 756.5, 51.2}, {"H100 NVL", 835.5, 60.0}, {"H100", 989.4, 66.9},
      {"H800 PCIe", 756.5, 51.2}, {"H800", 989.4, 66.9},     {"A100", 312.0, 19.5},
      {"A800", 312.0, 19.5},      {"L40S", 362.1, 91.6},     {"L40", 181.0, 90.5},
      {"L4", 121.0, 30.3},        {"A10", 125.0, 31.2},      {"RTX 4090", 165.2, 82.6},
      {"RTX 3090", 71.0, 35.6},
  };
  if (gpu.compute_major == 0) return std::nullopt;
  const bool half = compute == mixtape::kFloat16 || compute == mixtape::kBFloat16;
  if (!half && compute != mixtape::kFloat32) return std::nullopt;
  for (const Row& r : table)
    if (holds_words(gpu.name, r.name)) return half ? r.half : r.single;
  return std::nullopt;
}

}  // namespace apps
