// libFuzzer target: layout detection (include/spectral_cond/io/layouts/detect.hpp) on arbitrary
// tensor names and shapes, then the head resolution, checking that every slot (strided ones of
// GPT-NeoX / Falcon included) lies inside its tensor.
// Input: lines "name<TAB>d0,d1,...", then an optional last line "heads,kv_heads".
#include <spectral_cond/io/layouts/detect.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <sstream>

namespace {

namespace io = spectral_cond::io;

std::vector<std::int64_t> parse_dims(const std::string& s) {
  std::vector<std::int64_t> dims;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',') && dims.size() < 4) {
    std::int64_t v = 0;
    for (char ch : tok) {
      if (ch < '0' || ch > '9') break;
      v = v * 10 + (ch - '0');
      if (v > (std::int64_t{1} << 40)) break;
    }
    dims.push_back(v);
  }
  return dims;
}

void check_slot(const io::ProjectionSlot& s, std::int64_t D,
                const std::map<std::string, std::vector<std::int64_t>>& shapes) {
  auto it = shapes.find(s.tensor);
  if (it == shapes.end() || it->second.size() != 2) __builtin_trap();
  const auto& sh = it->second;
  const std::int64_t along = s.transposed ? sh[0] : sh[1];
  const std::int64_t across = s.transposed ? sh[1] : sh[0];
  if (across != D || s.offset < 0 || s.width < 1) __builtin_trap();
  if (s.stride <= 0) {
    if (s.offset + s.width > along) __builtin_trap();
    return;
  }
  // Blocks offset + g stride + [0, block): every one inside the tensor, none overlapping.
  if (s.block < 1 || s.block > s.stride || s.width % s.block != 0) __builtin_trap();
  if (s.offset + (s.width / s.block - 1) * s.stride + s.block > along) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<io::NamedShape> tensors;
  std::map<std::string, std::vector<std::int64_t>> shapes;
  io::HeadConfig heads;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line) && tensors.size() < 256) {
    const std::size_t tab = line.find('\t');
    if (tab == std::string::npos) {
      const auto d = parse_dims(line);
      if (d.size() == 2) {
        heads.heads = d[0];
        heads.kv_heads = d[1];
      }
      continue;
    }
    io::NamedShape t{line.substr(0, tab), parse_dims(line.substr(tab + 1))};
    if (!shapes.emplace(t.name, t.shape).second) continue;  // names are unique in a checkpoint
    tensors.push_back(std::move(t));
  }
  try {
    io::LayoutMatch m = io::detect_layers(tensors, io::Layout::Auto, "fuzz");
    for (auto& L : m.layers) {
      if (L.D < 1) __builtin_trap();
      if (L.packed_rows == 0) {  // GPT-NeoX / Falcon slots exist only once the heads are known
        check_slot(L.q, L.D, shapes);
        check_slot(L.k, L.D, shapes);
        check_slot(L.v, L.D, shapes);
      }
      try {
        const io::LayerHeads h = io::resolve_heads(L, heads, "fuzz");
        check_slot(L.q, L.D, shapes);
        check_slot(L.k, L.D, shapes);
        check_slot(L.v, L.D, shapes);
        if (h.heads * h.d_k != L.q.width || h.kv_heads * h.d_k != L.k.width ||
            h.kv_heads * h.d_v != L.v.width)
          __builtin_trap();
      } catch (const io::IoError&) {
      }
    }
  } catch (const io::IoError&) {
  }
  return 0;
}
