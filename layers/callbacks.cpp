// fit's callbacks: the progress output (ProgbarLogger), EarlyStopping, and History.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>

#include "mixtape/layers/model.h"

namespace mixtape {

namespace {

std::string duration_text(double s) {
  if (s < 60) return fmt::format("{:.1f}s", s);
  return fmt::format("{}m{:02d}s", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
}

double seconds_between(std::chrono::steady_clock::time_point a,
                       std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

std::string format_logs(const Logs& logs, const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    auto it = logs.find(k);
    if (it == logs.end()) continue;
    if (!out.empty()) out += " - ";
    if (k == "loss_scale" || k == "skipped_steps")
      out += fmt::format("{}: {:g}", k, it->second);
    else
      out += fmt::format("{}: {:.4f}", k, it->second);
  }
  return out;
}

// --- ProgbarLogger --------------------------------------------------------------------------

void ProgbarLogger::set_params(const TrainParams& params) {
  params_ = params;
  bar_ = verbose_ == 1 && isatty(fileno(stdout));
}

void ProgbarLogger::on_epoch_begin(Model&, int epoch) {
  if (verbose_ > 0) fmt::print("Epoch {}/{}\n", epoch + 1, params_.epochs);
  start_ = last_print_ = end_ = Clock::now();
}

bool ProgbarLogger::wants_batch_logs() const {
  return bar_ && seconds_between(last_print_, Clock::now()) >= 0.1;
}

void ProgbarLogger::on_batch_end(Model&, std::int64_t batch, const Logs& logs) {
  const std::int64_t steps = params_.steps;
  end_ = Clock::now();  // the epoch's time: up to its last batch (validation not counted)
  if (!bar_ || logs.empty() || !(batch + 1 == steps || seconds_between(last_print_, end_) >= 0.1))
    return;
  last_print_ = end_;
  constexpr int kWidth = 30;
  const int done = steps > 0 ? static_cast<int>(kWidth * (batch + 1) / steps) : kWidth;
  std::string bar(static_cast<std::size_t>(std::min(done, kWidth)), '=');
  if (done < kWidth) bar += '>' + std::string(static_cast<std::size_t>(kWidth - done - 1), '.');
  const double elapsed = seconds_between(start_, end_);
  const double eta = elapsed / static_cast<double>(batch + 1) *
                     static_cast<double>(std::max<std::int64_t>(steps - batch - 1, 0));
  fmt::print("\r{}/{} [{}] - ETA: {} - {}   ", batch + 1, steps, bar, duration_text(eta),
             format_logs(logs, params_.metric_keys));
  std::fflush(stdout);
}

void ProgbarLogger::on_epoch_end(Model&, int, const Logs& logs) {
  if (verbose_ <= 0) return;
  // The training keys, then their validation ones, then the loss scale's (those logged).
  std::vector<std::string> keys = params_.metric_keys;
  for (const auto& k : params_.metric_keys) keys.push_back("val_" + k);
  keys.push_back("loss_scale");
  keys.push_back("skipped_steps");
  const double seconds = seconds_between(start_, end_);
  const double us = seconds / static_cast<double>(std::max<std::int64_t>(params_.samples, 1)) * 1e6;
  fmt::print("{}{}/{} - {} - {:.0f}us/sample - {}\n", bar_ ? "\r" : "", params_.steps,
             params_.steps, duration_text(seconds), us, format_logs(logs, keys));
  std::fflush(stdout);
}

// --- History, EarlyStopping -----------------------------------------------------------------

double History::last(const std::string& key) const {
  auto it = history.find(key);
  if (it == history.end() || it->second.empty()) {
    std::string keys;
    for (const auto& [k, v] : history) keys += (keys.empty() ? "" : ", ") + k;
    throw ValueError(fmt::format("History: no value '{}'; logged: {}", key, keys));
  }
  return it->second.back();
}

EarlyStopping::EarlyStopping(Options options) : options_(std::move(options)) {
  if (options_.patience < 0)
    throw ValueError(
        fmt::format("EarlyStopping: patience must be >= 0; got {}", options_.patience));
}

void EarlyStopping::on_train_begin(Model&) {
  seen_ = false;
  wait_ = 0;
  stopped_epoch_ = -1;
}

void EarlyStopping::on_epoch_end(Model& model, int epoch, const Logs& logs) {
  auto it = logs.find(options_.monitor);
  if (it == logs.end()) {
    spdlog::warn("EarlyStopping: '{}' is not logged; nothing to monitor", options_.monitor);
    return;
  }
  const double v = it->second;
  const bool better = !seen_ || (options_.maximize ? v > best_ + options_.min_delta
                                                   : v < best_ - options_.min_delta);
  if (better) {
    best_ = v;
    seen_ = true;
    wait_ = 0;
    return;
  }
  if (++wait_ > options_.patience) {
    stopped_epoch_ = epoch;
    model.stop_training();
  }
}

}  // namespace mixtape
