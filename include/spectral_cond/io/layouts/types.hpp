// spectral_cond::io: the types of layout detection (io/layouts/detect.hpp): the layouts, where a
// projection sits in a checkpoint tensor, one attention layer's tensors, and the extraction of
// W from a tensor and its insertion back (MATH.md §8).
#pragma once

#include "spectral_cond/core/common.hpp"
#include "spectral_cond/io/error.hpp"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace spectral_cond {
namespace io {

enum class Layout {
  Auto,
  TorchMHA,
  Timm,
  HfBert,
  Gpt2,
  Llama,
  Gguf,
  Albert,
  DistilBert,
  T5,
  GptNeox,
  Falcon,
  Whisper,
  Map
};

/// The built-in layouts' names, for messages (in the order detect_layers tries them).
inline constexpr const char* kLayoutNames =
    "timm, gpt2, hf-bert, whisper, llama, gguf, albert, distilbert, t5, gpt-neox, falcon and "
    "torch-mha";

inline const char* to_string(Layout l) {
  switch (l) {
    case Layout::Auto:
      return "auto";
    case Layout::TorchMHA:
      return "torch-mha";
    case Layout::Timm:
      return "timm";
    case Layout::HfBert:
      return "hf-bert";
    case Layout::Gpt2:
      return "gpt2";
    case Layout::Llama:
      return "llama";
    case Layout::Gguf:
      return "gguf";
    case Layout::Albert:
      return "albert";
    case Layout::DistilBert:
      return "distilbert";
    case Layout::T5:
      return "t5";
    case Layout::GptNeox:
      return "gpt-neox";
    case Layout::Falcon:
      return "falcon";
    case Layout::Whisper:
      return "whisper";
    case Layout::Map:
      return "map";
  }
  return "unknown";
}

/// The layout named `s` (to_string's names: "auto" or a built-in layout's; "map" is not one).
/// Throws LayoutError (UnknownLayout) listing the accepted names.
inline Layout parse_layout(const std::string& s) {
  std::vector<std::string> accepted;
  for (Layout l : {Layout::Auto, Layout::Timm, Layout::Gpt2, Layout::HfBert, Layout::Whisper,
                   Layout::Llama, Layout::Gguf, Layout::Albert, Layout::DistilBert, Layout::T5,
                   Layout::GptNeox, Layout::Falcon, Layout::TorchMHA}) {  // kLayoutNames' order
    if (s == to_string(l)) return l;
    accepted.push_back(to_string(l));
  }
  throw LayoutError(LayoutProblem::UnknownLayout, "", "", s, std::move(accepted));
}

/// A tensor's name and shape, all that layout detection looks at.
struct NamedShape {
  std::string name;
  std::vector<std::int64_t> shape;
};

/// Where one projection W (D x width) sits inside a checkpoint tensor T (2-D, row-major as
/// stored): transposed (Linear): W = T[offset : offset + width, :]^T; otherwise (Conv1D):
/// W = T[:, offset : offset + width]. With stride > 0 the rows (columns) come in blocks:
/// offset + g stride + [0, block) for g = 0 .. width / block - 1, concatenated; that is how
/// GPT-NeoX and Falcon interleave Q, K and V per head or per group in one fused tensor.
struct ProjectionSlot {
  std::string tensor;
  bool transposed = true;
  std::int64_t offset = 0;
  std::int64_t width = 0;
  std::int64_t block = 0;   ///< rows per block when stride > 0
  std::int64_t stride = 0;  ///< 0: one contiguous range
};

/// One attention layer of a checkpoint: its number, the slots of W_Q, W_K, W_V, and D.
struct AttentionLayerSpec {
  std::int64_t index = 0;
  std::string prefix;  ///< the name prefix shared by its tensors, e.g. "blocks.3.attn."
  ProjectionSlot q, k, v;
  std::int64_t D = 0;
  bool cross = false;       ///< cross-attention (queries from one stream, keys and values another)
  bool shared = false;      ///< one set of weights used by several layers (ALBERT)
  std::int64_t group = -1;  ///< a shared layer's group (ALBERT's albert_layer_groups.g), else -1
  bool unscaled = false;    ///< logits not divided by sqrt(d_k) (T5 folds it into W_Q)
  /// Decoder self-attention: causal by the layout (GPT-2, Llama, GGUF, GPT-NeoX, Falcon, and the
  /// decoder stack of Whisper and T5). The analysis's --mask auto uses it.
  bool causal = false;
  /// A fused tensor [rows, D] whose Q, K, V interleave by head group (GPT-NeoX, Falcon, BLOOM):
  /// the slots are filled by resolve_heads once the head count is known. 0: not packed.
  std::int64_t packed_rows = 0;
};

struct LayoutMatch {
  Layout layout = Layout::Auto;
  std::vector<AttentionLayerSpec> layers;  ///< sorted by index
};

namespace detail {

/// Calls f(first, count) for each contiguous range of the slot, in order.
template <typename F>
void for_each_range(const ProjectionSlot& s, F&& f) {
  if (s.stride <= 0 || s.block <= 0) {
    f(s.offset, s.width);
    return;
  }
  for (std::int64_t g = 0; g * s.block < s.width; ++g) f(s.offset + g * s.stride, s.block);
}

}  // namespace detail

/// W from the tensor's matrix (entry (i, j) = T[i, j]), MATH.md §8.
inline Mat<double> extract_projection(const ProjectionSlot& s, const Mat<double>& T) {
  const Index D = s.transposed ? T.cols() : T.rows();
  Mat<double> W(D, s.width);
  Index c = 0;
  detail::for_each_range(s, [&](std::int64_t first, std::int64_t n) {
    if (s.transposed)
      W.middleCols(c, n) = T.middleRows(first, n).transpose();
    else
      W.middleCols(c, n) = T.middleCols(first, n);
    c += n;
  });
  return W;
}

/// Writes W back into the tensor's matrix at its slot (the inverse of extract_projection).
inline void insert_projection(const ProjectionSlot& s, const Mat<double>& W, Mat<double>& T) {
  Index c = 0;
  detail::for_each_range(s, [&](std::int64_t first, std::int64_t n) {
    if (s.transposed)
      T.middleRows(first, n) = W.middleCols(c, n).transpose();
    else
      T.middleCols(first, n) = W.middleCols(c, n);
    c += n;
  });
}

}  // namespace io
}  // namespace spectral_cond
