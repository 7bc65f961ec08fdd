// io::open_checkpoint (spectral_cond/io/checkpoint.hpp): one reader over safetensors, .npz and
// a directory of .npy files, checked against files numpy and the safetensors package wrote
// (tests/data/) and against .npy files written here.
#include <doctest/doctest.h>
#include <spectral_cond/io/checkpoint.hpp>
#include <spectral_cond/io/formats/npy_writer.hpp>
#include "support/temp_dir.hpp"

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace io = spectral_cond::io;
using spectral_cond::Mat;

namespace {

std::string data(const char* name) {
  return (fs::path(__FILE__).parent_path() / "data" / name).string();
}

/// A temporary directory of this test file's (tests/support/temp_dir.hpp).
struct TempDir : sc_test::TempDir {
  TempDir() : sc_test::TempDir("sc-checkpoint") {}
};
}  // namespace

TEST_CASE("open_checkpoint: safetensors written by the safetensors package") {
  const io::CheckpointReader r = io::open_checkpoint(data("reference.safetensors"));
  CHECK(r.format() == io::CheckpointFormat::Safetensors);
  CHECK(r.names() == std::vector<std::string>{"ids", "w16", "w32", "w64"});
  CHECK(r.checkpoint() != nullptr);
  CHECK(r.shape("w64") == std::vector<std::int64_t>{2, 3});
  CHECK(r.dtype("w32") == io::Dtype::F32);
  const Mat<double> w64 = r.matrix("w64");
  CHECK(w64(1, 2) == 5.0 / 8);
  CHECK_THROWS_WITH_AS(r.matrix("w16"), doctest::Contains("'w16' has shape [4], expected a 2-D"),
                       io::IoError);
  CHECK_THROWS_AS(r.matrix("nosuch"), io::IoError);
}

TEST_CASE("open_checkpoint: .npz written by numpy.savez") {
  const io::CheckpointReader r = io::open_checkpoint(data("savez.npz"));
  CHECK(r.format() == io::CheckpointFormat::Npz);
  CHECK(r.checkpoint() == nullptr);
  CHECK(r.names() == std::vector<std::string>{"a", "b", "c"});
  CHECK(r.contains("c"));
  CHECK_FALSE(r.contains("d"));
  CHECK(r.shape("a") == std::vector<std::int64_t>{2, 3});
  CHECK(r.dtype("b") == io::Dtype::F16);
  CHECK(r.dtype("c") == io::Dtype::F32);
  CHECK(r.file_of("a") == data("savez.npz"));
  const Mat<double> a = r.matrix("a");  // np.arange(6.0).reshape(2, 3)
  REQUIRE(a.rows() == 2);
  REQUIRE(a.cols() == 3);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) CHECK(a(i, j) == 3 * i + j);
  CHECK_THROWS_WITH_AS(r.matrix("b"), doctest::Contains("expected a 2-D matrix"), io::IoError);
  CHECK(r.array("b").shape == std::vector<std::int64_t>{3});
  CHECK(r.directory() == fs::path(data("savez.npz")).parent_path().string());
}

TEST_CASE("open_checkpoint: a directory of .npy files, and a NaN named by tensor and entry") {
  TempDir d;
  Mat<double> q(2, 2);
  q << 1, 2, 3, 4;
  Mat<float> k(2, 3);
  k << 1, 2, 3, 4, 5, 6;
  io::write_npy((d.path / "q.npy").string(), q);
  io::write_npy((d.path / "k.npy").string(), k);
  q(1, 0) = std::numeric_limits<double>::quiet_NaN();
  io::write_npy((d.path / "bad.npy").string(), q);
  const io::CheckpointReader r = io::open_checkpoint(d.path.string());
  CHECK(r.format() == io::CheckpointFormat::NpyDir);
  CHECK(r.names() == std::vector<std::string>{"bad", "k", "q"});
  CHECK(r.shape("k") == std::vector<std::int64_t>{2, 3});
  CHECK(r.dtype("k") == io::Dtype::F32);
  CHECK(r.dtype("q") == io::Dtype::F64);
  CHECK(r.file_of("k") == (d.path / "k.npy").string());
  CHECK(r.matrix("k")(1, 2) == 6.0);
  CHECK_THROWS_WITH_AS(r.matrix("bad"), doctest::Contains("'bad' has a NaN or Inf entry at [1, 0]"),
                       io::IoError);
  // Layout detection sees the shapes of attention candidates only.
  for (const io::NamedShape& s : r.layout_view()) CHECK(s.shape.empty());
}

TEST_CASE("open_checkpoint: a path that does not exist is named") {
  CHECK_THROWS_WITH_AS(io::open_checkpoint("/nonexistent/model.safetensors"),
                       doctest::Contains("/nonexistent/model.safetensors: cannot open"),
                       io::IoError);
}
