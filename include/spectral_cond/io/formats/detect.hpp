// Which checkpoint format a file is (io/checkpoint.hpp reads them): found from its first bytes,
// never from its name alone (sniff_format); a file in another format gets "unsupported format:
// this looks like <what>; supported: ...".
#pragma once

#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/formats/npz.hpp>
#include <spectral_cond/io/mapped_file.hpp>
#include <spectral_cond/io/paths.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace spectral_cond {
namespace io {

enum class CheckpointFormat { Safetensors, Npz, NpyDir, Pytorch, Gguf };

inline const char* to_string(CheckpointFormat k) {
  switch (k) {
    case CheckpointFormat::Safetensors:
      return "safetensors";
    case CheckpointFormat::Npz:
      return "npz";
    case CheckpointFormat::NpyDir:
      return "npy-dir";
    case CheckpointFormat::Pytorch:
      return "pytorch";
    case CheckpointFormat::Gguf:
      return "gguf";
  }
  return "unknown";
}

namespace detail {

/// The formats open_checkpoint reads, for messages.
constexpr const char* kSupportedFormats =
    "safetensors (.safetensors, a sharded .index.json), PyTorch (.bin/.pt/.pth, zip or legacy), "
    "GGUF (v2, v3), .npz, a directory of .npy files";

/// What a file's first bytes say it is, for the message on a format that is not read.
inline std::string describe_bytes(const std::uint8_t* p, std::size_t n) {
  auto at = [&](std::size_t off, const char* magic) {
    const std::size_t k = std::strlen(magic);
    return n >= off + k && std::memcmp(p + off, magic, k) == 0;
  };
  if (n == 0) return "an empty file";
  if (at(0, "\x89HDF\r\n\x1a\n")) return "an HDF5 file (a Keras .h5?)";
  if (at(0, "\x1f\x8b")) return "a gzip stream";
  if (at(257, "ustar")) return "a tar archive (PyTorch's pre-1.6 tar format is not read)";
  if (at(0, "\x93NUMPY")) return "a single .npy array (pass the directory that holds it)";
  if (at(0, "lmgg") || at(0, "fmgg") || at(0, "tjgg") || at(0, "algg"))
    return "a ggml file of the format before GGUF";
  if (at(4, "TFL3")) return "a TensorFlow Lite model";
  if (at(0, "PAR1")) return "a Parquet file";
  if (at(0, "PK\x03\x04")) return "a zip archive that is neither an npz nor a PyTorch checkpoint";
  if (at(0, "{") || at(0, "[")) return "a JSON file";
  static const char hex[] = "0123456789abcdef";
  std::string h;
  for (std::size_t i = 0; i < n && i < 8; ++i) {
    h += hex[p[i] >> 4];
    h += hex[p[i] & 15];
  }
  return "none of them (first bytes " + h + ")";
}

/// The format of the regular file at `path`, from its first bytes (and, for a zip, its member
/// names). Throws IoError "unsupported format: this looks like ..." for anything else.
inline CheckpointFormat sniff_format(const std::string& path) {
  const MappedFile f(path);
  const std::uint8_t* p = f.data();
  const std::size_t n = f.size();
  if (n >= 9 && p[8] == '{') return CheckpointFormat::Safetensors;
  if (has_suffix(path, ".json") && n >= 1 && p[0] == '{') return CheckpointFormat::Safetensors;
  if (n >= 2 && p[0] == 0x80 && p[1] >= 2 && p[1] <= 5) return CheckpointFormat::Pytorch;
  if (n >= 4 && std::memcmp(p, "GGUF", 4) == 0) return CheckpointFormat::Gguf;
  if (n >= 4 && std::memcmp(p, "PK\x03\x04", 4) == 0) {
    if (has_suffix(path, ".npz")) return CheckpointFormat::Npz;
    const std::vector<NpzMember> ms = ZipReader(p, n, path, "zip", false).members();
    bool all_npy = true;
    for (const NpzMember& m : ms) {
      const std::size_t slash = m.name.find('/');
      if (slash != std::string::npos && m.name.compare(slash, std::string::npos, "/data.pkl") == 0)
        return CheckpointFormat::Pytorch;
      all_npy = all_npy && has_suffix(m.name, ".npy");
    }
    if (all_npy) return CheckpointFormat::Npz;
  }
  throw IoError(path + ": unsupported format: this looks like " + describe_bytes(p, n) +
                "; supported: " + kSupportedFormats);
}

}  // namespace detail

}  // namespace io
}  // namespace spectral_cond
