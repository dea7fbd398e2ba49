// Every built-in layer class: the one list of their headers, read by the umbrella header
// (mixtape/mixtape.h) and by the layer table (layers/layer_table.cpp). A new built-in layer's
// header goes here, its row in the table.
#pragma once

#include "mixtape/layers/attention.h"
#include "mixtape/layers/augmentation.h"
#include "mixtape/layers/conv_layers.h"
#include "mixtape/layers/core_layers.h"
#include "mixtape/layers/merge.h"
#include "mixtape/layers/normalization.h"
