// spectral_cond._core: io::open_checkpoint for Python (docs/python.md): every format the tool
// reads (safetensors single and sharded, PyTorch .bin/.pt, GGUF, .npz, a folder of .npy), its
// tensor names, shapes and dtypes without decoding, one tensor at a time as a float64 array, and
// the attention layers io::detect_layers finds. io::IoError becomes spectral_cond.CheckpointError.
#include "binding.hpp"

#include <spectral_cond/io/checkpoint.hpp>

#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

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
  return d;
}

/// The attention layers of the checkpoint, as dicts (index, prefix, D, q, k, v slots).
nb::list layers_py(const io::CheckpointReader& r, const std::string& layout) {
  const io::LayoutMatch m = io::detect_layers(r.layout_view(), io::parse_layout(layout), r.path());
  nb::list out;
  for (const io::AttentionLayerSpec& L : m.layers) {
    nb::dict d;
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
                         std::int64_t offset, std::int64_t width) {
  const Mat<double> T = r.matrix(tensor);
  const Index rows = transposed ? T.rows() : T.cols();
  if (offset < 0 || width < 1 || offset > rows || width > rows - offset)
    value_error("Checkpoint.projection", "the slot [" + std::to_string(offset) + ", +" +
                                             std::to_string(width) + ") lies outside tensor " +
                                             tensor);
  io::ProjectionSlot s{tensor, transposed, offset, width};
  return to_numpy<double>(Mat<double>(io::extract_projection(s, T)));
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
      .def("layers", &layers_py, nb::arg("layout") = "auto")
      .def("projection", &projection_py, nb::arg("tensor"), nb::arg("transposed"),
           nb::arg("offset"), nb::arg("width"));
  m.def(
      "open_checkpoint",
      [](const std::string& path) {
        return std::make_unique<io::CheckpointReader>(io::open_checkpoint(path));
      },
      nb::arg("path"), "io::open_checkpoint: a checkpoint in any format the library reads");
}

}  // namespace spectral_cond::python
