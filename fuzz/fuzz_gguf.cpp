// libFuzzer target: the GGUF parser (header, metadata, tensor infos), every metadata array's
// elements, and the dequantization of every tensor of at most 64 KiB.
#include <spectral_cond/io/formats/gguf.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

/// Decodes an array's elements, and theirs, recursively (each level was checked by the parser).
void walk(const spectral_cond::io::GgufValue& v) {
  if (!v.is_array()) return;
  const std::vector<spectral_cond::io::GgufValue> e = v.elements();
  if (e.size() != v.size()) __builtin_trap();
  for (const auto& x : e) walk(x);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = spectral_cond::io;
  try {
    const io::GgufView g(data, size, "fuzz.gguf");
    const io::GgufHeader& h = g.header();
    if (h.data_start + h.data_size != size && h.data_size != 0) __builtin_trap();
    for (const auto& kv : g.metadata()) walk(kv.second);
    try {
      (void)g.architecture();
      (void)g.get_int("general.alignment");
    } catch (const io::IoError&) {
    }
    for (const auto& t : g.tensors()) {
      if (t.offset > h.data_size || t.nbytes > h.data_size - t.offset) __builtin_trap();
      if (t.nbytes > (std::uint64_t{1} << 16)) continue;
      try {
        const std::vector<double> v = g.values(t.name);
        if (v.size() != t.numel()) __builtin_trap();
        if (t.shape.size() == 2) (void)g.matrix(t.name);
      } catch (const io::IoError&) {
      }
    }
  } catch (const io::IoError&) {
  }
  return 0;
}
