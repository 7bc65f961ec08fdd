// The test suite's temporary directory: a fresh, empty, uniquely named directory (mkdtemp)
// under the system temporary directory, removed with everything in it at scope exit.
#pragma once

#include <doctest/doctest.h>

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

namespace sc_test {

struct TempDir {
  std::filesystem::path path;

  explicit TempDir(const std::string& prefix = "sc-test") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  /// The path of `name` inside the directory.
  std::string file(const std::string& name) const { return (path / name).string(); }

  /// Writes `bytes` to `name` inside the directory; returns its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string p = file(name);
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }

  /// The names in the directory (any order).
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path))
      out.push_back(e.path().filename().string());
    return out;
  }
};

}  // namespace sc_test
