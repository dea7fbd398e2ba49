// The ONNX forms of mixtape's built-in layers (onnx_export/layers.cpp), by class name: the
// exporters export_onnx starts with. Private to the onnx library.
#pragma once

#include <map>
#include <string>

#include "mixtape/onnx/export.h"

namespace mixtape::onnx_detail {

std::map<std::string, OnnxExporter> builtin_exporters();

}  // namespace mixtape::onnx_detail
