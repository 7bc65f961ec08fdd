// libFuzzer target: the .npz zip parser and every member (inflate, CRC, parse_npy).
#include <spectral_cond/io/formats/npz.hpp>

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = spectral_cond::io;
  try {
    for (const auto& m : io::parse_npz_directory(data, size, "fuzz.npz")) {
      if (m.data_offset > size || m.compressed > size - m.data_offset) __builtin_trap();
      try {
        (void)io::read_npz_member(data, size, "fuzz.npz", m);
      } catch (const io::IoError&) {
      }
    }
  } catch (const io::IoError&) {
  }
  return 0;
}
