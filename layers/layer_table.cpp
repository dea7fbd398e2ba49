// The table of built-in layer classes (layers/layer_table.h).
#include "layers/layer_table.h"

#include "mixtape/layers/attention.h"
#include "mixtape/layers/augmentation.h"
#include "mixtape/layers/conv_layers.h"
#include "mixtape/layers/core_layers.h"
#include "mixtape/layers/merge.h"
#include "mixtape/layers/normalization.h"

namespace mixtape::layers {

namespace {

// A factory for the layer classes that share a C++ class and differ by a kind.
template <typename L, typename Kind>
LayerFactory of_kind(Kind kind) {
  return [kind](const Config& c) -> std::shared_ptr<Layer> { return L::from_config(kind, c); };
}

}  // namespace

const std::vector<std::pair<std::string_view, LayerFactory>>& builtin_layers() {
  using Merge = ElementwiseMergeLayer::Kind;
  using Pool = Pooling2DLayer::Kind;
  static const std::vector<std::pair<std::string_view, LayerFactory>> table = {
      {"Dense", &DenseLayer::from_config},
      {"Activation", &ActivationLayer::from_config},
      {"Flatten", &FlattenLayer::from_config},
      {"Reshape", &ReshapeLayer::from_config},
      {"Slice", &SliceLayer::from_config},
      {"Dropout", &DropoutLayer::from_config},
      {"Embedding", &EmbeddingLayer::from_config},
      {"Conv2D", &Conv2DLayer::from_config},
      {"MaxPooling2D", of_kind<Pooling2DLayer>(Pool::Max)},
      {"AveragePooling2D", of_kind<Pooling2DLayer>(Pool::Average)},
      {"GlobalAveragePooling2D", &GlobalAveragePooling2DLayer::from_config},
      {"BatchNormalization", &BatchNormalizationLayer::from_config},
      {"LayerNormalization", &LayerNormalizationLayer::from_config},
      {"Add", of_kind<ElementwiseMergeLayer>(Merge::Add)},
      {"Subtract", of_kind<ElementwiseMergeLayer>(Merge::Subtract)},
      {"Multiply", of_kind<ElementwiseMergeLayer>(Merge::Multiply)},
      {"Average", of_kind<ElementwiseMergeLayer>(Merge::Average)},
      {"Maximum", of_kind<ElementwiseMergeLayer>(Merge::Maximum)},
      {"Minimum", of_kind<ElementwiseMergeLayer>(Merge::Minimum)},
      {"Concatenate", &ConcatenateLayer::from_config},
      {"Dot", &DotLayer::from_config},
      {"MultiHeadAttention", &MultiHeadAttentionLayer::from_config},
      {"PositionEmbedding", &PositionEmbeddingLayer::from_config},
      {"RandomTranslation", &RandomTranslationLayer::from_config},
      {"RandomFlip", &RandomFlipLayer::from_config},
  };
  return table;
}

}  // namespace mixtape::layers
