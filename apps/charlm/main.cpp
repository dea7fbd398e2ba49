// mixtape-charlm: trains a character-level GPT (a decoder-only transformer over the bytes
// of a text) with mixtape and reports the validation loss in bits per character, the
// training throughput in tokens per second, and a sample of generated text.
//
// The model: token embedding + learned position embedding, N pre-LayerNorm blocks of
// causal multi-head self-attention and a GELU MLP (4x wide), each with a residual add, a
// final LayerNorm and float32 logits over the vocabulary. AdamW with decoupled weight
// decay, gradient clipping by global norm, a linear warm-up then cosine decay of the
// learning rate, and under mixed_float16 a dynamic loss scale. Batches are windows of the
// training text at offsets drawn by SplitMix64 from --seed, so that bench/charlm_reference.py
// (the same model in PyTorch) sees the same data in the same order.
//
// Characters are bytes: a UTF-8 text's multi-byte characters become several tokens. With
// no --text the corpus is Debian's fortunes (package `fortunes`): every fortune file of
// /usr/share/games/fortunes, in name order, each split 90/10 at a fortune's start (--text:
// the file split 90/10).
#include <mixtape/mixtape.h>
#include <spdlog/cfg/env.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/cli.h"
#include "common/device.h"
#include "common/files.h"
#include "common/ranks.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace fs = std::filesystem;

namespace {

using apps::real;

constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";
constexpr const char* kDefaultCorpusPackage = "fortunes";

struct Options {
  std::string text;  // empty: the fortunes corpus
  std::string device = "auto";
  std::string preset;        // empty, or gpt2-small
  double peak_tflops = 0.0;  // 0: from the table of GPUs (apps/common/device.h)
  int layers = 4;
  int heads = 4;
  std::int64_t width = 128;
  std::int64_t context = 64;
  std::int64_t batch = 32;
  std::int64_t steps = 7000;
  std::string policy = "float32";
  double learning_rate = 6e-3;
  std::int64_t warmup = 100;
  double min_lr_ratio = 0.1;  // the cosine decays to learning_rate * this
  double weight_decay = 0.1;
  double beta_2 = 0.99;
  double clip = 1.0;  // global norm; 0: none
  double dropout = 0.0;
  std::uint64_t seed = 1;
  std::int64_t eval_every = 500;
  std::int64_t eval_windows = 64;  // validation windows at the periodic evaluations
  std::int64_t log_every = 100;
  std::int64_t sample_chars = 300;
  double temperature = 0.8;
  std::int64_t top_k = 20;
  std::string save, resume, export_onnx;
  bool kernel_census = false;
  bool capture_step = false;
};

// The step a checkpoint was saved at: a whole number >= 0 (a file is untrusted input).
std::int64_t step_of(const std::string& path, const std::map<std::string, std::string>& meta) {
  const auto it = meta.find("step");
  if (it == meta.end())
    throw mt::ValueError(fmt::format("'{}' was not written by mixtape-charlm (no 'step')", path));
  std::int64_t step = -1;
  const std::string& text = it->second;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), step);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty() || step < 0)
    throw mt::ValueError(fmt::format(
        "'{}': its 'step' is \"{}\", not a whole number >= 0 (a damaged or edited file?)", path,
        text));
  return step;
}

// --- The text ---------------------------------------------------------------------------------

std::string read_file(const fs::path& path) {
  // What is not a regular file is refused before it is opened: a FIFO would wait for a
  // writer, /dev/zero never ends, a directory has no text.
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec) throw mt::IOError(fmt::format("cannot open '{}': {}", path.string(), ec.message()));
  if (st.type() != fs::file_type::regular) {
    const fs::file_type t = st.type();
    throw mt::IOError(fmt::format("cannot read '{}': it is {}, not a regular file", path.string(),
                                  t == fs::file_type::directory   ? "a directory"
                                  : t == fs::file_type::fifo      ? "a FIFO (named pipe)"
                                  : t == fs::file_type::character ? "a character device"
                                  : t == fs::file_type::block     ? "a block device"
                                  : t == fs::file_type::socket    ? "a socket"
                                                                  : "something else"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw mt::IOError(fmt::format("cannot open '{}'", path.string()));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw mt::IOError(fmt::format("cannot read '{}'", path.string()));
  return s;
}

// One file of the corpus and where its training part ends (the rest of it validates).
struct Source {
  std::string text;
  std::size_t split;
};

// The first 90% of a text trains, the rest validates.
Source split_tenth(std::string text) {
  const std::size_t split = text.size() * 9 / 10;
  return {std::move(text), split};
}

// The fortunes files (no extension: the .dat indexes and .u8 links are left out). Each file
// is split in itself, at the first fortune that starts in its last tenth (a file with none
// there trains whole), so that every file (the fortunes are grouped by theme, from computer
// jokes to Zippy the Pinhead) has the same share in training and validation: a validation
// part made of the last files by name would measure how well the model guesses the themes
// it never saw.
std::vector<Source> default_corpus() {
  const fs::path dir(kDefaultCorpus);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw mt::IOError(fmt::format(
        "no --text given and the default corpus {} is not there: install the Debian package "
        "'{}' (sudo apt-get install {}) or pass --text FILE",
        kDefaultCorpus, kDefaultCorpusPackage, kDefaultCorpusPackage));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && !e.is_symlink() && !e.path().has_extension())
      files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::vector<Source> sources;
  for (const auto& f : files) {
    std::string text = read_file(f);
    // Fortunes are separated by lines holding a single '%'.
    const std::size_t tenth = text.size() * 9 / 10;
    const std::size_t sep = tenth == 0 ? std::string::npos : text.find("\n%\n", tenth - 1);
    const std::size_t split = sep == std::string::npos ? text.size() : sep + 3;
    sources.push_back({std::move(text), split});
  }
  if (sources.empty())
    throw mt::IOError(fmt::format("the default corpus {} holds no fortune files", kDefaultCorpus));
  return sources;
}

// The length of the UTF-8 character at s[i], or 0 when the bytes there are not one: a full
// decoder (RFC 3629), refusing overlong forms (c0 af), surrogates (ed a0 80), code points
// above U+10FFFF (f4 90 80 80, f5 ...) and stray continuation bytes.
std::size_t utf8_length(const std::string& s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = byte(0);
  if (c < 0x80) return 1;
  std::size_t len = 0;
  char32_t cp = 0, min = 0;
  if ((c & 0xE0) == 0xC0) {
    len = 2, cp = c & 0x1F, min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3, cp = c & 0x0F, min = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4, cp = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    if ((byte(k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(k) & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

// Refuses what is not text: NUL bytes, or bytes that are not UTF-8.
void check_text(const std::string& s, const std::string& what) {
  if (s.empty()) throw mt::ValueError(fmt::format("{} is empty", what));
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t len = c == 0 ? 0 : utf8_length(s, i);
    if (len == 0)
      throw mt::ValueError(fmt::format(
          "{} is not a text file (UTF-8 or ASCII): byte {} (0x{:02x}) at offset {} {}", what,
          static_cast<int>(c), static_cast<int>(c), i,
          c == 0 ? "is NUL"
                 : "does not start a valid UTF-8 character (an invalid lead or continuation "
                   "byte, an overlong form, a surrogate or a code point above U+10FFFF)"));
    i += len;
  }
}

struct Corpus {
  std::vector<unsigned char> vocab;      // id -> byte
  std::vector<std::int64_t> id_of_byte;  // byte -> id, -1 when absent
  std::vector<std::int64_t> train, val;  // ids
};

Corpus make_corpus(const std::vector<Source>& sources, std::int64_t context,
                   const std::string& what) {
  std::size_t n = 0;
  for (const auto& src : sources) n += src.text.size();
  std::string text;
  text.reserve(n);
  for (const auto& src : sources) text += src.text;
  check_text(text, what);
  Corpus c;
  c.id_of_byte.assign(256, -1);
  std::vector<bool> seen(256, false);
  for (unsigned char ch : text) seen[ch] = true;
  for (int b = 0; b < 256; ++b)
    if (seen[static_cast<std::size_t>(b)]) {
      c.id_of_byte[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(c.vocab.size());
      c.vocab.push_back(static_cast<unsigned char>(b));
    }
  if (c.vocab.size() < 2)
    throw mt::ValueError(
        fmt::format("{} has a vocabulary of one character ('{}'): there is nothing to predict",
                    what, static_cast<char>(c.vocab.front())));
  for (const auto& src : sources)
    for (std::size_t i = 0; i < src.text.size(); ++i)
      (i < src.split ? c.train : c.val)
          .push_back(c.id_of_byte[static_cast<unsigned char>(src.text[i])]);
  const auto train = static_cast<std::int64_t>(c.train.size()),
             val = static_cast<std::int64_t>(c.val.size());
  if (train < context + 2 || val < context + 2)
    throw mt::ValueError(fmt::format(
        "{} is too short: {} bytes give {} training and {} validation bytes, each of which "
        "must exceed the context ({}) + 1",
        what, n, train, val, context));
  return c;
}

// The vocabulary as a metadata value (hex bytes) and back.
std::string vocab_hex(const std::vector<unsigned char>& v) {
  std::string s;
  for (unsigned char b : v) s += fmt::format("{:02x}", static_cast<int>(b));
  return s;
}

// --- Batches ---------------------------------------------------------------------------------

// SplitMix64: the offsets of the training windows (bench/charlm_reference.py draws the same).
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
};

// Inputs [batch, context] and targets (the next byte of each) from windows at `offsets` of
// `data` (the ids, on the model's device): gathered there, only the positions come from the
// host.
std::pair<mt::Tensor, mt::Tensor> windows(const mt::Tensor& data,
                                          const std::vector<std::int64_t>& offsets,
                                          std::int64_t context) {
  const auto b = static_cast<std::int64_t>(offsets.size());
  std::vector<std::int64_t> at(static_cast<std::size_t>(b * context));
  for (std::int64_t i = 0; i < b; ++i)
    for (std::int64_t t = 0; t < context; ++t)
      at[static_cast<std::size_t>(i * context + t)] = offsets[static_cast<std::size_t>(i)] + t;
  std::vector<std::int64_t> next(at);
  for (auto& p : next) ++p;
  return {mt::take(data, mt::from_vector(at, {b, context}), 0),
          mt::take(data, mt::from_vector(next, {b, context}), 0)};
}

// --- The model -------------------------------------------------------------------------------

std::shared_ptr<mt::Model> make_model(const Options& o, std::int64_t vocab) {
  const auto normal = mt::init::random_normal(0.0, 0.02);
  auto ids = ml::Input({o.context}, {.dtype = mt::kInt64, .name = "ids"});
  auto tokens = ml::Embedding(vocab, o.width,
                              {.embeddings_initializer = normal, .name = "token_embedding"})(ids);
  auto positions = ml::PositionEmbedding(
      o.context, {.initializer = normal, .name = "position_embedding"})(tokens);
  auto h = ml::Add({.name = "embed"})({tokens, positions});
  for (int i = 0; i < o.layers; ++i) {
    const std::string p = fmt::format("block{}_", i);
    auto a = ml::LayerNormalization({.epsilon = 1e-5, .name = p + "ln1"})(h);
    a = ml::MultiHeadAttention(o.heads, o.width / o.heads,
                               {.dropout = o.dropout,
                                .use_causal_mask = true,
                                .kernel_initializer = normal,
                                .name = p + "attention"})({a, a});
    h = ml::Add({.name = p + "residual1"})({h, a});
    auto m = ml::LayerNormalization({.epsilon = 1e-5, .name = p + "ln2"})(h);
    m = ml::Dense(4 * o.width,
                  {.activation = "gelu", .kernel_initializer = normal, .name = p + "mlp_in"})(m);
    m = ml::Dense(o.width, {.kernel_initializer = normal, .name = p + "mlp_out"})(m);
    h = ml::Add({.name = p + "residual2"})({h, m});
  }
  h = ml::LayerNormalization({.epsilon = 1e-5, .name = "ln_final"})(h);
  // float32 logits under every policy (the softmax cross-entropy reads them).
  auto logits =
      ml::Dense(vocab, {.kernel_initializer = normal, .dtype = "float32", .name = "logits"})(h);
  return std::make_shared<mt::Model>(ids, logits, mt::ModelOptions{.name = "charlm"});
}

// Warm-up from lr/warmup to lr over `warmup` steps, then cosine decay to lr * min_ratio at
// `steps` (the same schedule as the PyTorch reference; step counts applied updates).
mt::optim::LearningRate schedule(const Options& o) {
  const double lr = o.learning_rate, floor = o.learning_rate * o.min_lr_ratio;
  const std::int64_t warmup = o.warmup, steps = o.steps;
  // The name holds the numbers: the ranks of a data-parallel run compare it (compile).
  const std::string name = fmt::format("warmup_cosine(peak {}, warmup {}, steps {}, floor {})", lr,
                                       warmup, steps, floor);
  return mt::optim::LearningRate(name, [=](std::int64_t step) {
    if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
    const double span = static_cast<double>(std::max<std::int64_t>(steps - warmup, 1));
    const double t = std::min(1.0, static_cast<double>(step - warmup) / span);
    return floor + (lr - floor) * 0.5 * (1.0 + std::cos(M_PI * t));
  });
}

// --- Evaluation and sampling ------------------------------------------------------------------

// The mean cross-entropy in bits per character over up to `max_windows` non-overlapping
// windows of `data` (ids on the model's device; all windows when max_windows is 0).
double bits_per_char(mt::Model& model, const mt::Tensor& data, std::int64_t context,
                     std::int64_t batch, std::int64_t max_windows) {
  std::vector<std::int64_t> offsets;
  for (std::int64_t o = 0; o + context + 1 <= data.dim(0); o += context) offsets.push_back(o);
  if (max_windows > 0 && static_cast<std::int64_t>(offsets.size()) > max_windows)
    offsets.resize(static_cast<std::size_t>(max_windows));
  const auto loss = mt::losses::SparseCategoricalCrossentropy(
      {.from_logits = true, .reduction = mt::losses::Reduction::Sum});
  // Data-parallel: each rank scores its share of the windows; the sums are added up.
  const std::size_t n = offsets.size();
  const auto [begin, end] = mt::distributed::shard(static_cast<std::int64_t>(n));
  const auto first = static_cast<std::size_t>(begin), last = static_cast<std::size_t>(end);
  // The sum stays on the device (float64, in the order the host would add) and is read once.
  mt::NoGradGuard no_grad;
  mt::Tensor sum = mt::zeros({}, mt::kFloat64, data.device());
  for (std::size_t i = first; i < last; i += static_cast<std::size_t>(batch)) {
    const std::vector<std::int64_t> part(
        offsets.begin() + static_cast<std::ptrdiff_t>(i),
        offsets.begin() +
            static_cast<std::ptrdiff_t>(std::min(last, i + static_cast<std::size_t>(batch))));
    auto [x, y] = windows(data, part, context);
    const mt::Tensor logits = model(x);
    const std::int64_t v = logits.dim(2);
    sum = sum + mt::cast(loss(mt::reshape(y, {-1}), mt::reshape(logits, {-1, v})), mt::kFloat64);
  }
  const double total = mt::distributed::all_reduce_value(sum.item<double>());
  return total / static_cast<double>(offsets.size() * static_cast<std::size_t>(context)) /
         std::log(2.0);
}

// `count` bytes generated after the first `context` bytes of `prompt`, each from the last
// context bytes (temperature, then the top_k most likely).
std::string sample(mt::Model& model, const Corpus& c, const std::vector<std::int64_t>& prompt,
                   std::int64_t context, std::int64_t count, double temperature, std::int64_t top_k,
                   std::uint64_t seed) {
  std::vector<std::int64_t> window(prompt.begin(), prompt.begin() + context);
  std::mt19937_64 rng(seed);
  std::string out;
  for (std::int64_t i = 0; i < count; ++i) {
    const mt::Tensor logits = model(mt::from_vector(window, {1, context}).to(model.device()));
    const auto v = logits.dim(2);
    std::vector<double> row = mt::slice(logits, 1, context - 1, context).to_vector<double>();
    std::vector<std::int64_t> order(static_cast<std::size_t>(v));
    for (std::int64_t j = 0; j < v; ++j) order[static_cast<std::size_t>(j)] = j;
    const std::int64_t k = top_k > 0 ? std::min(top_k, v) : v;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](auto a, auto b) {
      return row[static_cast<std::size_t>(a)] > row[static_cast<std::size_t>(b)];
    });
    std::vector<double> w(static_cast<std::size_t>(k));
    const double top = row[static_cast<std::size_t>(order[0])];
    for (std::int64_t j = 0; j < k; ++j)
      w[static_cast<std::size_t>(j)] = std::exp(
          (row[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])] - top) / temperature);
    std::discrete_distribution<std::int64_t> pick(w.begin(), w.end());
    const std::int64_t id = order[static_cast<std::size_t>(pick(rng))];
    out.push_back(static_cast<char>(c.vocab[static_cast<std::size_t>(id)]));
    window.erase(window.begin());
    window.push_back(id);
  }
  return out;
}

// --- Training ---------------------------------------------------------------------------------

// The model the options describe, new, or read from --resume and checked against them
// (its architecture, this text's vocabulary, the policy); compiled with AdamW (compile puts
// it in the chain the policy and the job need: a LossScaleOptimizer under mixed_float16, a
// DistributedOptimizer under mpirun). Returns the model and the step to go on from.
std::pair<std::shared_ptr<mt::Model>, std::int64_t> make_or_resume(const Options& o,
                                                                   const Corpus& corpus,
                                                                   mt::Device device) {
  std::shared_ptr<mt::Model> model =
      o.resume.empty() ? make_model(o, static_cast<std::int64_t>(corpus.vocab.size()))
                       : mt::load_model(o.resume);
  model->to(device);  // before compile: the optimizer's slots are made where the weights are
  model->compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                  .optimizer = mt::optim::AdamW(
                      {.learning_rate = schedule(o),
                       .weight_decay = o.weight_decay,
                       .beta_1 = 0.9,
                       .beta_2 = o.beta_2,
                       .epsilon = 1e-8,
                       .clipping = o.clip > 0 ? mt::optim::Clipping{.global_clipnorm = o.clip}
                                              : mt::optim::Clipping{}})});
  if (o.resume.empty()) return {model, 0};
  const auto meta = mt::load_checkpoint(o.resume, *model, *model->optimizer()).metadata;
  const auto want = [&](const char* key, const std::string& value) {
    const auto it = meta.find(key);
    if (it == meta.end())
      throw mt::ValueError(
          fmt::format("'{}' was not written by mixtape-charlm (no '{}')", o.resume, key));
    if (it->second != value)
      throw mt::ValueError(fmt::format(
          "'{}' holds a model with {} {}, but this run has {} {} (give the same options, or "
          "the same --text, as the run that saved it)",
          o.resume, key, it->second, key, value));
  };
  want("layers", std::to_string(o.layers));
  want("heads", std::to_string(o.heads));
  want("width", std::to_string(o.width));
  want("context", std::to_string(o.context));
  want("vocabulary", vocab_hex(corpus.vocab));
  want("policy", o.policy);
  return {model, step_of(o.resume, meta)};
}

// The windows of each step, drawn from one SplitMix64 stream (as the PyTorch reference
// draws them): the whole batch's offsets on every rank, then this rank's share.
class Batches {
 public:
  Batches(const mt::Tensor& train, const Options& o, std::uint64_t seed, std::int64_t first_step)
      : data_(train), batch_(o.batch), context_(o.context), rng_{seed} {
    // Draws of the steps already done (resume): the data order continues where it stopped.
    for (std::int64_t s = 0; s < first_step * o.batch; ++s) rng_.next();
  }
  // This rank's inputs and targets for the next step, and its share of the batch.
  std::tuple<mt::Tensor, mt::Tensor, double> next() {
    const auto span =
        static_cast<std::uint64_t>(data_.dim(0)) - static_cast<std::uint64_t>(context_);
    std::vector<std::int64_t> offsets(static_cast<std::size_t>(batch_));
    for (auto& off : offsets) off = static_cast<std::int64_t>(rng_.next() % span);
    const auto [w0, w1] = mt::distributed::shard(batch_);
    auto [x, y] = windows(data_, {offsets.begin() + w0, offsets.begin() + w1}, context_);
    return {x, y, static_cast<double>(w1 - w0) / static_cast<double>(batch_)};
  }

 private:
  mt::Tensor data_;
  std::int64_t batch_, context_;
  SplitMix64 rng_;
};

// The ids of the text on the model's device: the batches and the evaluation gather there.
struct Ids {
  mt::Tensor train, val;
};

// What the run prints: a progress line every --log-every steps (the mean loss of the window,
// the learning rate, tokens/s over the steps after the first and the model FLOP utilisation
// when the devices' peak is known), and the totals.
struct Progress {
  double flops_per_token = 0;        // 6N + 6LCT: llm.c's count (weights and attention)
  std::optional<double> peak_flops;  // of all ranks' devices together, FLOP/s
  double train_seconds = 0;
  std::int64_t trained_tokens = 0, skipped_after_100 = 0;
  // The window's losses (each rank's weighted by its share), summed on the device in float64
  // and read at the window's progress line: a step reads nothing back.
  mt::Tensor window_loss;
  std::int64_t window_steps = 0;
  void add(const mt::Tensor& loss, double share) {
    mt::NoGradGuard no_grad;
    mt::Tensor l = mt::cast(loss, mt::kFloat64);
    if (share != 1.0) l = l * share;  // one rank: no multiply
    window_loss = window_loss.defined() ? window_loss + l : l;
    ++window_steps;
  }
  double tokens_per_second() const {
    return train_seconds > 0 ? static_cast<double>(trained_tokens) / train_seconds : 0.0;
  }
  // "12345 tokens/s  MFU 38.1%" (no MFU without a peak).
  std::string rate() const {
    std::string out = fmt::format("{:.0f} tokens/s", tokens_per_second());
    if (peak_flops)
      out +=
          fmt::format("  MFU {:.1f}%", 100.0 * tokens_per_second() * flops_per_token / *peak_flops);
    return out;
  }
  // The window's mean loss over all ranks, in nats (a read: it waits for the window's steps).
  // Every rank calls it. Without loss scaling a non-finite loss means the model diverged
  // (with it, such steps are skipped and the scale lowered).
  double take_window_loss(std::int64_t step, bool loss_scaled) {
    const double sum = mt::distributed::all_reduce_value(window_loss.item<double>());
    const double mean = sum / static_cast<double>(window_steps);
    if (!std::isfinite(mean) && !loss_scaled)
      throw mt::NumericError(fmt::format("the loss is {} in steps {} to {}: the model diverged",
                                         mean, step - window_steps + 1, step));
    window_loss = mt::Tensor();
    window_steps = 0;
    return mean;
  }
  void log(std::int64_t step, double mean_loss, const mt::optim::Optimizer& chain) const {
    const mt::optim::LossScaleOptimizer* lso = chain.loss_scale_optimizer();
    fmt::print(
        "step {:>6}  loss {:.4f} bits/char  lr {:.3g}  {}{}\n", step, mean_loss / std::log(2.0),
        chain.current_learning_rate(), rate(),
        lso ? fmt::format("  loss scale {:g} (skipped {})", lso->loss_scale(), lso->skipped_steps())
            : "");
    std::fflush(stdout);
  }
};

// One training step: forward, loss, the chain's gradients and update. Whatever the chain
// holds (loss scaling, the reduction across ranks) happens inside compute_gradients and
// apply_gradients.
mt::Tensor train_step(mt::Model& model, mt::optim::Optimizer& chain,
                      const std::vector<mt::Variable>& vars, const mt::Tensor& x,
                      const mt::Tensor& y) {
  const auto loss_object = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  mt::GradientTape tape;
  const mt::Tensor logits = model(x, {.training = true});
  const mt::Tensor loss =
      loss_object(mt::reshape(y, {-1}), mt::reshape(logits, {-1, logits.dim(2)}));
  chain.apply_gradients(chain.compute_gradients(tape, loss, vars), vars);
  return loss;
}

// The steps first_step .. --steps - 1, with the progress lines and periodic validation.
// A steady-state step waits for nothing on the device: the losses are summed there and read
// at the progress lines, and the finiteness flag (the loss scale optimizer's, or on a GPU the
// optimizer's own) is read a step late, so the host queues the next step while the device
// runs this one. The clock runs from the
// end of the first step (which builds and warms up) and stops at the progress lines and
// around the evaluations, each time after the device has caught up.
Progress train(mt::Model& model, const Options& o, const Ids& ids, std::uint64_t seed,
               std::int64_t first_step, Progress p) {
  const bool root = mt::distributed::is_root();
  mt::optim::Optimizer& chain = *model.optimizer();
  mt::optim::DistributedOptimizer* dopt = chain.distributed_optimizer();
  const mt::optim::LossScaleOptimizer* lso = chain.loss_scale_optimizer();
  const std::vector<mt::Variable> vars = model.trainable_variables();
  const mt::Device device = ids.train.device();
  const auto wait_for_device = [&] { mt::backend_for(device.type()).synchronize(device.index()); };
  Batches batches(ids.train, o, seed, first_step);
  std::optional<std::int64_t> skipped_before_100;  // the count before step 100 of this run
  auto clock = std::chrono::steady_clock::now();
  const auto stop_clock = [&] {
    wait_for_device();
    p.train_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - clock).count();
  };
  // --kernel-census: the second step of the run (the first builds), or the only one.
  const std::int64_t census_step = std::min(first_step + 1, o.steps - 1);
  // --capture-step: the first step runs and captures the step, the others replay it with their
  // batch copied where the captured one read it.
  mt::StepGraph graph;
  mt::Variable step_x, step_y;
  mt::Tensor step_loss;
  const auto run_step = [&](const mt::Tensor& x, const mt::Tensor& y) {
    if (!o.capture_step) return train_step(model, chain, vars, x, y);
    if (graph.empty()) {  // the warm-up step's loss; the captured one's after each replay
      step_x = mt::Variable(x, "x", /*trainable=*/false);
      step_y = mt::Variable(y, "y", /*trainable=*/false);
      mt::Tensor warmup_loss;
      graph = mt::StepGraph::capture(device, [&] {
        (mt::capture::active() ? step_loss : warmup_loss) =
            train_step(model, chain, vars, step_x, step_y);
      });
      return warmup_loss;
    }
    step_x.assign(x);
    step_y.assign(y);
    graph.replay();
    return step_loss;
  };
  for (std::int64_t step = first_step; step < o.steps; ++step) {
    if (lso && step == std::max<std::int64_t>(first_step, 100))
      skipped_before_100 = lso->skipped_steps();
    std::optional<mt::KernelCensus> census;
    if (o.kernel_census && step == census_step) census.emplace();
    // The census step is also the range a profiler told to record only such ranges records
    // (on a GPU: `ncu --profile-from-start off` times this step's kernels alone).
    if (census) mt::backend_for(device.type()).profiler_range(device.index(), true);
    const auto [x, y, share] = batches.next();
    if (dopt) dopt->set_gradient_weight(share);
    p.add(run_step(x, y), share);
    if (census) mt::backend_for(device.type()).profiler_range(device.index(), false);
    if (census && root)
      fmt::print("kernels dispatched by step {} ({} variables):\n{}", step + 1, vars.size(),
                 census->table());
    census.reset();
    if (step == first_step) {
      wait_for_device();
      clock = std::chrono::steady_clock::now();
    } else {
      p.trained_tokens += o.batch * o.context;
    }
    const bool line = (step + 1) % o.log_every == 0 || step + 1 == o.steps;
    const bool eval = o.eval_every > 0 && (step + 1) % o.eval_every == 0 && step + 1 != o.steps;
    if (!line && !eval) continue;
    if (step > first_step) stop_clock();
    // The finiteness checks read behind their steps (a step with a NaN or infinite gradient
    // changed nothing; this names it), the last step's included.
    chain.check_pending();
    if (line) {
      const double mean = p.take_window_loss(step + 1, lso != nullptr);
      if (root) p.log(step + 1, mean, chain);
    }
    if (eval) {
      const double v = bits_per_char(model, ids.val, o.context, o.batch, o.eval_windows);
      if (root)
        fmt::print("step {:>6}  validation {:.4f} bits/char ({} windows)\n", step + 1, v,
                   o.eval_windows);
      std::fflush(stdout);
    }
    clock = std::chrono::steady_clock::now();
  }
  if (skipped_before_100) p.skipped_after_100 = lso->skipped_steps() - *skipped_before_100;
  return p;
}

// What every rank must agree on to take the same steps (the seed need not: rank 0's wins),
// for distributed::check_same_on_all_ranks: the text (its sizes and an FNV-1a digest of its
// ids), the model, the optimizer and the schedule.
std::string run_description(const Options& o, const Corpus& corpus) {
  std::uint64_t digest = 1469598103934665603ULL;
  for (const auto* ids : {&corpus.train, &corpus.val})
    for (const std::int64_t id : *ids)
      digest = (digest ^ static_cast<std::uint64_t>(id)) * 1099511628211ULL;
  return fmt::format(
      "text of {} + {} bytes (digest {:016x}), vocabulary {}; {} layers, {} heads, width {}, "
      "context {}, policy {}, dropout {}; batch {}, steps {}, lr {}, warmup {}, min lr ratio {}, "
      "weight decay {}, beta_2 {}, clip {}; evaluation every {} steps on {} windows, a line "
      "every {}; resume '{}'",
      corpus.train.size(), corpus.val.size(), digest, corpus.vocab.size(), o.layers, o.heads,
      o.width, o.context, o.policy, o.dropout, o.batch, o.steps, o.learning_rate, o.warmup,
      o.min_lr_ratio, o.weight_decay, o.beta_2, o.clip, o.eval_every, o.eval_windows, o.log_every,
      o.resume);
}

int run(const Options& o) {
  // Data-parallel under mpirun: every rank draws the same windows and trains on its share
  // of each batch; rank 0 alone prints and writes.
  mt::distributed::init();
  const bool root = mt::distributed::is_root();
  const std::uint64_t seed = apps::rank0_seed(o.seed);
  if (o.batch < mt::distributed::world_size())
    throw mt::ValueError(fmt::format(
        "--batch {} is smaller than the {} ranks: the batch is the global one, split across "
        "the ranks",
        o.batch, mt::distributed::world_size()));
  if (o.capture_step && mt::distributed::world_size() > 1)
    throw mt::ValueError(fmt::format(
        "--capture-step: a captured step cannot replay the reductions across the {} ranks",
        mt::distributed::world_size()));
  if (o.width % o.heads != 0)
    throw mt::ValueError(
        fmt::format("--width {} is not a multiple of --heads {}", o.width, o.heads));
  // The files written at the end, checked before anything is trained.
  if (!o.save.empty()) apps::check_writable("--save", o.save, /*in_place=*/false);
  if (!o.export_onnx.empty())
    apps::check_writable("--export-onnx", o.export_onnx, /*in_place=*/false);
  const mt::Device device = apps::pick_device(o.device);
  const std::string what = o.text.empty() ? std::string(kDefaultCorpus) : "'" + o.text + "'";
  const Corpus corpus =
      make_corpus(o.text.empty() ? default_corpus() : std::vector{split_tenth(read_file(o.text))},
                  o.context, what);
  mt::distributed::check_same_on_all_ranks("the ranks were given different text or options",
                                           run_description(o, corpus));
  if (root)
    fmt::print("corpus {}: {} training and {} validation bytes, vocabulary {}\n", what,
               corpus.train.size(), corpus.val.size(), corpus.vocab.size());

  mt::set_global_policy(o.policy);
  mt::manual_seed(seed);
  const auto [model, first_step] = make_or_resume(o, corpus, device);
  const Ids ids{
      mt::from_vector(corpus.train, {static_cast<std::int64_t>(corpus.train.size())}).to(device),
      mt::from_vector(corpus.val, {static_cast<std::int64_t>(corpus.val.size())}).to(device)};
  if (root && !o.resume.empty()) fmt::print("resumed from {} at step {}\n", o.resume, first_step);
  Progress start;
  // N: the trainable parameters (not mixed_float8_delayed's amax histories, which no product
  // multiplies).
  std::int64_t trainable = 0;
  for (const auto& v : model->trainable_variables()) trainable += v.numel();
  start.flops_per_token = 6.0 * static_cast<double>(trainable) +
                          6.0 * o.layers * static_cast<double>(o.width * o.context);
  const std::optional<double> peak =
      o.peak_tflops > 0
          ? std::optional<double>(o.peak_tflops)
          : apps::peak_tflops(mt::backend_for(device.type()).properties(device.index()),
                              mt::Policy(o.policy).compute_dtype());
  if (peak) start.peak_flops = *peak * 1e12 * mt::distributed::world_size();
  if (root)
    fmt::print(
        "model: {} layers, {} heads, width {}, context {}, {} parameters; policy {}; device {}{}\n",
        o.layers, o.heads, o.width, o.context, model->count_params(), o.policy, device,
        peak ? fmt::format(" (MFU against {:g} TFLOP/s{})", *peak,
                           mt::distributed::world_size() > 1 ? " per rank" : "")
             : "");

  const Progress p = train(*model, o, ids, seed, first_step, start);
  // The most the tensors held at once on the device, the model and the corpus included, and
  // the most the backend's caching allocator held for them.
  const mt::MemoryStats memory = mt::memory_stats(device);

  const double val = bits_per_char(*model, ids.val, o.context, o.batch, 0);
  if (!root) return 0;
  fmt::print("validation loss {:.4f} bits/char after {} steps ({} tokens)\n", val, o.steps,
             corpus.val.size());
  if (p.trained_tokens > 0)
    fmt::print("training throughput {} ({:.1f} s of steps)\n", p.rate(), p.train_seconds);
  fmt::print("peak tensor memory {:.1f} MiB (reserved {:.1f} MiB)\n",
             static_cast<double>(memory.peak) / (1 << 20),
             static_cast<double>(memory.peak_reserved) / (1 << 20));
  if (const mt::optim::LossScaleOptimizer* lso = model->optimizer()->loss_scale_optimizer())
    fmt::print("loss scale {:g}; skipped steps {} ({} after step 100)\n", lso->loss_scale(),
               lso->skipped_steps(), p.skipped_after_100);
  if (o.sample_chars > 0)
    fmt::print("sample (temperature {}, top-k {}):\n{}\n", o.temperature, o.top_k,
               sample(*model, corpus, corpus.val, o.context, o.sample_chars, o.temperature, o.top_k,
                      seed));
  if (!o.save.empty()) {
    model->save(o.save, {.metadata = {{"layers", std::to_string(o.layers)},
                                      {"heads", std::to_string(o.heads)},
                                      {"width", std::to_string(o.width)},
                                      {"context", std::to_string(o.context)},
                                      {"vocabulary", vocab_hex(corpus.vocab)},
                                      {"policy", o.policy},
                                      {"step", std::to_string(o.steps)}}});
    fmt::print("saved to {}\n", o.save);
  }
  if (!o.export_onnx.empty()) {
    // The ids are the vocabulary's indices: the file says which byte each one is.
    mt::export_onnx(*model, o.export_onnx,
                    {.metadata = {{"vocabulary", vocab_hex(corpus.vocab)},
                                  {"context", std::to_string(o.context)}}});
    fmt::print("ONNX model (opset 17) written to {}\n", o.export_onnx);
  }
  return 0;
}

void add_options(CLI::App& app, Options& o) {
  app.add_option("--text", o.text, "UTF-8 or ASCII text to train on (default: the fortunes)");
  app.add_option("--device", o.device,
                 "auto (default: cuda when a GPU is present), cpu, cuda (under mpirun: the GPU "
                 "of the rank's place on its machine), cuda:N");
  app.add_option("--preset", o.preset,
                 "gpt2-small: 12 layers, width 768, 12 heads, context 1024 (GPT-2 small's body)")
      ->check(apps::one_of("preset", {"gpt2-small"}));
  app.add_option("--peak-tflops", o.peak_tflops,
                 "the device's peak TFLOP/s for the model FLOP utilisation (default: from a "
                 "table of GPUs; none for a CPU)")
      ->transform(real(0.0, 1e6));
  app.add_option("--layers", o.layers, "transformer blocks")->check(CLI::Range(1, 64));
  app.add_option("--heads", o.heads, "attention heads")->check(CLI::Range(1, 64));
  app.add_option("--width", o.width, "model width")->check(CLI::Range(1, 8192));
  app.add_option("--context", o.context, "context length (bytes)")->check(CLI::Range(1, 8192));
  app.add_option("--batch", o.batch, "windows per step")->check(CLI::Range(1, 65536));
  app.add_option("--steps", o.steps, "training steps")->check(CLI::Range(1, 100000000));
  app.add_option("--policy", o.policy,
                 "dtype policy: float32, mixed_bfloat16, mixed_float16, mixed_float8, ...")
      ->check([](const std::string& v) -> std::string {
        try {
          mt::Policy check(v);
        } catch (const mt::ValueError& e) {
          return e.what();
        }
        return {};
      });
  app.add_option("--lr", o.learning_rate, "peak learning rate")->transform(real(0.0, 10.0));
  app.add_option("--warmup", o.warmup, "linear warm-up steps")->check(CLI::Range(0, 100000000));
  app.add_option("--min-lr-ratio", o.min_lr_ratio, "the cosine's final learning rate / peak")
      ->transform(real(0.0, 1.0));
  app.add_option("--weight-decay", o.weight_decay, "AdamW's decoupled weight decay")
      ->transform(real(0.0, 1.0));
  app.add_option("--beta2", o.beta_2, "AdamW's beta_2")->transform(real(0.0, 0.999999));
  app.add_option("--clip", o.clip, "clip the gradients to this global norm (0: no clipping)")
      ->transform(real(0.0, 1e6));
  app.add_option("--dropout", o.dropout, "dropout on the attention weights")
      ->transform(real(0.0, 0.99));
  app.add_option("--seed", o.seed, "initial weights, data order and sampling");
  app.add_option("--eval-every", o.eval_every, "steps between validation estimates (0: none)")
      ->check(CLI::Range(0, 100000000));
  app.add_option("--eval-windows", o.eval_windows, "validation windows of those estimates")
      ->check(CLI::Range(1, 100000000));
  app.add_option("--log-every", o.log_every, "steps between progress lines")
      ->check(CLI::Range(1, 100000000));
  app.add_option("--sample", o.sample_chars, "bytes of text to generate at the end")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--temperature", o.temperature, "sampling temperature")
      ->transform(real(0.01, 100.0));
  app.add_option("--top-k", o.top_k, "sample among the k most likely (0: all)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--save", o.save, "write the model and optimizer state here at the end");
  app.add_option("--resume", o.resume, "continue from a file written by --save");
  app.add_option("--export-onnx", o.export_onnx,
                 "write the trained model to this file as ONNX (opset 17) at the end");
  app.add_flag("--kernel-census", o.kernel_census,
               "print the kernels one steady-state step dispatches, per op (a host-side "
               "profile: on a GPU each is at least one launch), and mark that step for a "
               "profiler (cudaProfilerStart/Stop: ncu --profile-from-start off)");
  app.add_flag(
      "--capture-step", o.capture_step,
      "capture the training step once and replay it (a CUDA graph on a GPU): one "
      "launch of host work per step (dropout draws a new mask each replay); not with several "
      "processes");
}

// --preset: the shape it names, in the options it sets; an option given with another value
// contradicts it (a CLI error naming both).
void apply_preset(const CLI::App& app, Options& o) {
  if (o.preset != "gpt2-small") return;
  const auto set = [&](const char* flag, auto& field, std::int64_t value) {
    if (app.count(flag) > 0 && static_cast<std::int64_t>(field) != value)
      throw CLI::ValidationError(
          flag, fmt::format("{} contradicts --preset {}, which has {} {} (leave one of them out)",
                            field, o.preset, flag, value));
    field = static_cast<std::remove_reference_t<decltype(field)>>(value);
  };
  set("--layers", o.layers, 12);
  set("--width", o.width, 768);
  set("--heads", o.heads, 12);
  set("--context", o.context, 1024);
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::cfg::load_env_levels();  // SPDLOG_LEVEL=debug: the library's debug log too
  Options options;
  CLI::App app("Trains a character-level GPT on a text with mixtape.", "mixtape-charlm");
  try {
    add_options(app, options);
    app.parse(argc, argv);
    apply_preset(app, options);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "mixtape-charlm: %s (see --help)\n", e.what());
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    // Under mpirun the other ranks may be waiting for this one: end them all.
    if (mt::distributed::world_size() > 1)
      mt::distributed::abort(1, fmt::format("mixtape-charlm: error on rank {}: {}",
                                            mt::distributed::rank(), e.what()));
    std::fprintf(stderr, "mixtape-charlm: error: %s\n", e.what());
    return 1;
  }
}
