// Tests of the safetensors reader and writer (include/spectral_cond/io/safetensors.hpp), the
// half/bfloat16 conversions (float16.hpp) and sharded checkpoints.
#include "support/temp_dir.hpp"
#include "support/test_helpers.hpp"

#include <spectral_cond/io/formats/safetensors.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace io = spectral_cond::io;
using io::Dtype;
using spectral_cond::Mat;

namespace {

/// A temporary directory of this test file's (tests/support/temp_dir.hpp).
struct TempDir : sc_test::TempDir {
  TempDir() : sc_test::TempDir("sc-safetensors") {}
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int b = 0; b < 8; ++b)
    s[static_cast<std::size_t>(b)] = static_cast<char>((v >> (8 * b)) & 0xFF);
  return s;
}

/// A safetensors file from a header string and a data buffer of `data_bytes` zero bytes.
std::string raw_file(const std::string& header, std::size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\0');
}

/// Opening `path` throws IoError whose message is one line naming the file and `what`.
void check_bad(const std::string& path, const std::string& what) {
  INFO("file: " << path << ", expecting: " << what);
  bool thrown = false;
  try {
    io::SafetensorsFile f(path);
  } catch (const io::IoError& e) {
    thrown = true;
    const std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(what) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
  CHECK(thrown);
}

double half_rt(double x) {
  return io::half_to_double(io::double_to_half(x));
}
double bf16_rt(double x) {
  return io::bf16_to_double(io::double_to_bf16(x));
}

}  // namespace

TEST_CASE("half conversion: known bit patterns") {
  CHECK(io::double_to_half(1.0) == 0x3C00);
  CHECK(io::double_to_half(-2.0) == 0xC000);
  CHECK(io::double_to_half(0.0) == 0x0000);
  CHECK(io::double_to_half(-0.0) == 0x8000);
  CHECK(io::double_to_half(65504.0) == 0x7BFF);   // largest half
  CHECK(io::double_to_half(65519.99) == 0x7BFF);  // below the midpoint to 2^16
  CHECK(io::double_to_half(65520.0) == 0x7C00);   // midpoint: ties to even = inf
  CHECK(io::double_to_half(1e300) == 0x7C00);
  CHECK(io::double_to_half(std::ldexp(1.0, -14)) == 0x0400);              // smallest normal
  CHECK(io::double_to_half(std::ldexp(1.0, -24)) == 0x0001);              // smallest subnormal
  CHECK(io::double_to_half(std::ldexp(1023.0, -24)) == 0x03FF);           // largest subnormal
  CHECK(io::double_to_half(std::ldexp(1.0, -25)) == 0x0000);              // tie to even: 0
  CHECK(io::double_to_half(std::ldexp(3.0, -25)) == 0x0002);              // tie to even: 2 units
  CHECK(io::double_to_half(std::ldexp(1.0, -25) * 1.0000001) == 0x0001);  // above the tie
  CHECK(io::double_to_half(1e-300) == 0x0000);
  CHECK(io::double_to_half(-1e-300) == 0x8000);
  CHECK(io::double_to_half(5e-324) == 0x0000);  // double subnormal
  CHECK(io::double_to_half(std::numeric_limits<double>::infinity()) == 0x7C00);
  CHECK(io::double_to_half(-std::numeric_limits<double>::infinity()) == 0xFC00);
  const std::uint16_t nan = io::double_to_half(std::numeric_limits<double>::quiet_NaN());
  CHECK((nan & 0x7C00) == 0x7C00);
  CHECK((nan & 0x03FF) != 0);
  // Ties to even at 1: the spacing is 2^-10.
  CHECK(io::double_to_half(1.0 + std::ldexp(1.0, -11)) == 0x3C00);
  CHECK(io::double_to_half(1.0 + std::ldexp(3.0, -11)) == 0x3C02);
  // No double rounding through float: 1 + 2^-11 + 2^-40 is above the tie.
  CHECK(io::double_to_half(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40)) == 0x3C01);

  CHECK(io::half_to_double(0x3C00) == 1.0);
  CHECK(io::half_to_double(0x7BFF) == 65504.0);
  CHECK(io::half_to_double(0x0001) == std::ldexp(1.0, -24));
  CHECK(io::half_to_double(0x03FF) == std::ldexp(1023.0, -24));
  CHECK(io::half_to_double(0x0400) == std::ldexp(1.0, -14));
  CHECK(io::half_to_double(0x7C00) == std::numeric_limits<double>::infinity());
  CHECK(io::half_to_double(0xFC00) == -std::numeric_limits<double>::infinity());
  CHECK(std::isnan(io::half_to_double(0x7E00)));
  CHECK(std::isnan(io::half_to_double(0x7C01)));
  CHECK(std::signbit(io::half_to_double(0x8000)));
  CHECK(io::half_to_double(0x3555) == 0x155p-12 + 0.25);  // 0.333251953125
}

TEST_CASE("bfloat16 conversion: known bit patterns") {
  CHECK(io::double_to_bf16(1.0) == 0x3F80);
  CHECK(io::double_to_bf16(-1.0) == 0xBF80);
  CHECK(io::bf16_to_double(0x3F80) == 1.0);
  CHECK(io::bf16_to_double(0x7F7F) == std::ldexp(255.0, 120));  // largest bf16
  CHECK(io::double_to_bf16(std::ldexp(255.0, 120)) == 0x7F7F);
  CHECK(io::double_to_bf16(std::ldexp(511.0, 119)) == 0x7F80);  // midpoint to 2^128: inf
  CHECK(io::double_to_bf16(std::ldexp(1.0, -133)) == 0x0001);   // smallest subnormal
  CHECK(io::bf16_to_double(0x0001) == std::ldexp(1.0, -133));
  CHECK(io::double_to_bf16(std::ldexp(1.0, -134)) == 0x0000);      // tie to even
  CHECK(io::double_to_bf16(1.0 + std::ldexp(1.0, -8)) == 0x3F80);  // tie to even
  CHECK(io::double_to_bf16(1.0 + std::ldexp(3.0, -8)) == 0x3F82);
  CHECK(io::double_to_bf16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30)) == 0x3F81);
  CHECK(io::double_to_bf16(std::numeric_limits<double>::infinity()) == 0x7F80);
  CHECK(io::double_to_bf16(-std::numeric_limits<double>::infinity()) == 0xFF80);
  const std::uint16_t nan = io::double_to_bf16(std::numeric_limits<double>::quiet_NaN());
  CHECK((nan & 0x7F80) == 0x7F80);
  CHECK((nan & 0x007F) != 0);
  CHECK(std::isnan(io::bf16_to_double(0x7FC0)));
}

TEST_CASE("half and bfloat16: every non-NaN bit pattern survives decode then encode") {
  int bad_half = 0, bad_bf16 = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const double x = io::half_to_double(h);
    if (!std::isnan(x) && io::double_to_half(x) != h) ++bad_half;
    const double y = io::bf16_to_double(h);
    if (!std::isnan(y) && io::double_to_bf16(y) != h) ++bad_bf16;
    // Midpoints between neighbours round to the even one.
    if ((b & 0x7C00) != 0x7C00 && (b & 0x7FFF) < 0x7BFF) {
      const double next = io::half_to_double(static_cast<std::uint16_t>(b + 1));
      const std::uint16_t r = io::double_to_half(0.5 * (x + next));
      if (r != ((b & 1U) == 0 ? b : b + 1)) ++bad_half;
    }
  }
  CHECK(bad_half == 0);
  CHECK(bad_bf16 == 0);
}

TEST_CASE("round trip: write then read, all four float dtypes") {
  TempDir dir;
  std::mt19937_64 rng(7);
  INFO("seed 7");
  const Mat<double> a = sc_test::randn<double>(5, 3, rng);
  Mat<double> b = sc_test::randn<double>(4, 1, rng);
  b(0, 0) = 1e-6;  // subnormal in half
  b(1, 0) = 1e5;   // inf in half
  const Dtype dts[] = {Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16};
  std::vector<std::vector<std::uint8_t>> bufs;
  std::vector<io::TensorToWrite> ts;
  for (Dtype d : dts) {
    bufs.push_back(io::encode_matrix(a, d));
    ts.push_back({std::string("a.") + io::to_string(d),
                  d,
                  {5, 3},
                  {bufs.back().data(), bufs.back().size()}});
    bufs.push_back(io::encode_matrix(b, d));
    ts.push_back(
        {std::string("b.") + io::to_string(d), d, {4}, {bufs.back().data(), bufs.back().size()}});
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "h\u00e9llo \"q\""}};
  const std::string path = dir.file("rt.safetensors");
  io::write_safetensors(path, ts, meta);

  io::SafetensorsFile f(path);
  CHECK(f.metadata() == meta);
  CHECK(f.tensors().size() == 8);
  CHECK(f.header().data_start % 8 == 0);
  for (Dtype d : dts) {
    const std::string s = io::to_string(d);
    const io::TensorInfo& ta = f.info("a." + s);
    CHECK(ta.dtype == d);
    CHECK(ta.shape == std::vector<std::int64_t>{5, 3});
    const Mat<double> ra = f.matrix<double>("a." + s);
    const Mat<double> rb = f.matrix<double>("b." + s);
    REQUIRE(ra.rows() == 5);
    REQUIRE(ra.cols() == 3);
    REQUIRE(rb.rows() == 4);
    REQUIRE(rb.cols() == 1);
    for (int i = 0; i < 5; ++i) {
      for (int j = 0; j < 3; ++j) {
        const double x = a(i, j);
        const double want = d == Dtype::F64   ? x
                            : d == Dtype::F32 ? static_cast<double>(static_cast<float>(x))
                            : d == Dtype::F16 ? half_rt(x)
                                              : bf16_rt(x);
        CHECK(ra(i, j) == want);
      }
    }
    CHECK(f.matrix<float>("a." + s).cast<double>().isApprox(ra.cast<float>().cast<double>()));
    const std::vector<double> flat = f.values<double>("a." + s);
    REQUIRE(flat.size() == 15);
    CHECK(flat[1] == ra(0, 1));  // row-major
  }
  CHECK(f.matrix<double>("b.F16")(0, 0) == half_rt(1e-6));
  CHECK(f.matrix<double>("b.F16")(0, 0) > 0);
  CHECK(std::isinf(f.matrix<double>("b.F16")(1, 0)));
  CHECK(f.matrix<double>("b.BF16")(1, 0) == bf16_rt(1e5));
}

TEST_CASE("copy byte for byte, other dtypes, ranks and empty tensors") {
  TempDir dir;
  std::vector<std::uint8_t> ints(2 * 3 * 8);
  for (std::size_t k = 0; k < ints.size(); ++k) ints[k] = static_cast<std::uint8_t>(k * 7 + 1);
  std::vector<std::uint8_t> cube(2 * 2 * 2 * 4, 0);
  std::vector<std::uint8_t> none;
  const std::string p1 = dir.file("one.safetensors");
  io::write_safetensors(p1, {{"ids", Dtype::I64, {2, 3}, {ints.data(), ints.size()}},
                             {"cube", Dtype::F32, {2, 2, 2}, {cube.data(), cube.size()}},
                             {"empty", Dtype::F16, {0, 4}, {none.data(), 0}},
                             {"scalar", Dtype::U8, {}, {ints.data(), 1}}});
  io::SafetensorsFile f(p1);
  CHECK(f.names() == std::vector<std::string>{"cube", "empty", "ids", "scalar"});
  CHECK_THROWS_AS(f.matrix<double>("ids"), io::IoError);
  CHECK_THROWS_WITH(f.matrix<double>("ids"), doctest::Contains("'ids'"));
  CHECK_THROWS_WITH(f.matrix<double>("cube"), doctest::Contains("3 dimensions"));
  CHECK(f.values<double>("cube").size() == 8);
  CHECK(f.matrix<double>("empty").rows() == 0);
  CHECK(f.matrix<double>("empty").cols() == 4);
  CHECK_THROWS_WITH(f.info("nope"), doctest::Contains(p1.c_str()));

  // Copy everything untouched into a second file: the bytes are identical.
  std::vector<io::TensorToWrite> copy;
  for (const auto& t : f.tensors()) copy.push_back({t.name, t.dtype, t.shape, f.bytes(t.name)});
  const std::string p2 = dir.file("two.safetensors");
  io::write_safetensors(p2, copy, {{"k", "v"}});
  io::SafetensorsFile g(p2);
  for (const auto& t : f.tensors()) {
    const io::ByteView x = f.bytes(t.name), y = g.bytes(t.name);
    REQUIRE(x.size == y.size);
    CHECK(std::equal(x.data, x.data + x.size, y.data));
  }
  CHECK(g.metadata().at("k") == "v");
  // Overwrite in place (atomic rename over the old file).
  io::write_safetensors(p2, {copy[0]});
  CHECK(io::SafetensorsFile(p2).tensors().size() == 1);

  // Writer checks.
  CHECK_THROWS_WITH_AS(
      io::write_safetensors(dir.file("w.safetensors"), {{"x", Dtype::F32, {3}, {ints.data(), 8}}}),
      doctest::Contains("'x'"), io::IoError);
  CHECK_THROWS_AS(
      io::write_safetensors(dir.file("w.safetensors"), {{"x", Dtype::U8, {1}, {ints.data(), 1}},
                                                        {"x", Dtype::U8, {1}, {ints.data(), 1}}}),
      io::IoError);
  CHECK_THROWS_AS(
      io::write_safetensors(dir.file("w.safetensors"), {{"x", Dtype::U8, {-1}, {ints.data(), 1}}}),
      io::IoError);
  CHECK_FALSE(fs::exists(dir.file("w.safetensors")));
  CHECK_THROWS_AS(io::encode_values(nullptr, 0, Dtype::I8), std::invalid_argument);
}

TEST_CASE("the file agrees with the reference Python safetensors layout") {
  // A header written by hand in the reference layout (8-byte-padded JSON) reads back.
  TempDir dir;
  const std::string h =
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  std::string hp = h + std::string((8 - h.size() % 8) % 8, ' ');
  std::string data;
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) {
    std::uint32_t u = 0;
    std::memcpy(&u, &v, 4);
    for (int b = 0; b < 4; ++b) data += static_cast<char>((u >> (8 * b)) & 0xFF);
  }
  const std::string path = dir.file("ref.safetensors");
  write_bytes(path, le64(hp.size()) + hp + data);
  io::SafetensorsFile f(path);
  const Mat<double> w = f.matrix<double>("w");
  CHECK(w(0, 0) == 1.0);
  CHECK(w(0, 1) == 2.0);  // row-major in the file
  CHECK(w(1, 0) == 3.0);
  CHECK(f.metadata().at("format") == "pt");
}

TEST_CASE("bad files: each is an IoError naming the file and the tensor") {
  TempDir dir;
  int k = 0;
  auto bad = [&](const std::string& bytes, const std::string& what) {
    const std::string path = dir.file("bad" + std::to_string(k++) + ".safetensors");
    write_bytes(path, bytes);
    check_bad(path, what);
  };
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  // Sanity: the good one opens.
  write_bytes(dir.file("good.safetensors"), raw_file(ok, 16));
  CHECK_NOTHROW(io::SafetensorsFile(dir.file("good.safetensors")));

  bad("", "too short");
  bad("abc", "too short");
  bad(raw_file(ok, 16).substr(0, 20), "exceeds the file size");  // truncated inside the header
  bad(raw_file(ok, 16).substr(0, raw_file(ok, 16).size() - 1), "beyond the data buffer");
  bad(le64(1000) + ok, "exceeds the file size");
  bad(le64(std::uint64_t{1} << 40) + ok, "exceeds the limit");
  bad(le64(~std::uint64_t{0}) + ok, "exceeds the limit");
  bad(raw_file("{\"w\": {", 0), "not valid JSON");
  bad(raw_file("", 0), "not valid JSON");
  bad(raw_file("{\"w\":1}\n\x01garbage", 0), "not valid JSON");
  bad(raw_file("[1, 2]", 0), "not an object");
  bad(raw_file("\"str\"", 0), "not an object");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,160]}})", 16),
      "'w': data_offsets [0, 160) beyond");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", 16),
      "'w': data_offsets end < begin");
  bad(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
               16),
      "'b': data overlaps tensor 'a'");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", 16),
      "'w': byte length 16 != 6 elements x 4 bytes");
  bad(raw_file(R"({"w":{"dtype":"F17","shape":[2,2],"data_offsets":[0,16]}})", 16),
      "'w': unknown dtype 'F17'");
  bad(raw_file(R"({"w":{"dtype":3,"shape":[2,2],"data_offsets":[0,16]}})", 16),
      "'w': dtype is not a string");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]}})", 16),
      "'w': shape entries must be non-negative integers");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2.0,2],"data_offsets":[0,16]}})", 16),
      "'w': shape entries must be non-negative integers");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":"2x2","data_offsets":[0,16]}})", 16),
      "'w': shape is not an array");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,2],"data_offsets":[0,16]}})",
               16),
      "'w': shape product overflows");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,16]}})", 16),
      "'w': shape entries");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2,2]}})", 16), "'w': missing field 'data_offsets'");
  bad(raw_file(R"({"w":{"shape":[2,2],"data_offsets":[0,16]}})", 16), "'w': missing field 'dtype'");
  bad(raw_file(R"({"w":{"dtype":"F32","data_offsets":[0,16]}})", 16), "'w': missing field 'shape'");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16],"x":1}})", 16),
      "'w': unexpected field 'x'");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0]}})", 16),
      "'w': data_offsets must be two");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,-16]}})", 16),
      "'w': data_offsets must be two");
  bad(raw_file(R"({"w":[1,2]})", 16), "'w': entry is not an object");
  bad(raw_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
               R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})",
               16),
      "duplicate key 'w'");
  bad(raw_file(R"({"__metadata__":{"a":1}})", 0), "__metadata__ value of 'a' is not a string");
  bad(raw_file(R"({"__metadata__":[1]})", 0), "__metadata__ is not an object");
  bad(raw_file("{\"w\\n\\u0001\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,1]}}", 16),
      "tensor 'w\\x0a\\x01'");  // control characters escaped: the message stays one line
  bad(raw_file("{\"\xff\xfe\":1}", 0), "not valid JSON");  // invalid UTF-8

  // Missing and non-regular files.
  CHECK_THROWS_WITH_AS(io::SafetensorsFile(dir.file("missing.safetensors")),
                       doctest::Contains("missing.safetensors: cannot open"), io::IoError);
  CHECK_THROWS_WITH_AS(io::SafetensorsFile(dir.path.string()), doctest::Contains("not a regular"),
                       io::IoError);
}

TEST_CASE("mapped file: empty files and moves") {
  TempDir dir;
  write_bytes(dir.file("empty"), "");
  io::MappedFile e(dir.file("empty"));
  CHECK(e.size() == 0);
  CHECK(e.data() == nullptr);
  write_bytes(dir.file("abc"), "abc");
  io::MappedFile a(dir.file("abc"));
  io::MappedFile b(std::move(a));
  CHECK(b.size() == 3);
  CHECK(b.data()[1] == 'b');
  CHECK(a.size() == 0);  // NOLINT(bugprone-use-after-move): moved-from is empty
  a = std::move(b);
  CHECK(a.size() == 3);
  CHECK(a.path() == dir.file("abc"));
}

TEST_CASE("sharded checkpoint: index with two shards, lazily opened") {
  TempDir dir;
  const Mat<double> q = Mat<double>::Identity(3, 3);
  const Mat<double> k = 2.0 * Mat<double>::Identity(3, 3);
  const auto bq = io::encode_matrix(q, Dtype::BF16);
  const auto bk = io::encode_matrix(k, Dtype::F16);
  io::write_safetensors(dir.file("model-00001-of-00002.safetensors"),
                        {{"layers.0.q.weight", Dtype::BF16, {3, 3}, {bq.data(), bq.size()}}},
                        {{"format", "pt"}});
  io::write_safetensors(dir.file("model-00002-of-00002.safetensors"),
                        {{"layers.0.k.weight", Dtype::F16, {3, 3}, {bk.data(), bk.size()}}});
  write_bytes(dir.file("model.safetensors.index.json"),
              R"({"metadata": {"total_size": 36}, "weight_map": {
                   "layers.0.q.weight": "model-00001-of-00002.safetensors",
                   "layers.0.k.weight": "model-00002-of-00002.safetensors"}})");

  for (const std::string& open : {dir.file("model.safetensors.index.json"), dir.path.string()}) {
    io::Checkpoint c(open);
    CHECK(c.sharded());
    CHECK(c.names() == std::vector<std::string>{"layers.0.k.weight", "layers.0.q.weight"});
    CHECK(c.shard_paths().size() == 2);
    CHECK(c.matrix<double>("layers.0.k.weight").isApprox(k));
    CHECK(c.matrix<float>("layers.0.q.weight").cast<double>().isApprox(q));
    CHECK(c.info("layers.0.q.weight").dtype == Dtype::BF16);
    CHECK(c.bytes("layers.0.k.weight").size == 18);
    CHECK(c.metadata().at("format") == "pt");
    CHECK_THROWS_WITH_AS(c.info("nope"), doctest::Contains("'nope'"), io::IoError);
  }

  // A single file through Checkpoint, and a directory holding model.safetensors.
  fs::create_directory(dir.path / "single");
  io::write_safetensors(dir.file("single/model.safetensors"),
                        {{"w", Dtype::F16, {3, 3}, {bk.data(), bk.size()}}});
  for (const std::string& open : {dir.file("single/model.safetensors"), dir.file("single")}) {
    io::Checkpoint c(open);
    CHECK_FALSE(c.sharded());
    CHECK(c.names() == std::vector<std::string>{"w"});
    CHECK(c.matrix<double>("w").isApprox(k));
  }
  fs::create_directory(dir.path / "nothing");
  CHECK_THROWS_WITH_AS(io::Checkpoint(dir.file("nothing")), doctest::Contains("nothing"),
                       io::IoError);
}

TEST_CASE("sharded checkpoint: bad indexes") {
  TempDir dir;
  const auto bq = io::encode_matrix(Mat<double>::Identity(2, 2), Dtype::F32);
  io::write_safetensors(dir.file("s1.safetensors"),
                        {{"a", Dtype::F32, {2, 2}, {bq.data(), bq.size()}}});
  auto check_index = [&](const std::string& json, const std::string& what, bool on_use) {
    const std::string p = dir.file("model.safetensors.index.json");
    write_bytes(p, json);
    INFO("index: " << json);
    bool thrown = false;
    try {
      io::Checkpoint c(p);
      if (on_use)
        for (const auto& n : c.names()) (void)c.info(n);
    } catch (const io::IoError& e) {
      thrown = true;
      const std::string msg = e.what();
      INFO("message: " << msg);
      CHECK(msg.find(p) != std::string::npos);
      CHECK(msg.find(what) != std::string::npos);
      CHECK(msg.find('\n') == std::string::npos);
    }
    CHECK(thrown);
  };
  check_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})",
              "shard 's2.safetensors' of tensor 'b' does not exist", false);
  check_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})",
              "tensor 'b' is not in shard", true);
  {
    io::Checkpoint c(dir.file("model.safetensors.index.json"));
    CHECK_THROWS_WITH_AS(c.open_all(), doctest::Contains("tensor 'b' is not in shard"),
                         io::IoError);
  }
  check_index(R"({"weight_map": {"a": "../s1.safetensors"}})", "not a relative path", false);
  check_index(R"({"weight_map": {"a": "/etc/passwd"}})", "not a relative path", false);
  check_index(R"({"weight_map": {"a": 3}})", "is not a string", false);
  check_index(R"({"weight_map": [1]})", "no \"weight_map\" object", false);
  check_index(R"({"weight_map": )", "not valid JSON", false);
}

TEST_CASE("reads a file written by the reference Python safetensors package") {
  // tests/data/reference.safetensors: safetensors.numpy.save_file of w64 (F64 2x3, arange/8),
  // w32 (F32 2x2), w16 (F16 [0.5, -1, 65504, 6e-8 = smallest subnormal]) and ids (I64).
  const std::string path =
      (fs::path(__FILE__).parent_path() / "data" / "reference.safetensors").string();
  io::Checkpoint c(path);
  CHECK(c.names() == std::vector<std::string>{"ids", "w16", "w32", "w64"});
  CHECK(c.metadata().at("format") == "np");
  const Mat<double> w64 = c.matrix<double>("w64");
  CHECK(w64(1, 2) == 5.0 / 8);
  const Mat<double> w32 = c.matrix<double>("w32");
  CHECK(w32(1, 0) == 3.25);
  CHECK(w32(1, 1) == static_cast<double>(1e-3f));
  const Mat<double> w16 = c.matrix<double>("w16");
  CHECK(w16(2, 0) == 65504.0);
  CHECK(w16(3, 0) == std::ldexp(1.0, -24));
  CHECK_THROWS_WITH_AS(c.matrix<double>("ids"), doctest::Contains("'ids': dtype I64"), io::IoError);
}

TEST_CASE("every prefix and single-byte corruption of a header is an IoError or a valid parse") {
  const std::string ok =
      R"({"__metadata__":{"a":"b"},"w":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]},)"
      R"("v":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]}})";
  const std::string file = raw_file(ok, 12);
  std::vector<std::uint8_t> bytes(file.begin(), file.end());
  int ok_count = 0, rejected = 0;
  auto attempt = [&](const std::vector<std::uint8_t>& b) {
    try {
      (void)io::parse_safetensors_header(b.data(), b.size(), "p.safetensors");
      ++ok_count;
    } catch (const io::IoError& e) {
      CHECK(std::string(e.what()).rfind("p.safetensors: ", 0) == 0);
      ++rejected;
    }
  };
  for (std::size_t n = 0; n < bytes.size(); ++n)
    attempt(std::vector<std::uint8_t>(bytes.begin(), bytes.begin() + static_cast<long>(n)));
  CHECK(ok_count == 0);
  for (std::size_t k = 0; k < bytes.size(); ++k) {
    for (std::uint8_t x : {std::uint8_t{0x01}, std::uint8_t{0x20}, std::uint8_t{0xFF}}) {
      auto b = bytes;
      b[k] ^= x;
      attempt(b);
    }
  }
  CHECK(rejected > 0);
}
