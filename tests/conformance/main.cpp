// mixtape-ops: the conformance sweep over every backend (tests/conformance/conformance.h).
//
//   mixtape-ops                 sweep every (op, dtype) of every backend with a device here
//   mixtape-ops --list          print the coverage table (op x dtype x backend) without running
//   mixtape-ops --backend cuda  one backend (exit status 77, "skipped", when it has no device)
//   mixtape-ops --op gelu --dtype bfloat16
//   mixtape-ops --self-test     check that the sweep catches a wrong kernel
//
// Exit status: 0 when every case agrees with the reference and every (op, dtype) the op
// table requires is registered and swept; 1 otherwise; 77 when no backend asked for has a
// device (CTest reports that as skipped).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "mixtape/core/register_kernels.h"
#include "mixtape/mixtape.h"  // the CPU backend, and the CUDA one when linked
#include "tests/conformance/conformance.h"

namespace mt = mixtape;
namespace mc = mixtape::conformance;

namespace {

// What the coverage table says of one (op, dtype, backend).
enum class Status { NotRequired, Missing, NoDriver, NoDevice, Reference, Planned, Passed, Failed };

const char* cell(Status s) {
  switch (s) {
    case Status::NotRequired:
      return ".";
    case Status::Missing:
      return "MISSING";
    case Status::NoDriver:
      return "NO-DRIVER";
    case Status::NoDevice:
      return "no-device";
    case Status::Reference:
      return "ref";
    case Status::Planned:
      return "tested";
    case Status::Passed:
      return "ok";
    case Status::Failed:
      return "FAIL";
  }
  return "?";
}

struct Backend {
  mt::DeviceType type;
  std::string name;
  bool has_device;
};

std::vector<Backend> backends() {
  std::vector<Backend> out;
  for (int t = 0; t < mt::kDeviceTypeCount; ++t) {
    const auto type = static_cast<mt::DeviceType>(t);
    if (!mt::has_backend(type)) continue;
    mt::Backend& b = mt::backend_for(type);
    std::string name = b.name();
    for (auto& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    out.push_back({type, name, b.device_count() > 0});
  }
  return out;
}

// The status an (op, dtype, backend) has before running.
Status planned(mt::OpId op, mt::DType dt, const Backend& b) {
  const mt::OpInfo& info = mt::op_info(op);
  const bool registered = mt::supports(op, b.type, dt);
  if (!info.dtypes.contains(dt) && !registered) return Status::NotRequired;
  if (!registered) return Status::Missing;
  if (!mc::has_driver(op)) return Status::NoDriver;
  if (!b.has_device) return Status::NoDevice;
  // The CPU's float64 kernels are the reference of every other; an op of float64 alone (the
  // loss scale kept on the device) is checked against the rule its driver writes out, on the
  // CPU too.
  if (b.type == mt::DeviceType::CPU && dt == mt::kFloat64 &&
      !(info.dtypes == mt::dtype_sets::Float64))
    return Status::Reference;
  return Status::Planned;
}

void print_table(const std::vector<Backend>& bs,
                 const std::map<std::tuple<int, int, int>, Status>& status) {
  for (const auto& b : bs) {
    fmt::print("\n{} backend{}\n{:<24}", b.name, b.has_device ? "" : " (no device here)", "op");
    for (int d = 0; d < mt::DType::kCount; ++d) fmt::print("{:>14}", mt::DType::all()[d].name());
    fmt::print("\n");
    for (int op = 0; op < mt::kOpCount; ++op) {
      if (!mt::detail::kOpInfos[op].has_kernel) continue;
      fmt::print("{:<24}", mt::detail::kOpInfos[op].name);
      for (int d = 0; d < mt::DType::kCount; ++d)
        fmt::print("{:>14}", cell(status.at({static_cast<int>(b.type), op, d})));
      fmt::print("\n");
    }
  }
  fmt::print(
      "\nok: agrees with the CPU's float64 kernel; tested: will be (--list); ref: the reference "
      "itself;\nno-device: registered, no device here to run it; MISSING: the op table "
      "requires it, no kernel;\nNO-DRIVER: registered but the sweep cannot run its signature; "
      ".: not required, not registered\n");
}

// --self-test: a float32 gelu that is off by one part in 10^4 must be caught.
void wrong_gelu(const mt::Tensor& x, const mt::Tensor& out) {
  const auto* xp = static_cast<const float*>(x.data_ptr());
  auto* yp = static_cast<float*>(out.data_ptr());
  for (std::int64_t i = 0; i < x.numel(); ++i)
    yp[i] = 0.5f * xp[i] * std::erfc(-xp[i] * 0.70710678f) * 1.0001f;
}

int self_test(std::uint64_t seed) {
  const auto right =
      mt::find_kernel<mt::kernels::UnaryFn>(mt::OpId::gelu, mt::DeviceType::CPU, mt::kFloat32)
          .raw();
  mt::register_kernel<mt::kernels::UnaryFn>(mt::OpId::gelu, mt::DeviceType::CPU, mt::kFloat32,
                                            &wrong_gelu);
  mc::Context wrong(mt::OpId::gelu, mt::kFloat32, mt::Device::cpu(), seed);
  mc::run_cases(wrong);
  mt::register_kernel<mt::kernels::UnaryFn>(mt::OpId::gelu, mt::DeviceType::CPU, mt::kFloat32,
                                            right);
  mc::Context restored(mt::OpId::gelu, mt::kFloat32, mt::Device::cpu(), seed);
  mc::run_cases(restored);
  fmt::print("a float32 gelu off by 1e-4: {} of {} cases fail{}\n", wrong.failures().size(),
             wrong.cases(),
             wrong.failures().empty() ? "" : fmt::format(" ({})", wrong.failures()[0]));
  fmt::print("the real one: {} of {} cases fail\n", restored.failures().size(), restored.cases());
  return !wrong.failures().empty() && restored.failures().empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mixtape-ops: every kernel of every backend against the CPU's float64 kernels"};
  bool list = false, self = false, verbose = false;
  std::vector<std::string> only_backends, only_ops, only_dtypes;
  std::uint64_t seed = 2026;
  app.add_flag("--list", list, "print the coverage table (op x dtype x backend) and exit");
  app.add_option("--backend", only_backends, "only this backend (cpu, cuda); repeatable");
  app.add_option("--op", only_ops, "only this op of the op table; repeatable");
  app.add_option("--dtype", only_dtypes, "only this dtype; repeatable");
  app.add_option("--seed", seed, "seed of the random inputs (default 2026)");
  app.add_flag("--self-test", self, "check that the sweep catches a wrong float32 gelu kernel");
  app.add_flag("-v,--verbose", verbose, "a line per (op, dtype, backend)");
  CLI11_PARSE(app, argc, argv);

  try {
    if (self) return self_test(seed);

    std::vector<Backend> bs;
    for (const auto& b : backends()) {
      if (only_backends.empty() ||
          std::find(only_backends.begin(), only_backends.end(), b.name) != only_backends.end())
        bs.push_back(b);
    }
    for (const auto& name : only_backends) {
      if (std::none_of(bs.begin(), bs.end(), [&](const Backend& b) { return b.name == name; })) {
        fmt::print("mixtape-ops: no backend '{}' in this build; skipped\n", name);
        return 77;
      }
    }
    std::vector<mt::OpId> ops;
    for (const auto& name : only_ops) {
      const auto op = mt::op_by_name(name);
      if (!op) {
        fmt::print(stderr, "mixtape-ops: --op: '{}' is not an op of the op table\n", name);
        return 2;
      }
      ops.push_back(*op);
    }
    std::vector<mt::DType> dtypes;
    for (const auto& name : only_dtypes) dtypes.emplace_back(name);
    auto selected_op = [&](int op) {
      return ops.empty() ||
             std::find(ops.begin(), ops.end(), static_cast<mt::OpId>(op)) != ops.end();
    };
    auto selected_dtype = [&](mt::DType d) {
      return dtypes.empty() || std::find(dtypes.begin(), dtypes.end(), d) != dtypes.end();
    };

    std::map<std::tuple<int, int, int>, Status> status;
    bool incomplete = false;
    for (const auto& b : bs)
      for (int op = 0; op < mt::kOpCount; ++op)
        for (int d = 0; d < mt::DType::kCount; ++d) {
          const Status s = planned(static_cast<mt::OpId>(op), mt::DType::all()[d], b);
          status[{static_cast<int>(b.type), op, d}] = s;
          incomplete |= s == Status::Missing || s == Status::NoDriver;
        }
    if (list) {
      print_table(bs, status);
      return incomplete ? 1 : 0;
    }

    const bool any_device =
        std::any_of(bs.begin(), bs.end(), [](const Backend& b) { return b.has_device; });
    if (!any_device) {
      fmt::print("mixtape-ops: no device for the backends asked for; skipped\n");
      return 77;
    }

    int cases = 0, failed = 0, swept = 0;
    const auto start = std::chrono::steady_clock::now();
    for (const auto& b : bs) {
      for (int op = 0; op < mt::kOpCount; ++op) {
        if (!selected_op(op)) continue;
        for (int d = 0; d < mt::DType::kCount; ++d) {
          const mt::DType dt = mt::DType::all()[d];
          Status& s = status[{static_cast<int>(b.type), op, d}];
          if (s != Status::Planned || !selected_dtype(dt)) continue;
          mc::Context c(static_cast<mt::OpId>(op), dt, mt::Device(b.type, 0), seed);
          try {
            mc::run_cases(c);
          } catch (const std::exception& e) {
            // A kernel that throws fails its (op, dtype); the sweep goes on.
            fmt::print("FAIL {} {} on {}: threw: {}\n", mt::detail::kOpInfos[op].name, dt.name(),
                       b.name, e.what());
            s = Status::Failed;
            ++failed;
            continue;
          }
          ++swept;
          cases += c.cases();
          s = c.failures().empty() ? Status::Passed : Status::Failed;
          for (const auto& f : c.failures()) fmt::print("FAIL {}\n", f);
          failed += c.failures().empty() ? 0 : 1;
          if (verbose)
            fmt::print("{:<24} {:<9} {:<5} {} cases {}\n", mt::detail::kOpInfos[op].name, dt.name(),
                       b.name, c.cases(), cell(s));
        }
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    print_table(bs, status);
    fmt::print(
        "\n{} (op, dtype, backend) swept, {} cases, {} failed, in {:.1f} s{}\n", swept, cases,
        failed, seconds,
        incomplete ? "; the op table's requirements are not all met (MISSING / NO-DRIVER)" : "");
    return failed == 0 && !incomplete ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mixtape-ops: error: {}\n", e.what());
    return 1;
  }
}
