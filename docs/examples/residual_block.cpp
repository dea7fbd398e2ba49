// A layer made of layers: a residual block, relu(x + Dense(Dense(x))). Its two Dense
// sublayers are made in the constructor with the layer factory, so the block tracks them:
// their weights are the block's, and a model that holds the block trains them.
#include <mixtape/mixtape.h>

#include <cstdio>
#include <vector>

namespace mt = mixtape;
namespace ml = mt::layers;

class ResidualBlock : public ml::Layer {
 public:
  explicit ResidualBlock(std::int64_t units, ml::LayerOptions options = {})
      : Layer(std::move(options)),
        hidden_(ml::Dense(units, {.activation = "relu"})),
        project_(ml::Dense(units)) {}

  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return mt::relu(x + project_(hidden_(x, ctx), ctx));
  }

 private:
  ml::LayerPtr<ml::DenseLayer> hidden_, project_;
};

int main() {
  mt::manual_seed(3);
  // Two classes: is the sum of the first four features above that of the last four?
  const mt::Tensor x = mt::normal({512, 8});
  const mt::Tensor score = mt::sum(x.slice(1, 0, 4), {1}) - mt::sum(x.slice(1, 4, 8), {1});
  const mt::Tensor y = mt::cast(mt::greater(score, mt::zeros({})), mt::kInt64);

  auto block = ml::make_layer<ResidualBlock>(16);
  mt::Sequential model({ml::Dense(16, {.activation = "relu"}), block, ml::Dense(2)});
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mt::optim::Adam({.learning_rate = 0.01}),
                 .metrics = {"accuracy"}});
  model.build_for({-1, 8});

  // 2 weights for each of the four Dense layers, two of them inside the block.
  const std::vector<mt::Variable> vars = model.trainable_variables();
  std::printf("block: %zu sublayers, %zu weights; model: %zu trainable variables\n",
              block->sublayers().size(), block->weights().size(), vars.size());
  std::vector<std::vector<float>> before;
  for (const mt::Variable& v : vars) before.push_back(v.to_vector<float>());

  const mt::History history = model.fit(x, y, {.batch_size = 64, .epochs = 10, .verbose = 0});
  const double accuracy = history.last("accuracy");

  // Every variable, those of the block's sublayers too, was trained.
  std::size_t changed = 0;
  for (std::size_t i = 0; i < vars.size(); ++i)
    if (vars[i].to_vector<float>() != before[i]) ++changed;
  std::printf("%zu of %zu variables changed; training accuracy %.3f\n", changed, vars.size(),
              accuracy);
  return vars.size() == 8 && block->weights().size() == 4 && changed == vars.size() &&
                 accuracy > 0.9
             ? 0
             : 1;
}
