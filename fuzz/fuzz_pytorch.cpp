// libFuzzer target: the PyTorch checkpoint reader (zip and legacy formats, the restricted
// unpickler) and, for every tensor it accepts, the matrix and byte reads.
#include <spectral_cond/io/formats/pytorch.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = spectral_cond::io;
  try {
    const io::PytorchFile f(data, size, "fuzz.pt");
    for (const auto& kv : f.tensors()) {
      const io::PytorchTensor& t = kv.second;
      if (t.numel() > (1 << 20)) continue;  // the extent is checked; reading it is not the point
      try {
        std::vector<std::uint8_t> buf;
        const io::ByteView b = f.bytes(kv.first, buf);
        if (b.size != static_cast<std::size_t>(t.numel()) * io::dtype_size(t.dtype))
          __builtin_trap();
        if (t.shape.size() >= 1 && t.shape.size() <= 2 && io::is_convertible(t.dtype))
          (void)f.matrix(kv.first);
      } catch (const io::IoError&) {
      }
    }
  } catch (const io::IoError&) {
  }
  return 0;
}
