// The parsers of the MIXTAPE_* environment variables (core/env.h).
#include "core/env.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <system_error>

#include "mixtape/core/error.h"

namespace mixtape::detail::env {

namespace {

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

}  // namespace

bool BoolVar::parse(const char* value) const {
  if (value == nullptr) return unset;
  const std::string_view v(value);
  if (v == "1") return true;
  if (v == "0") return false;
  throw ValueError(fmt::format("{}='{}' is not a valid value; valid: \"0\" ({}{}), \"1\" ({}{})",
                               name, v, off, unset ? "" : "; the default when unset", on,
                               unset ? "; the default when unset" : ""));
}

bool BoolVar::read() const { return parse(std::getenv(name)); }

std::uint64_t UIntVar::parse(const char* value) const {
  if (value == nullptr) return unset;
  const std::string_view v(value);
  std::uint64_t n = 0;
  const bool digits = !v.empty() && v.find_first_not_of("0123456789") == std::string_view::npos;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (!digits || ec != std::errc() || end != v.data() + v.size() || n > max)
    throw ValueError(fmt::format(
        "{}='{}' is not a valid value; valid: an integer from 0 to {} ({}; the default when "
        "unset: {})",
        name, v, max, meaning, unset));
  return n;
}

std::uint64_t UIntVar::read() const { return parse(std::getenv(name)); }

std::vector<std::string> NameListVar::parse(const char* value,
                                            std::span<const std::string_view> valid) const {
  std::vector<std::string> out;
  if (value == nullptr) return out;
  const std::string_view v(value);
  if (trim(v).empty()) return out;
  auto valid_list = [&] {
    std::string s;
    for (auto n : valid) {
      if (!s.empty()) s += ", ";
      s += n;
    }
    return s;
  };
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = v.find(',', start);
    const std::string_view item = trim(
        v.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (item.empty())
      throw ValueError(fmt::format(
          "{}='{}' is not a valid value: an empty {} name; valid: comma-separated {} names "
          "out of: {}",
          name, v, what, what, valid_list()));
    bool known = false;
    for (auto n : valid) known = known || n == item;
    if (!known)
      throw ValueError(fmt::format(
          "{}='{}' is not a valid value: unknown {} '{}'; valid: comma-separated {} names "
          "out of: {}",
          name, v, what, item, what, valid_list()));
    out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

std::vector<std::string> NameListVar::read(std::span<const std::string_view> valid) const {
  return parse(std::getenv(name), valid);
}

}  // namespace mixtape::detail::env
