// The dtype trace: scopes, the MIXTAPE_TRACE_DTYPES log, and the table.
#include "mixtape/layers/trace.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>

#include "core/env.h"
#include "mixtape/autograd/tape.h"

namespace mixtape {

namespace {

thread_local DTypeTrace* t_sink = nullptr;
thread_local bool t_muted = false;

// MIXTAPE_TRACE_DTYPES, read once (thread-safe), at the first leaf layer call: "1" logs
// every layer call, "0" or unset does not; another value throws ValueError (and is read,
// and throws, again on the next call).
bool log_enabled() {
  static const bool on = detail::env::kTraceDtypes.read();
  return on;
}

std::string cast_text(DType from, DType to) {
  return from == to ? std::string(from.name()) : fmt::format("{} => {}", from, to);
}

std::array<std::string, 7> cells(const DTypeTraceRow& r) {
  return {r.layer,
          r.type,
          r.policy,
          cast_text(r.input, r.input_cast),
          r.weight ? cast_text(*r.weight, *r.weight_read) : std::string("-"),
          std::string(r.computation.name()),
          std::string(r.output.name())};
}

}  // namespace

std::string DTypeTrace::table() const {
  const std::array<std::string, 7> header = {"layer",  "type",        "policy", "input",
                                             "weight", "computation", "output"};
  std::array<std::size_t, 7> width{};
  for (std::size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  std::vector<std::array<std::string, 7>> body;
  for (const auto& r : rows) {
    body.push_back(cells(r));
    for (std::size_t c = 0; c < width.size(); ++c)
      width[c] = std::max(width[c], body.back()[c].size());
  }
  // A last column of notes when some layer left one.
  const bool notes =
      std::any_of(rows.begin(), rows.end(), [](const auto& r) { return !r.note.empty(); });
  auto line = [&](const std::array<std::string, 7>& cs, const std::string& note) {
    std::string out;
    for (std::size_t c = 0; c < cs.size(); ++c)
      out += c + 1 < cs.size() || notes ? fmt::format("{:<{}}  ", cs[c], width[c]) : cs[c];
    if (notes) out += note;
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out + "\n";
  };
  std::string out = line(header, "note");
  for (std::size_t i = 0; i < body.size(); ++i) out += line(body[i], rows[i].note);
  return out;
}

DTypeTraceScope::DTypeTraceScope() : previous_(t_sink) { t_sink = &trace_; }
DTypeTraceScope::~DTypeTraceScope() { t_sink = previous_; }

DTypeTrace trace_dtypes(layers::Layer& layer, const Tensor& x, const CallContext& ctx) {
  DTypeTraceScope scope;
  {
    NoGradGuard no_grad;
    layer(x, ctx);
  }
  return scope.trace();
}

namespace detail {

bool dtype_trace_active() {
  const bool log = log_enabled();  // read first: a bad value is refused on any layer call
  return !t_muted && (t_sink != nullptr || log);
}

void dtype_trace_record(const DTypeTraceRow& row) {
  if (t_muted) return;
  if (t_sink) t_sink->rows.push_back(row);
  if (log_enabled()) {
    const auto c = cells(row);
    spdlog::info("dtype trace: {} ({}, policy {}): input {}, weight {}, computation {}, output {}",
                 c[0], c[1], c[2], c[3], c[4], c[5], c[6]);
  }
}

DTypeTraceMute::DTypeTraceMute() : previous_(t_muted) { t_muted = true; }
DTypeTraceMute::~DTypeTraceMute() { t_muted = previous_; }

}  // namespace detail

}  // namespace mixtape
