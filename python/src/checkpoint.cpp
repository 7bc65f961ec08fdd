// spectral_cond._core: io::open_checkpoint for Python (docs/python.md): every format the tool
// reads (safetensors single and sharded, PyTorch .bin/.pt, GGUF, .npz, a folder of .npy), its
// tensor names, shapes and dtypes without decoding, one tensor at a time as a float64 array, and
// the attention layers io::detect_layers finds. io::IoError becomes spectral_cond.CheckpointError.
#include "binding.hpp"

#include <spectral_cond/engine/analysis.hpp>
#include <spectral_cond/engine/analysis_format.hpp>
#include <spectral_cond/engine/layout_wording.hpp>
#include <spectral_cond/io/checkpoint.hpp>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace spectral_cond::python {
namespace {

nb::dict slot_dict(const io::ProjectionSlot& s) {
  nb::dict d;
  d["tensor"] = s.tensor;
  d["transposed"] = s.transposed;
  d["offset"] = s.offset;
  d["width"] = s.width;
  d["block"] = s.block;
  d["stride"] = s.stride;
  return d;
}

/// The attention layers of the checkpoint, as dicts (index, prefix, D, q, k, v slots, and
/// what the layout says: cross-attention, shared, unscaled logits). With heads, each layer's
/// heads are resolved too (and the slots of GPT-NeoX / Falcon tensors filled, which need them).
nb::list layers_py(const io::CheckpointReader& r, const std::string& layout,
                   const std::string& map_text, std::int64_t heads, std::int64_t kv_heads) {
  const io::LayerMap map = io::parse_layer_map(map_text);
  io::LayoutMatch m =
      io::detect_layers(r.layout_view(&map), io::parse_layout(layout), r.path(), &map);
  // num_hidden_layers / num_hidden_groups of a config.json beside it, for ALBERT's shared_by.
  io::HeadConfig layer_config;
  const std::filesystem::path cfg = std::filesystem::path(r.directory()) / "config.json";
  std::error_code ec;
  if (std::filesystem::is_regular_file(cfg, ec)) layer_config = io::read_head_config(cfg.string());
  io::HeadConfig hc;
  hc.heads = heads;
  hc.kv_heads = kv_heads;
  hc.source = "heads=";
  nb::list out;
  for (io::AttentionLayerSpec& L : m.layers) {
    nb::dict d;
    if (heads > 0) {
      const io::LayerHeads h = io::resolve_heads(L, hc, r.path());
      d["heads"] = h.heads;
      d["kv_heads"] = h.kv_heads;
      d["d_k"] = h.d_k;
      d["d_v"] = h.d_v;
    } else if (L.packed_rows > 0) {
      throw io::IoError(r.path() + ": layer " + L.prefix + ": Q, K and V of " + L.q.tensor +
                        " interleave by head; pass heads= to find them");
    }
    d["cross"] = L.cross;
    d["shared"] = L.shared;
    d["group"] = L.group;
    d["shared_by"] = io::shared_by(L, layer_config);
    d["unscaled"] = L.unscaled;
    d["layout"] = std::string(io::to_string(m.layout));
    d["index"] = L.index;
    d["prefix"] = L.prefix;
    d["D"] = L.D;
    d["q"] = slot_dict(L.q);
    d["k"] = slot_dict(L.k);
    d["v"] = slot_dict(L.v);
    out.append(d);
  }
  return out;
}

/// W (D x width) of one slot, the matrix the analysis uses.
nb::object projection_py(const io::CheckpointReader& r, const std::string& tensor, bool transposed,
                         std::int64_t offset, std::int64_t width, std::int64_t block,
                         std::int64_t stride) {
  const Mat<double> T = r.matrix(tensor);
  const Index rows = transposed ? T.rows() : T.cols();
  auto outside = [&] {
    value_error("Checkpoint.projection", "the slot [" + std::to_string(offset) + ", +" +
                                             std::to_string(width) + ") lies outside tensor " +
                                             tensor);
  };
  if (offset < 0 || width < 1 || offset > rows) outside();
  if (stride <= 0) {
    if (width > rows - offset) outside();
  } else {
    // Blocks offset + g stride + [0, block): the last must end inside the tensor.
    if (block < 1 || width % block != 0 || block > stride)
      value_error("Checkpoint.projection", "block must divide width and be at most stride");
    const std::int64_t groups = width / block;
    if (rows - offset < block || groups - 1 > (rows - offset - block) / stride) outside();
  }
  io::ProjectionSlot s{
      tensor, transposed, offset, width, stride > 0 ? block : 0, stride > 0 ? stride : 0};
  return to_numpy<double>(Mat<double>(io::extract_projection(s, T)));
}

/// The engine's words for the tool's flags, as the package's arguments.
std::string package_wording(std::string s) {
  static const std::pair<const char*, const char*> names[] = {
      {"--kv-heads", "kv_heads="}, {"--heads", "heads="}, {"--layers", "layers="},
      {"--layout", "layout="},     {"--map", "map="},     {"--lambda", "lam="}};
  for (const auto& [flag, arg] : names)
    for (std::size_t at = s.find(flag); at != std::string::npos; at = s.find(flag, at))
      s.replace(at, std::strlen(flag), arg);
  return s;
}

/// The engine's analysis of one checkpoint (engine/analysis.hpp: the tool's `analyze`, weights
/// and corrections), as the tool's JSON report text; spectral_cond.analyze builds its rows from it.
std::string analyze_checkpoint_py(const std::string& path, const std::string& layout,
                                  const std::string& map, std::int64_t heads, std::int64_t kv_heads,
                                  double lambda, std::optional<double> target, bool per_head,
                                  const std::string& layers) {
  engine::AnalysisOptions o;
  o.layout = layout;
  o.map = map;
  o.heads = heads;
  o.kv_heads = kv_heads;
  o.lambda = lambda;
  o.target = target;
  o.per_head = per_head;
  o.layers = layers;
  try {
    return engine::reports_json({engine::analyze_checkpoint(path, o)});
  } catch (const io::LayoutError& e) {
    value_error("analyze", package_wording(engine::layout_message(e)));
  } catch (const io::IoError& e) {
    throw io::IoError(package_wording(e.what()));
  } catch (const engine::Error& e) {
    value_error("analyze", package_wording(e.what()));
  }
}

}  // namespace

void bind_checkpoint(nb::module_& m) {
  static nb::exception<io::IoError> checkpoint_error(m, "CheckpointError", PyExc_OSError);
  nb::class_<io::CheckpointReader>(m, "Checkpoint")
      .def_prop_ro(
          "format",
          [](const io::CheckpointReader& r) { return std::string(io::to_string(r.format())); })
      .def_prop_ro("path", [](const io::CheckpointReader& r) { return r.path(); })
      .def_prop_ro("directory", &io::CheckpointReader::directory)
      .def("names", [](const io::CheckpointReader& r) { return r.names(); })
      .def("__contains__", &io::CheckpointReader::contains, nb::arg("name"))
      .def("__len__", [](const io::CheckpointReader& r) { return r.names().size(); })
      .def(
          "shape",
          [](const io::CheckpointReader& r, const std::string& n) {
            nb::list l;
            for (std::int64_t d : r.shape(n)) l.append(d);
            return nb::tuple(l);
          },
          nb::arg("name"))
      .def(
          "dtype",
          [](const io::CheckpointReader& r, const std::string& n) {
            return std::string(io::to_string(r.dtype(n)));
          },
          nb::arg("name"))
      .def("file_of", &io::CheckpointReader::file_of, nb::arg("name"))
      .def(
          "matrix",
          [](const io::CheckpointReader& r, const std::string& n) {
            return to_numpy<double>(r.matrix(n));
          },
          nb::arg("name"))
      .def("layers", &layers_py, nb::arg("layout") = "auto", nb::arg("map") = "",
           nb::arg("heads") = 0, nb::arg("kv_heads") = 0)
      .def("projection", &projection_py, nb::arg("tensor"), nb::arg("transposed"),
           nb::arg("offset"), nb::arg("width"), nb::arg("block") = 0, nb::arg("stride") = 0);
  m.def(
      "read_head_config",
      [](const std::string& path) {
        const io::HeadConfig c = io::read_head_config(path);
        nb::dict d;
        d["heads"] = c.heads;
        d["kv_heads"] = c.kv_heads;
        d["hidden"] = c.hidden;
        d["hidden_layers"] = c.hidden_layers;
        d["hidden_groups"] = c.hidden_groups;
        d["source"] = c.source;
        return d;
      },
      nb::arg("path"), "io::read_head_config: the head counts of a config.json (0: not stated)");
  m.def("analyze_checkpoint", &analyze_checkpoint_py, nb::arg("path"), nb::arg("layout") = "auto",
        nb::arg("map") = "", nb::arg("heads") = 0, nb::arg("kv_heads") = 0, nb::arg("lam") = 10.0,
        nb::arg("target") = nb::none(), nb::arg("per_head") = false, nb::arg("layers") = "",
        "The engine's analysis of a checkpoint (the tool's analyze), as its JSON report text");
  m.def(
      "open_checkpoint",
      [](const std::string& path) {
        return std::make_unique<io::CheckpointReader>(io::open_checkpoint(path));
      },
      nb::arg("path"), "io::open_checkpoint: a checkpoint in any format the library reads");
}

}  // namespace spectral_cond::python
