// libFuzzer target: parse_npy (include/spectral_cond/io/formats/npy.hpp) on arbitrary bytes.
#include <spectral_cond/io/formats/npy.hpp>

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = spectral_cond::io;
  try {
    const io::NpyArray a = io::parse_npy(data, size, "fuzz.npy");
    std::size_t n = 1;
    for (auto d : a.shape) n *= static_cast<std::size_t>(d);
    if (n != a.data.size()) __builtin_trap();
    if (a.ndim() == 2) (void)a.to_matrix();
  } catch (const io::IoError&) {
  }
  return 0;
}
