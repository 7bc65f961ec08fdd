// spectral-cond: what the analysis reads beside the weights (docs/checkpoints.md): the head
// counts, the inputs X of the Jacobian analysis, RoPE and the biases of a layer (MATH.md §8, §10).
#pragma once

#include "analysis_types.hpp"
#include "inputs.hpp"

#include <spectral_cond/io/checkpoint.hpp>
#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/files.hpp>
#include <spectral_cond/io/layouts/attention_config.hpp>
#include <spectral_cond/io/paths.hpp>

#include <sys/stat.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace spectral_cond::engine {

/// Whether the checkpoint has a config.json beside it. Something there that is not a regular
/// file (a FIFO, a device such as a link to /dev/zero, a directory, a dangling link) is refused
/// with its name, never silently ignored: the head counts and RoPE would otherwise come from
/// elsewhere without a word.
inline bool has_config(const std::string& cfg) {
  struct stat st {};
  if (::lstat(cfg.c_str(), &st) != 0) return false;  // absent
  if (::stat(cfg.c_str(), &st) != 0)
    throw io::IoError(cfg +
                      ": a symbolic link to nothing; config.json beside a checkpoint must "
                      "be a regular JSON file (or absent)");
  if (!S_ISREG(st.st_mode))
    throw io::IoError(cfg + ": " + io::file_kind(st.st_mode) +
                      " where config.json must be a regular JSON file (or absent)");
  return true;
}

/// The head counts of a checkpoint: config.json beside it (when there is one), with --heads and
/// --kv-heads (0: not given) taking precedence. --heads alone keeps config.json's key/value head
/// count, as --help says; `source` names where each number came from.
inline io::HeadConfig head_config(const CheckpointReader& src, std::int64_t heads,
                                  std::int64_t kv_heads) {
  io::HeadConfig hc;
  const std::string cfg = io::join_path(src.directory(), "config.json");
  if (has_config(cfg)) {
    hc = io::read_head_config(cfg);
  } else if (const io::GgufFile* g = src.gguf()) {  // <arch>.attention.head_count, ...
    const std::string arch = g->get_string("general.architecture").value_or("");
    hc.heads = g->get_int(arch + ".attention.head_count").value_or(0);
    hc.kv_heads = g->get_int(arch + ".attention.head_count_kv").value_or(0);
    hc.hidden = g->get_int(arch + ".embedding_length").value_or(0);
    if (hc.heads > 0) hc.source = g->path() + " (GGUF metadata)";
  }
  if (heads > 0) {
    const bool kv_from_config = kv_heads == 0 && hc.kv_heads > 0;
    hc.heads = heads;
    hc.source = kv_from_config ? "--heads and the kv heads of " + hc.source : "--heads";
    if (!kv_from_config) hc.kv_heads = 0;
  }
  if (kv_heads > 0) hc.kv_heads = kv_heads;
  return hc;
}

/// The inputs X of the Jacobian analysis (--inputs; docs/checkpoints.md): one N x D .npy for
/// every layer, or one X per layer in an .npz or a folder of .npy files, keyed by the layer's
/// index ("3", "layer_3", "layer.3") or its prefix ("blocks.3.attn.", with or without the last
/// dot). Each X is checked finite and 2-D when it is read.
class LayerInputs {
 public:
  explicit LayerInputs(const std::string& path) : path_(path) {
    if (path.empty()) return;
    struct stat st {};
    const bool dir = ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    if (dir || io::has_suffix(path, ".npz")) {
      per_layer_ = std::make_unique<io::CheckpointReader>(path);
      const auto f = per_layer_->format();
      if (f != CheckpointFormat::Npz && f != CheckpointFormat::NpyDir)
        throw BadInput(path +
                       ": --inputs: expected an .npy file, an .npz or a folder of .npy "
                       "files (one X per layer), found " +
                       to_string(f));
    } else {
      X_ = load_matrix(path, "X");
      check(X_, path);
    }
  }
  bool empty() const { return path_.empty(); }
  /// What the report says the inputs were.
  std::string describe() const { return per_layer_ ? path_ + " (one X per layer)" : path_; }
  /// X of layer L; `which` is set to where it came from, for messages.
  Mat<double> for_layer(const io::AttentionLayerSpec& L, std::string& which) const {
    if (!per_layer_) {
      which = path_;
      return X_;
    }
    const std::string i = std::to_string(L.index);
    std::vector<std::string> keys = {i, "layer_" + i, "layer." + i};
    if (!L.prefix.empty()) keys.push_back(L.prefix);
    if (L.prefix.size() > 1 && L.prefix.back() == '.')
      keys.push_back(L.prefix.substr(0, L.prefix.size() - 1));
    for (const std::string& k : keys)
      if (per_layer_->contains(k)) {
        which = path_ + " [" + k + "]";
        Mat<double> X = per_layer_->matrix(k);
        check(X, which);
        return X;
      }
    std::string looked;
    for (const std::string& k : keys) looked += (looked.empty() ? "" : ", ") + k;
    throw BadInput(path_ + ": --inputs: no X for layer " + i + " (looked for " + looked + ")");
  }

 private:
  static void check(const Mat<double>& X, const std::string& where) {
    if (X.rows() < 1 || X.cols() < 1)
      throw BadInput(where + ": X must be N x D with N, D >= 1 (got " +
                     shape_str(X.rows(), X.cols()) + ")");
  }
  std::string path_;
  Mat<double> X_;
  std::unique_ptr<io::CheckpointReader> per_layer_;
};

/// The RoPE of a checkpoint's self-attention layers (MATH.md §10; docs/checkpoints.md):
/// config.json beside it, else GGUF metadata, else the layout (absolute positions for BERT, ViT,
/// GPT-2, T5, Whisper and the like; undecided for Llama-, GPT-NeoX- and Falcon-named tensors and
/// --map), with --rope, --rope-theta and --rope-dims taking precedence. A refusal or an undecided
/// answer is returned as RopeConfig::refusal; the caller throws it only where κ(J) is computed.
inline io::RopeConfig rope_config(const CheckpointReader& src, io::Layout layout,
                                  const AnalysisOptions& o) {
  io::RopeConfig c;
  if (o.rope == "none") {
    if (o.rope_theta || o.rope_dims > 0)
      throw BadInput("--rope-theta and --rope-dims need RoPE, not --rope none");
    c.decided = true;
    c.source = "--rope none";
    return c;
  }
  const std::string cfg = io::join_path(src.directory(), "config.json");
  if (has_config(cfg))
    c = io::read_rope_config(cfg);
  else if (const io::GgufFile* g = src.gguf())
    c = io::rope_config_from_gguf(*g);
  if (!c.decided) {
    using io::Layout;
    if (layout == Layout::Llama || layout == Layout::GptNeox || layout == Layout::Falcon ||
        layout == Layout::Map) {
      c.refusal = std::string("no config.json says whether the ") + io::to_string(layout) +
                  " layers rotate their queries and keys";
    } else {
      c.decided = true;
      c.source = std::string("the ") + io::to_string(layout) + " layout (no RoPE)";
    }
  }
  if (o.rope == "rotate_half" || o.rope == "interleaved") {
    const std::string from = c.present ? " (base and width from " + c.source + ")" : "";
    if (!c.present) c = io::RopeConfig{};
    c.decided = c.present = true;
    c.refusal.clear();
    c.pairing = parse_rope_pairing(o.rope);
    c.source = "--rope " + o.rope + from;
  }
  if (o.rope_theta || o.rope_dims > 0) {
    if (!c.present)
      throw BadInput(src.path() + ": --rope-theta and --rope-dims need RoPE, and " +
                     (c.decided ? c.source + " has none" : c.refusal) +
                     "; pass --rope rotate_half or --rope interleaved");
    if (o.rope_theta) {
      if (!(std::isfinite(*o.rope_theta) && *o.rope_theta > 1))
        throw BadInput("--rope-theta must be finite and > 1");
      c.theta = *o.rope_theta;
      c.source += ", --rope-theta";
    }
    if (o.rope_dims > 0) {
      c.dims = o.rope_dims;
      c.source += ", --rope-dims";
    }
  }
  return c;
}

/// The biases of a layer's W_Q, W_K, W_V (MATH.md §10): the tensor beside each weight
/// (io::bias_name_for) when the checkpoint holds it, sliced like the weight. An all-zero bias is
/// recorded and left out (the block is then the one without it).
inline void read_layer_biases(const CheckpointReader& src, const io::AttentionLayerSpec& L,
                              LayerModel& m) {
  std::map<std::string, Vec<double>> read;
  const io::ProjectionSlot* slots[3] = {&L.q, &L.k, &L.v};
  Vec<double>* out[3] = {&m.bq, &m.bk, &m.bv};
  for (int i = 0; i < 3; ++i) {
    const io::ProjectionSlot& s = *slots[i];
    const std::string name = io::bias_name_for(s.tensor);
    if (name.empty() || !src.contains(name)) continue;
    auto it = read.find(name);
    if (it == read.end()) it = read.emplace(name, src.vector(name)).first;
    const std::vector<std::int64_t> shape = src.shape(s.tensor);
    const std::int64_t len = shape.size() == 2 ? shape[s.transposed ? 0 : 1] : -1;
    const Vec<double> b =
        io::extract_bias(s, it->second, len, src.file_of(name) + ": tensor " + io::quote(name));
    m.bias_tensors[static_cast<std::size_t>(i)] = name;
    if (b.isZero(0)) {
      m.bias_zero[static_cast<std::size_t>(i)] = true;
      continue;
    }
    *out[i] = b;
  }
}

}  // namespace spectral_cond::engine
