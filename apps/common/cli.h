// Checks of command-line values shared by the bundled apps (CLI11 validators): each returns an
// error message, or "" when the value is fine, and CLI11 refuses a bad value with
// "--flag: <message>" (the apps print that as one line, exit status 2).
#pragma once

#include <fmt/format.h>
#include <mixtape/mixtape.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace apps {

// A check (or a transform, when it rewrites its argument) returning an error message, or ""
// when the value is fine. No description: CLI11 would append it to the option's type in --help.
inline CLI::Validator validator(std::function<std::string(std::string&)> check) {
  return CLI::Validator(std::move(check), "");
}

// An integer in [min, max], in base 10 with nothing after the digits. The check rewrites the
// value in plain decimal, so that CLI11's own conversion (which reads "010" as octal and
// "0x10" as hexadecimal) converts exactly the number that was checked.
inline CLI::Validator integer(std::int64_t min,
                              std::int64_t max = std::numeric_limits<int>::max()) {
  return validator([min, max](std::string& v) -> std::string {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno != 0 || n < min)
      return fmt::format("needs an integer >= {}; got '{}'", min, v);
    if (n > max) return fmt::format("needs an integer <= {}; got '{}'", max, v);
    v = std::to_string(n);
    return {};
  });
}

// A number in [lo, hi] (NaN is not). Rewritten with 17 digits, which CLI11 converts back to
// the same double.
inline CLI::Validator real(double lo, double hi) {
  return validator([lo, hi](std::string& v) -> std::string {
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(x >= lo && x <= hi))
      return fmt::format("needs a number in [{}, {}]; got '{}'", lo, hi, v);
    v = fmt::format("{:.17g}", x);
    return {};
  });
}

// One of `names`; the message lists them.
inline CLI::Validator one_of(const std::string& what, const std::vector<std::string>& names) {
  return validator([what, names](const std::string& v) -> std::string {
    if (std::find(names.begin(), names.end(), v) != names.end()) return {};
    std::string valid;
    for (const std::string& name : names) valid += (valid.empty() ? "" : ", ") + name;
    return fmt::format("unknown {} '{}'; valid: {}", what, v, valid);
  });
}

// A dtype policy mixtape::Policy knows; its ValueError names the valid ones.
inline CLI::Validator policy_name() {
  return validator([](const std::string& v) -> std::string {
    try {
      mixtape::Policy check(v);
    } catch (const mixtape::ValueError& e) {
      return e.what();
    }
    return {};
  });
}

// A flag takes no value: CLI11 records "true" for `--flag`, and the value for `--flag=value`
// (which it would otherwise read as a boolean, "--flag=0" or "--flag=no" turning it off).
inline CLI::Validator no_value() {
  return validator([](const std::string& v) -> std::string {
    return v == "true" ? "" : fmt::format("takes no value; got '{}'", v);
  });
}

}  // namespace apps
