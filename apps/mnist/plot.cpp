// The SVG learning curves of mixtape-mnist.
#include "plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "mixtape/core/error.h"

namespace mnist_app {

namespace {

constexpr double kPanelWidth = 420, kPanelHeight = 300, kMarginLeft = 60, kMarginTop = 50;
constexpr double kGap = 70, kPlotLeft = 10, kPlotBottom = 40;

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else
      out += c;
  }
  return out;
}

// A "nice" tick step for a range (1, 2 or 5 times a power of ten), about 5 ticks.
double tick_step(double range) {
  if (!(range > 0)) return 1.0;
  const double raw = range / 5.0;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * p) return m * p;
  return 10.0 * p;
}

// One panel: the series named `train` and "val_" + train, against the epochs.
std::string panel(const Curves& c, const std::string& key, const std::string& label, double x0) {
  std::vector<std::pair<std::string, std::string>> lines = {{key, "#1f77b4"},
                                                            {"val_" + key, "#ff7f0e"}};
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& [name, colour] : lines) {
    auto it = c.series.find(name);
    if (it == c.series.end()) continue;
    for (double v : it->second)
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  std::string out;
  const double w = kPanelWidth, h = kPanelHeight, y0 = kMarginTop;
  out += fmt::format(
      "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>\n", x0,
      y0, w, h);
  out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
                     x0 + w / 2, y0 - 10, escape(label));
  if (!std::isfinite(lo) || c.epochs.empty()) {
    out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">no data</text>\n",
                       x0 + w / 2, y0 + h / 2);
    return out;
  }
  if (hi - lo < 1e-12) lo -= 0.5, hi += 0.5;
  const double step = tick_step(hi - lo);
  lo = std::floor(lo / step) * step;
  hi = std::ceil(hi / step) * step;
  const double e_lo = c.epochs.front(), e_hi = std::max<double>(c.epochs.back(), e_lo + 1);
  auto px = [&](double e) {
    return x0 + kPlotLeft + (e - e_lo) / (e_hi - e_lo) * (w - 2 * kPlotLeft);
  };
  auto py = [&](double v) {
    return y0 + h - kPlotBottom / 4 - (v - lo) / (hi - lo) * (h - kPlotBottom / 2);
  };
  for (double v = lo; v <= hi + step / 2; v += step) {
    out += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", x0,
        py(v), x0 + w, py(v));
    out += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\" font-size=\"11\">{:g}</text>\n",
        x0 - 5, py(v) + 4, std::round(v / step) * step);
  }
  const int every = std::max(1, static_cast<int>(c.epochs.size() / 10));
  for (std::size_t i = 0; i < c.epochs.size(); i += static_cast<std::size_t>(every))
    out += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" font-size=\"11\">{}</text>\n",
        px(c.epochs[i]), y0 + h + 16, c.epochs[i]);
  out +=
      fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"12\">epoch</text>\n",
                  x0 + w / 2, y0 + h + 34);
  double legend_y = y0 + 18;
  for (const auto& [name, colour] : lines) {
    auto it = c.series.find(name);
    if (it == c.series.end()) continue;
    std::string points;
    for (std::size_t i = 0; i < it->second.size() && i < c.epochs.size(); ++i)
      if (std::isfinite(it->second[i]))
        points += fmt::format("{:.1f},{:.1f} ", px(c.epochs[i]), py(it->second[i]));
    out += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>\n",
                       colour, points);
    for (std::size_t i = 0; i < it->second.size() && i < c.epochs.size(); ++i)
      if (std::isfinite(it->second[i]))
        out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n",
                           px(c.epochs[i]), py(it->second[i]), colour);
    out += fmt::format(
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2\"/>"
        "<text x=\"{}\" y=\"{}\" font-size=\"12\">{}</text>\n",
        x0 + w - 120, legend_y, x0 + w - 100, legend_y, colour, x0 + w - 95, legend_y + 4,
        name.rfind("val_", 0) == 0 ? "validation" : "training");
    legend_y += 18;
  }
  return out;
}

}  // namespace

std::string curves_svg(const Curves& c, const std::string& title) {
  const double width = kMarginLeft + 2 * kPanelWidth + kGap + 20;
  const double height = kMarginTop + kPanelHeight + 60;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"16\" "
      "font-weight=\"bold\">{}</text>\n",
      width, height, width / 2, escape(title));
  svg += panel(c, "loss", "loss", kMarginLeft);
  svg += panel(c, "accuracy", "accuracy", kMarginLeft + kPanelWidth + kGap);
  svg += "</svg>\n";
  return svg;
}

void write_curves_svg(const std::string& path, const Curves& curves, const std::string& title) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f)
    throw mixtape::ValueError(
        fmt::format("cannot write the plot '{}': {}", path, std::strerror(errno)));
  const std::string svg = curves_svg(curves, title);
  const bool ok = std::fwrite(svg.data(), 1, svg.size(), f) == svg.size();
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw mixtape::ValueError(
        fmt::format("cannot write the plot '{}': {}", path, std::strerror(errno)));
  }
}

}  // namespace mnist_app
