// spectral-cond correct: folds the paper's corrections into a checkpoint's W_Q, W_K, W_V and
// writes a new safetensors file (MATH.md §6–8; docs/checkpoints.md).
//
//   spectral-cond correct CHECKPOINT --method lambda|exact [--lambda 10] [--target T]
//        [--placement fused|per-head|packed[:SUBSET]] [--layout ...] [--heads H] [--kv-heads G]
//        [--layers 0,3,5-7] --out NEW.safetensors [--quiet] [--verbose]
//
//   lambda, fused     W + λ I(D, width)               (head j receives its d-slice of I)
//   lambda, per-head  W + λ [I(D, d) | … | I(D, d)]   (every head its own top identity)
//   exact,  fused     W + C(W), C of Theorem 3.5 for the whole D x width projection
//   exact,  per-head  each head's D x d block W_j + C(W_j)
//   lambda, packed    the packed weight (timm's qkv, GPT-2's c_attn) + λ I: output feature f
//                     of the packed tensor gains λ at input f, for f < D (MATH.md §7)
//   fused:qk, per-head:v, ...: only the named projections are corrected
//
// Every other tensor is copied byte for byte, the modified ones are written in their own dtype,
// the "__metadata__" is kept as it is, and the file is written atomically (temporary file and
// rename). A sharded input is written as one single output file. The output may not be the
// input (or one of its shards), also through a link.
#include <spectral_cond/engine/advice.hpp>
#include <spectral_cond/engine/analysis_inputs.hpp>
#include <spectral_cond/engine/index_selection.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include <spectral_cond/engine/number_text.hpp>
#include "commands.hpp"
#include "progress.hpp"

#include <spectral_cond/conditioning/corrections.hpp>
#include <spectral_cond/io/formats/safetensors.hpp>
#include <spectral_cond/io/paths.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond::cli {
namespace {

/// --method: which correction is folded in.
enum class CorrectionMethod { Lambda, Exact };

/// The values of --method (parsed by enum_names, echoed in the summary line).
const EnumNames<CorrectionMethod> kMethods = {{"lambda", CorrectionMethod::Lambda},
                                              {"exact", CorrectionMethod::Exact}};

struct CorrectArgs {
  std::string checkpoint, out;
  CorrectionMethod method = CorrectionMethod::Lambda;
  std::string placement_text = "fused";
  CorrectionPlacement placement;  ///< parsed from placement_text by checked_placement
  std::string layout = "auto", map, layers;
  std::int64_t heads = 0, kv_heads = 0;
  double lambda = 10, target = 0;
  bool quiet = false, verbose = false;
};

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

/// Every file the source reads from, for the overwrite check.
std::vector<std::string> input_files(const CheckpointReader& src) {
  std::vector<std::string> files{src.path()};
  if (const io::Checkpoint* c = src.checkpoint()) {
    files.push_back(c->path());
    for (const auto& s : c->shard_paths()) files.push_back(s);
  } else if (src.format() == CheckpointFormat::NpyDir) {
    for (const auto& n : src.names()) files.push_back(src.file_of(n));
  }
  return files;
}

/// W corrected by the chosen method and placement (see the top of this file).
Mat<double> corrected(const Mat<double>& W, Index heads, Index d, const CorrectArgs& a,
                      const std::optional<double>& target) {
  const bool per_head = a.placement.layout == Placement::PerHead;
  if (a.method == CorrectionMethod::Lambda) {
    const Mat<double> E = per_head ? lambda_identity<double>(W.rows(), heads, d, Placement::PerHead)
                                   : Mat<double>(Mat<double>::Identity(W.rows(), W.cols()));
    return W + a.lambda * E;
  }
  if (!per_head) return exact_correction(W, target).W_corrected;
  Mat<double> out = W;
  for (Index j = 0; j < heads; ++j)
    out.middleCols(j * d, d) =
        exact_correction(Mat<double>(W.middleCols(j * d, d)), target).W_corrected;
  return out;
}

/// The bytes of an npz / npy-dir tensor re-encoded in row-major order as `dtype` (exact: the
/// values came from that dtype).
std::vector<std::uint8_t> encode_array(const io::NpyArray& arr, io::Dtype dtype,
                                       const std::string& file) {
  if (!arr.fortran_order || arr.ndim() <= 1)
    return io::encode_values(arr.data.data(), arr.data.size(), dtype);
  if (arr.ndim() == 2) return io::encode_matrix(arr.to_matrix(), dtype);
  throw BadInput(file + ": tensor " + io::quote(arr.name) +
                 ": Fortran-order arrays of more than 2 dimensions cannot be written back");
}

/// --placement parsed (MATH.md §7): packed with --method lambda only.
CorrectionPlacement checked_placement(const CorrectArgs& a) {
  CorrectionPlacement p;
  try {
    p = parse_placement(a.placement_text, "--placement");
  } catch (const std::invalid_argument& e) {
    throw BadInput(e.what());
  }
  if (p.layout == Placement::Packed && a.method != CorrectionMethod::Lambda)
    throw BadInput(
        "--placement packed applies to --method lambda only (the exact correction is computed "
        "per projection or per head block)");
  return p;
}

/// The optional --target, checked with --lambda against the method they apply to.
std::optional<double> checked_target(const CorrectArgs& a, bool target_set) {
  if (!(std::isfinite(a.lambda) && a.lambda >= 0))
    throw BadInput("--lambda must be finite and >= 0 (got " + number_text(a.lambda, 6) + ")");
  if (!target_set) return std::nullopt;
  if (!(std::isfinite(a.target) && a.target > 1))
    throw BadInput("--target must be finite and > 1 (got " + number_text(a.target, 6) + ")");
  if (a.method != CorrectionMethod::Exact)
    throw BadInput("--target applies to --method exact only");
  return a.target;
}

/// Refuses an --out that is one of the files `src` reads (or its config.json), a link, a device,
/// a directory, or a name without .safetensors.
void check_out(const CheckpointReader& src, const CorrectArgs& a) {
  std::vector<std::string> inputs = input_files(src);
  inputs.push_back(io::join_path(src.directory(), "config.json"));
  for (const std::string& f : inputs)
    if (f == a.out || same_file(f, a.out))
      throw BadInput(a.out + ": refusing to overwrite the input checkpoint (" + f + ")");
  io::check_output_target(a.out, inputs);  // and never a link, a device or a directory
  if (!io::has_suffix(a.out, ".safetensors"))
    throw BadInput(
        "--out: correct writes a safetensors file, so its name must end in "
        ".safetensors (got " +
        io::quote(a.out) + ")");
}

/// The corrected tensors of one attention layer, encoded in their dtype, added to `modified`
/// (a packed layer's slots are filled in `L` by io::resolve_heads).
void correct_layer(const CheckpointReader& src, io::AttentionLayerSpec& L, const io::HeadConfig& hc,
                   const CorrectArgs& a, const std::optional<double>& target,
                   std::map<std::string, std::vector<std::uint8_t>>& modified) {
  // A fused or packed correction treats each projection as one matrix: it needs no head count
  // (unless the tensor interleaves Q, K and V by head, as GPT-NeoX and Falcon do).
  const CorrectionPlacement& pl = a.placement;
  if (pl.layout == Placement::Packed)
    engine::check_placements(L, {pl}, a.checkpoint + ": layer " + std::to_string(L.index),
                             "--placement");
  io::LayerHeads H;
  if (hc.heads < 1 && pl.layout != Placement::PerHead && L.packed_rows == 0) {
    H.heads = H.kv_heads = 1;
    H.d_k = L.q.width;
    H.d_v = L.v.width;
  } else {
    H = io::resolve_heads(L, hc, a.checkpoint);
  }
  std::map<std::string, Mat<double>> tensors;
  for (const io::ProjectionSlot* s : {&L.q, &L.k, &L.v}) {
    if (tensors.count(s->tensor)) continue;
    if (modified.count(s->tensor))
      throw BadInput(a.checkpoint + ": tensor " + io::quote(s->tensor) +
                     " belongs to two attention layers");
    if (a.verbose)
      std::cerr << "spectral-cond: reading " << s->tensor << " from " << src.file_of(s->tensor)
                << '\n';
    tensors.emplace(s->tensor, src.matrix(s->tensor));
  }
  auto fix = [&](const io::ProjectionSlot& s, Index heads, Index d) {
    Mat<double>& T = tensors.at(s.tensor);
    const Mat<double> W = io::extract_projection(s, T);
    Mat<double> Wc;
    if (pl.layout == Placement::Packed) {  // λ at input f of every output feature f < D
      Wc = W;
      for (Index j = 0; j < W.cols(); ++j) {
        const std::int64_t f = engine::slot_feature(s, j);
        if (f < W.rows()) Wc(f, j) += a.lambda;
      }
    } else {
      Wc = corrected(W, heads, d, a, target);
    }
    if (!Wc.allFinite())
      throw NumericalFailure(a.checkpoint + ": tensor " + io::quote(s.tensor) +
                             ": the corrected weights have NaN or Inf entries");
    io::insert_projection(s, Wc, T);
  };
  if (pl.q) fix(L.q, H.heads, H.d_k);
  if (pl.k) fix(L.k, H.kv_heads, H.d_k);
  if (pl.v) fix(L.v, H.kv_heads, H.d_v);
  for (const auto& kv : tensors) {
    io::require_representable(
        kv.second, src.dtype(kv.first),
        src.file_of(kv.first) + ": tensor " + io::quote(kv.first) + " after the correction");
    modified[kv.first] = io::encode_matrix(kv.second, src.dtype(kv.first));
  }
}

/// Every tensor of `src` for the output file: the `modified` ones, the rest unchanged (views of
/// the source's bytes, or re-encoded npz / npy / gathered PyTorch tensors kept alive in `keep`).
std::vector<io::TensorToWrite> output_tensors(
    const CheckpointReader& src, const std::map<std::string, std::vector<std::uint8_t>>& modified,
    std::deque<std::vector<std::uint8_t>>& keep) {
  std::vector<io::TensorToWrite> out;
  const io::Checkpoint* ck = src.checkpoint();
  for (const std::string& name : src.names()) {
    io::TensorToWrite t;
    t.name = name;
    if (ck) {
      const io::TensorInfo& info = ck->info(name);
      t.dtype = info.dtype;
      t.shape = info.shape;
    } else {
      t.dtype = src.dtype(name);
      t.shape = src.shape(name);
    }
    auto m = modified.find(name);
    if (m != modified.end()) {
      t.bytes = {m->second.data(), m->second.size()};
    } else if (ck) {
      t.bytes = ck->bytes(name);
    } else if (const io::PytorchFile* pt = src.pytorch_for(name)) {
      keep.emplace_back();
      t.bytes = pt->bytes(name, keep.back());  // in place when contiguous, else gathered
    } else {
      // npz / npy: the stored bytes where they are already the output's encoding (one buffer
      // of the array's size), else the values re-encoded; never the whole archive as doubles.
      keep.emplace_back();
      if (!src.stored_bytes(name, keep.back()))
        keep.back() = encode_array(src.array(name), t.dtype, src.file_of(name));
      t.bytes = {keep.back().data(), keep.back().size()};
    }
    out.push_back(std::move(t));
  }
  return out;
}

/// Refuses (exit 2, naming the file and the sizes) a correction whose peak memory would exceed
/// the budget (memory_budget_bytes), estimated from the shapes and dtypes before anything is
/// read: every tensor not memory-mapped (npz and npy members, PyTorch tensors) held encoded until
/// the file is written, the corrected tensors encoded, and the largest layer's projections as
/// doubles three times over (the tensor, W and W + C). Safetensors inputs are mapped, not held.
void check_correct_memory(const CheckpointReader& src,
                          const std::vector<io::AttentionLayerSpec*>& todo,
                          const std::string& checkpoint) {
  const auto elements = [&](const std::string& name) {
    double n = 1;
    for (const std::int64_t e : src.shape(name)) n *= static_cast<double>(e);
    return n;
  };
  std::set<std::string> corrected;
  double layer_doubles = 0;
  for (const io::AttentionLayerSpec* L : todo) {
    std::set<std::string> mine;
    for (const io::ProjectionSlot* s : {&L->q, &L->k, &L->v}) mine.insert(s->tensor);
    double n = 0;
    for (const std::string& t : mine) n += elements(t);
    layer_doubles = std::max(layer_doubles, 3 * 8 * n);
    corrected.insert(mine.begin(), mine.end());
  }
  double held = 0;
  for (const std::string& name : src.names())
    if (!src.checkpoint() || corrected.count(name))
      held += elements(name) * static_cast<double>(io::dtype_size(src.dtype(name)));
  const double need = held + layer_doubles, budget = engine::memory_budget_bytes();
  if (need > budget) {
    std::ostringstream e;
    e << checkpoint << ": correcting it needs about " << need / 1e9
      << " GB in memory (its tensors as they are written: " << held / 1e9
      << " GB; the largest layer's projections as doubles: " << layer_doubles / 1e9
      << " GB), more than the memory budget of " << budget / 1e9
      << " GB (a quarter of physical memory, or SPECTRAL_COND_MEMORY_BUDGET); a safetensors "
         "file is read in place, not held";
    throw BadInput(e.str());
  }
}

/// The model's config.json beside the output, so that the new file loads as the old one did;
/// one already there is never replaced. Returns what was done, for the summary line.
std::string copy_config(const CheckpointReader& src, const std::string& out) {
  const std::string src_cfg = io::join_path(src.directory(), "config.json");
  const std::string out_dir = io::parent_directory(out);
  const std::string out_cfg = io::join_path(out_dir.empty() ? "." : out_dir, "config.json");
  if (!io::is_regular_file(src_cfg) || same_file(src_cfg, out_cfg)) return std::string();
  struct stat st {};
  if (::lstat(out_cfg.c_str(), &st) == 0) return "; left the config.json already at " + out_cfg;
  const io::MappedFile cfg(src_cfg);
  io::atomic_write_bytes(out_cfg, cfg.data(), cfg.size());
  return "; copied config.json beside it";
}

void run_correct(CorrectArgs a, bool target_set) {
  const std::optional<double> target = checked_target(a, target_set);
  a.placement = checked_placement(a);
  const CheckpointReader src = io::open_checkpoint(a.checkpoint);
  if (src.gguf())
    throw BadInput(a.checkpoint +
                   ": correct does not rewrite GGUF files (their quantized "
                   "tensors have no safetensors dtype); analyze reads them");
  check_out(src, a);

  const io::LayerMap map = io::parse_layer_map(a.map);
  io::LayoutMatch match =
      io::detect_layers(src.layout_view(&map), io::parse_layout(a.layout), a.checkpoint, &map);
  const io::HeadConfig hc = head_config(src, a.heads, a.kv_heads);
  const IndexSelection sel = IndexSelection::parse(a.layers, "--layers");
  std::vector<std::int64_t> indices;
  for (const auto& L : match.layers) indices.push_back(L.index);  // sorted by detect_layers
  sel.require_within(indices, "attention layer", a.checkpoint);

  // The corrected tensors, encoded in their dtype. Layer by layer: one layer's tensors in memory.
  std::map<std::string, std::vector<std::uint8_t>> modified;
  std::vector<io::AttentionLayerSpec*> todo;
  for (auto& L : match.layers)
    if (sel.contains(L.index)) todo.push_back(&L);
  check_correct_memory(src, todo, a.checkpoint);
  Progress bar("correct " + a.checkpoint, !a.quiet);
  std::size_t n_done = 0;
  for (io::AttentionLayerSpec* L : todo) {
    correct_layer(src, *L, hc, a, target, modified);
    bar.update(static_cast<double>(++n_done) / static_cast<double>(todo.size() + 1));
  }

  std::deque<std::vector<std::uint8_t>> keep;
  const std::vector<io::TensorToWrite> out = output_tensors(src, modified, keep);
  const io::Checkpoint* ck = src.checkpoint();
  io::write_safetensors(a.out, out, ck ? ck->metadata() : std::map<std::string, std::string>());
  const std::string config_note = copy_config(src, a.out);
  bar.done();
  std::cout << "corrected " << modified.size() << " tensor(s) in " << todo.size()
            << " attention layer(s) of " << a.checkpoint << " (method "
            << enum_name(kMethods, a.method);
  if (a.method == CorrectionMethod::Lambda) std::cout << ", lambda = " << number_text(a.lambda, 6);
  if (target) std::cout << ", target = " << number_text(*target, 6);
  std::cout << ", placement " << a.placement.name() << "); wrote " << out.size() << " tensors to "
            << a.out << config_note << '\n';
}

}  // namespace

void register_correct(CLI::App& app) {
  auto a = std::make_shared<CorrectArgs>();
  CLI::App* cmd = app.add_subcommand(
      "correct", "Fold the lambda I_k or the exact correction into a checkpoint (safetensors out)");
  cmd->add_option(
         "checkpoint", a->checkpoint,
         "a .safetensors file, a sharded *.index.json, a PyTorch .bin/.pt, an .npz, or a directory")
      ->required();
  cmd->add_option("--method", a->method,
                  "lambda (W + lambda I_k, Theorem 3.8) or exact "
                  "(Theorem 3.5)")
      ->required()
      ->transform(enum_names(kMethods));
  cmd->add_option("--lambda", a->lambda, "lambda for --method lambda (default 10)");
  cmd->add_option("--target", a->target,
                  "target kappa > 1 for --method exact (default: "
                  "C = sigma_1 U V^T)");
  cmd->add_option("--placement", a->placement_text,
                  "fused (default): one correction of the whole projection; per-head: one per "
                  "head block; packed (--method lambda, one packed Q/K/V tensor): the identity of "
                  "the packed weight; a subset of projections after a colon: fused:qk, per-head:v");
  cmd->add_option("--layout", a->layout, layout_help())->check(CLI::IsMember(layout_choices()));
  cmd->add_option("--map", a->map, "q=REGEX,k=REGEX,v=REGEX or qkv=REGEX: see analyze --help");
  cmd->add_option("--heads", a->heads, "number of attention heads (default: config.json)")
      ->check(head_count());
  cmd->add_option("--kv-heads", a->kv_heads, "key/value heads (grouped-query models)")
      ->check(head_count());
  cmd->add_option("--layers", a->layers, "layers to correct, e.g. 0,3,5-7 (default all)");
  cmd->add_option("--out", a->out, "the new .safetensors file (written atomically)")->required();
  cmd->add_flag("--quiet", a->quiet, "no progress bar");
  cmd->add_flag("--verbose", a->verbose, "log every tensor read on stderr");
  cmd->callback([a, cmd] {
    if (cmd->count("--lambda") > 0 && a->method != CorrectionMethod::Lambda)
      throw BadInput("--lambda applies to --method lambda only");
    run_correct(*a, cmd->count("--target") > 0);
  });
}

}  // namespace spectral_cond::cli
