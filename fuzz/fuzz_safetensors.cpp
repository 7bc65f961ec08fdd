// libFuzzer target: the safetensors header parser, then every tensor converted to doubles
// through the same checked offsets a SafetensorsFile would use.
#include <spectral_cond/io/formats/safetensors.hpp>

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = spectral_cond::io;
  try {
    const io::SafetensorsHeader h = io::parse_safetensors_header(data, size, "fuzz.safetensors");
    // The parser's guarantees, checked: every tensor lies inside the input.
    for (const auto& t : h.tensors) {
      if (t.end < t.begin || h.data_start + t.end > size) __builtin_trap();
      if (t.numel() * io::dtype_size(t.dtype) != t.nbytes()) __builtin_trap();
      if (!io::is_convertible(t.dtype) || t.numel() > (1U << 16)) continue;
      std::vector<double> out(static_cast<std::size_t>(t.numel()));
      io::detail::convert(t, data + h.data_start + t.begin, 1,
                          static_cast<spectral_cond::Index>(out.size()), out.data());
    }
  } catch (const io::IoError&) {
  }
  return 0;
}
