// spectral_cond/io: the path helpers every reader and the tool use, on std::filesystem. None of
// them throws: a path that cannot be examined is neither a directory nor a regular file.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

namespace spectral_cond::io {

/// `dir` / `name` ("name" alone when `dir` is empty). `name` is relative (a shard name from an
/// index is checked to be so before it is joined).
inline std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return (std::filesystem::path(dir) / name).string();
}

/// The directory part of `path`: "." when it has none, "/" for a file at the root.
inline std::string parent_directory(const std::string& path) {
  const std::string p = std::filesystem::path(path).parent_path().string();
  return p.empty() ? "." : p;
}

/// Whether `path` names a directory (following symbolic links).
inline bool is_directory(const std::string& path) noexcept {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec);
}

/// Whether `path` names a regular file (following symbolic links).
inline bool is_regular_file(const std::string& path) noexcept {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

/// Whether `s` ends with `suffix` (file-name extensions: ".npy", ".safetensors.index.json").
inline bool has_suffix(const std::string& s, const std::string& suffix) noexcept {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace spectral_cond::io
