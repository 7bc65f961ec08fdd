// Tests of the .npz reader (include/spectral_cond/io/npz.hpp): numpy's own archives (committed
// fixtures from numpy.savez and numpy.savez_compressed), zips built here with zlib, and a
// corpus of broken archives.
#include "support/temp_dir.hpp"
#include "support/test_helpers.hpp"

#include <spectral_cond/io/formats/npz.hpp>

#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace io = spectral_cond::io;
using spectral_cond::Mat;

namespace {

const fs::path kData = fs::path(__FILE__).parent_path() / "data";

/// A temporary directory of this test file's (tests/support/temp_dir.hpp).
struct TempDir : sc_test::TempDir {
  TempDir() : sc_test::TempDir("sc-npz") {}
};

using Bytes = std::vector<std::uint8_t>;

void put(Bytes& b, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void set(Bytes& b, std::size_t at, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i)
    b[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (8 * i));
}

Bytes deflate_raw(const Bytes& in) {
  z_stream zs{};
  REQUIRE(deflateInit2(&zs, 9, Z_DEFLATED, -15, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  Bytes out(deflateBound(&zs, static_cast<uLong>(in.size())));
  zs.next_in = const_cast<Bytef*>(in.data());
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&zs, Z_FINISH) == Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

struct Entry {
  std::string name;
  Bytes data;
  int method = 0;            // 0 stored, 8 deflate
  bool zip64_local = false;  // numpy's layout: 0xFFFFFFFF sizes and a ZIP64 extra field
};

/// A zip archive and where its parts are, for corrupting them.
struct Zip {
  Bytes bytes;
  std::vector<std::size_t> local, central;
  std::size_t cd_offset = 0, eocd = 0;
};

Zip make_zip(const std::vector<Entry>& entries) {
  Zip z;
  std::vector<std::tuple<std::uint32_t, std::size_t, std::size_t>> info;  // crc, csize, usize
  for (const auto& e : entries) {
    const Bytes payload = e.method == 8 ? deflate_raw(e.data) : e.data;
    const auto crc = static_cast<std::uint32_t>(
        crc32(crc32(0L, Z_NULL, 0), e.data.data(), static_cast<uInt>(e.data.size())));
    info.emplace_back(crc, payload.size(), e.data.size());
    z.local.push_back(z.bytes.size());
    Bytes& b = z.bytes;
    put(b, 0x04034b50, 4);
    put(b, e.zip64_local ? 45 : 20, 2);
    put(b, 0, 2);
    put(b, static_cast<std::uint64_t>(e.method), 2);
    put(b, 0, 4);  // time, date
    put(b, crc, 4);
    put(b, e.zip64_local ? 0xFFFFFFFFU : payload.size(), 4);
    put(b, e.zip64_local ? 0xFFFFFFFFU : e.data.size(), 4);
    put(b, e.name.size(), 2);
    put(b, e.zip64_local ? 20 : 0, 2);
    b.insert(b.end(), e.name.begin(), e.name.end());
    if (e.zip64_local) {
      put(b, 1, 2);
      put(b, 16, 2);
      put(b, e.data.size(), 8);
      put(b, payload.size(), 8);
    }
    b.insert(b.end(), payload.begin(), payload.end());
  }
  z.cd_offset = z.bytes.size();
  for (std::size_t k = 0; k < entries.size(); ++k) {
    Bytes& b = z.bytes;
    z.central.push_back(b.size());
    put(b, 0x02014b50, 4);
    put(b, 45, 2);
    put(b, 20, 2);
    put(b, 0, 2);
    put(b, static_cast<std::uint64_t>(entries[k].method), 2);
    put(b, 0, 4);
    put(b, std::get<0>(info[k]), 4);
    put(b, std::get<1>(info[k]), 4);
    put(b, std::get<2>(info[k]), 4);
    put(b, entries[k].name.size(), 2);
    put(b, 0, 2);
    put(b, 0, 2);
    put(b, 0, 2);
    put(b, 0, 2);
    put(b, 0, 4);
    put(b, z.local[k], 4);
    b.insert(b.end(), entries[k].name.begin(), entries[k].name.end());
  }
  const std::size_t cd_size = z.bytes.size() - z.cd_offset;
  z.eocd = z.bytes.size();
  put(z.bytes, 0x06054b50, 4);
  put(z.bytes, 0, 4);
  put(z.bytes, entries.size(), 2);
  put(z.bytes, entries.size(), 2);
  put(z.bytes, cd_size, 4);
  put(z.bytes, z.cd_offset, 4);
  put(z.bytes, 0, 2);
  return z;
}

Bytes npy_of(const Mat<double>& m) {
  return io::encode_npy(m);
}

/// Opening and reading every member of `bytes` throws IoError naming the archive and `what`.
void check_bad(const Bytes& bytes, const std::string& what) {
  INFO("expecting: " << what);
  const std::string name = "corpus.npz";
  bool thrown = false;
  try {
    for (const auto& m : io::parse_npz_directory(bytes.data(), bytes.size(), name))
      (void)io::read_npz_member(bytes.data(), bytes.size(), name, m);
  } catch (const io::IoError& e) {
    thrown = true;
    const std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.rfind(name, 0) == 0);
    CHECK(msg.find(what) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
  CHECK(thrown);
}

}  // namespace

TEST_CASE("numpy.savez and numpy.savez_compressed archives") {
  for (const char* f : {"savez.npz", "savez_compressed.npz"}) {
    INFO(f);
    io::NpzFile z((kData / f).string());
    CHECK(z.names() == std::vector<std::string>{"a", "b", "c"});
    CHECK(z.contains("a"));
    CHECK(z.contains("a.npy"));
    CHECK_FALSE(z.contains("d"));
    const Mat<double> a = z.array("a").to_matrix();
    REQUIRE(a.rows() == 2);
    REQUIRE(a.cols() == 3);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) CHECK(a(i, j) == 3 * i + j);
    const io::NpyArray b = z.array("b.npy");
    CHECK(b.dtype == "<f2");
    CHECK(b.data == std::vector<double>{0.5, -1.0, 65504.0});
    const Mat<double> c = z.array("c").to_matrix();  // Fortran order in the file
    CHECK(c(0, 1) == 2.0);
    CHECK(c(1, 0) == 3.0);
    CHECK_THROWS_WITH_AS(z.array("d"), doctest::Contains("'d'"), io::IoError);
  }
}

TEST_CASE("zips built with zlib: stored, deflated, ZIP64 local headers") {
  TempDir dir;
  std::mt19937_64 rng(11);
  INFO("seed 11");
  const Mat<double> w = sc_test::randn<double>(7, 5, rng);
  const Mat<double> z0 = Mat<double>::Zero(64, 64);  // compresses ~100:1
  for (int method : {0, 8}) {
    for (bool zip64 : {false, true}) {
      const Zip zip =
          make_zip({{"W.npy", npy_of(w), method, zip64}, {"Z.npy", npy_of(z0), method, zip64}});
      const std::string path = dir.file("t.npz");
      std::ofstream(path, std::ios::binary)
          .write(reinterpret_cast<const char*>(zip.bytes.data()),
                 static_cast<std::streamsize>(zip.bytes.size()));
      io::NpzFile f(path);
      CHECK(f.names() == std::vector<std::string>{"W", "Z"});
      CHECK(f.array("W").to_matrix() == w);
      CHECK(f.array("Z").to_matrix() == z0);
      CHECK(f.members()[0].method == method);
    }
  }
  // An archive comment is allowed.
  Zip zip = make_zip({{"W.npy", npy_of(w), 8, false}});
  set(zip.bytes, zip.eocd + 20, 5, 2);
  for (char ch : std::string("hello")) zip.bytes.push_back(static_cast<std::uint8_t>(ch));
  CHECK(io::parse_npz_directory(zip.bytes.data(), zip.bytes.size(), "c.npz").size() == 1);
}

TEST_CASE("bad archives: each is an IoError naming the file and member") {
  const Mat<double> w = Mat<double>::Identity(3, 3);
  const Zip good = make_zip({{"W.npy", npy_of(w), 0, true}, {"V.npy", npy_of(w), 8, false}});

  check_bad({}, "not a zip archive");
  check_bad(Bytes(100, 0), "no end-of-central-directory");
  check_bad(make_zip({{"readme.txt", Bytes{'h', 'i'}, 0, false}}).bytes,
            "member 'readme.txt': not a .npy member");
  check_bad(make_zip({}).bytes, "empty archive");
  check_bad(make_zip({{"W.npy", npy_of(w), 0, false}, {"W.npy", npy_of(w), 0, false}}).bytes,
            "member 'W.npy': duplicate member");
  {  // Truncated: the end record survives but the directory is cut.
    Bytes b(good.bytes.begin(), good.bytes.begin() + static_cast<long>(good.central[1]) + 10);
    b.insert(b.end(), good.bytes.begin() + static_cast<long>(good.eocd), good.bytes.end());
    check_bad(b, "outside the file");
  }
  {  // Truncated anywhere: the end record is gone.
    Bytes b(good.bytes.begin(), good.bytes.end() - 5);
    check_bad(b, "no end-of-central-directory");
  }
  {  // More entries claimed than the directory holds.
    Bytes b = good.bytes;
    set(b, good.eocd + 8, 3, 2);
    set(b, good.eocd + 10, 3, 2);
    check_bad(b, "central directory");
  }
  {  // Directory offset past the end.
    Bytes b = good.bytes;
    set(b, good.eocd + 16, 0x7FFFFFFF, 4);
    check_bad(b, "outside the file");
  }
  {  // Local header offset pointing into nowhere.
    Bytes b = good.bytes;
    set(b, good.central[1] + 42, 3, 4);
    check_bad(b, "member 'V.npy': local header at 3 missing or malformed");
  }
  {  // Stored sizes disagree.
    Bytes b = good.bytes;
    set(b, good.central[0] + 20, 10, 4);
    check_bad(b, "member 'W.npy': stored member with compressed size 10");
  }
  {  // Member data longer than the space before the directory.
    Bytes b = good.bytes;
    set(b, good.central[1] + 20, 100000, 4);
    check_bad(b, "member 'V.npy'");
  }
  {  // Deflated size claims an impossible ratio.
    Bytes b = good.bytes;
    set(b, good.central[1] + 24, 0xFFFFFFF0U, 4);
    check_bad(b, "member 'V.npy': uncompressed size");
  }
  {  // Deflate stream that inflates to more than declared.
    Bytes b = good.bytes;
    set(b, good.central[1] + 24, 100, 4);
    set(b, good.local[1] + 22, 100, 4);
    check_bad(b, "member 'V.npy': inflates to more than");
    set(b, good.central[1] + 24, 1000, 4);
    set(b, good.local[1] + 22, 1000, 4);
    check_bad(b, "member 'V.npy': inflates to");
  }
  {  // Corrupted deflate data.
    Bytes b = good.bytes;
    const std::size_t data = good.local[1] + 30 + 5;
    for (std::size_t k = 0; k < 8; ++k) b[data + k] = 0xFF;
    check_bad(b, "member 'V.npy'");
  }
  {  // A flipped data byte: CRC mismatch.
    Bytes b = good.bytes;
    b[good.local[0] + 30 + 5 + 20 + 100] ^= 1;
    check_bad(b, "member 'W.npy': CRC-32 mismatch");
  }
  {  // Encrypted, unsupported method, local/central disagreement.
    Bytes b = good.bytes;
    set(b, good.central[0] + 8, 1, 2);
    check_bad(b, "member 'W.npy': encrypted");
    b = good.bytes;
    set(b, good.central[1] + 10, 12, 2);
    check_bad(b, "member 'V.npy': compression method 12");
    b = good.bytes;
    set(b, good.local[1] + 14, 1234, 4);
    check_bad(b, "member 'V.npy': local and central headers disagree");
    b = good.bytes;
    set(b, good.eocd + 4, 1, 2);
    check_bad(b, "multi-disk");
  }
  {  // ZIP64 sizes without a ZIP64 field.
    Bytes b = good.bytes;
    set(b, good.central[1] + 24, 0xFFFFFFFFU, 4);
    check_bad(b, "member 'V.npy': ZIP64 sizes without a ZIP64 field");
  }
  // A bad .npy inside: the message names the archive and the member.
  check_bad(
      make_zip({{"W.npy", Bytes{'n', 'o', 't', 'n', 'p', 'y', 0, 0, 0, 0, 0}, 8, false}}).bytes,
      "corpus.npz: member 'W.npy': not a .npy file");
  Bytes npy = npy_of(w);
  npy.resize(npy.size() - 8);
  check_bad(make_zip({{"W.npy", npy, 0, false}}).bytes, "corpus.npz: member 'W.npy': truncated");

  // Missing files.
  CHECK_THROWS_WITH_AS(io::NpzFile("/nonexistent/x.npz"), doctest::Contains("/nonexistent/x.npz"),
                       io::IoError);
}

TEST_CASE("every prefix and every single-byte corruption is an IoError or a valid read") {
  // Exercises the bounds checks under the sanitizers: no prefix of a valid archive may crash.
  const Mat<double> w = Mat<double>::Identity(2, 2);
  const Zip good = make_zip({{"W.npy", npy_of(w), 0, true}, {"V.npy", npy_of(w), 8, false}});
  int ok = 0, rejected = 0;
  auto attempt = [&](const Bytes& b) {
    try {
      for (const auto& m : io::parse_npz_directory(b.data(), b.size(), "p.npz"))
        (void)io::read_npz_member(b.data(), b.size(), "p.npz", m);
      ++ok;
    } catch (const io::IoError&) {
      ++rejected;
    }
  };
  for (std::size_t n = 0; n < good.bytes.size(); ++n)
    attempt(Bytes(good.bytes.begin(), good.bytes.begin() + static_cast<long>(n)));
  CHECK(ok == 0);
  for (std::size_t k = 0; k < good.bytes.size(); ++k) {
    for (std::uint8_t x : {std::uint8_t{0x01}, std::uint8_t{0x80}, std::uint8_t{0xFF}}) {
      Bytes b = good.bytes;
      b[k] ^= x;
      attempt(b);
    }
  }
  CHECK(rejected > 0);
}
