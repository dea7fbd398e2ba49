// Learning curves as an SVG image: loss and accuracy per epoch, training and validation,
// in two panels with axes, ticks and a legend. Any browser or image viewer opens it.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace mnist_app {

struct Curves {
  std::vector<int> epochs;                            // 1-based epoch numbers
  std::map<std::string, std::vector<double>> series;  // "loss", "val_loss", "accuracy", ...
};

// The SVG document for `curves` (title on top).
std::string curves_svg(const Curves& curves, const std::string& title);

// Writes curves_svg() to `path` (through a temporary file renamed into place); throws
// mixtape::Error naming the path when it cannot be written.
void write_curves_svg(const std::string& path, const Curves& curves, const std::string& title);

}  // namespace mnist_app
