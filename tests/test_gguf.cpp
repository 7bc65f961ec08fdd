// Tests of the GGUF reader (include/spectral_cond/io/gguf.hpp): files written by gguf-py, the
// PyPI package of llama.cpp (tests/data/gguf/, made by make_gguf.py, with gguf-py's own
// dequantized values beside them as .npy), the llama Q/K row permutation, and hostile files
// built here byte by byte.
#include "support/gguf_bytes.hpp"
#include "support/test_helpers.hpp"

#include <spectral_cond/io/checkpoint.hpp>
#include <spectral_cond/io/formats/gguf.hpp>
#include <spectral_cond/io/formats/npy.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fs = std::filesystem;
namespace io = spectral_cond::io;
using spectral_cond::Index;
using spectral_cond::Mat;

namespace {

const fs::path kData = fs::path(__FILE__).parent_path() / "data" / "gguf";

std::string data_path(const std::string& name) {
  return (kData / name).string();
}

/// The reference values gguf-py wrote for `tensor` of `file` ("quants", "q4_k").
io::NpyArray reference(const std::string& file, const std::string& tensor) {
  return io::read_npy(data_path(file + "." + tensor + ".npy"));
}

using Bytes = std::vector<std::uint8_t>;

using sc_test::Gguf;

/// A file with one F32 tensor "w" of shape {rows, cols} holding `v` (row-major).
Bytes f32_file(Index rows, Index cols, const std::vector<float>& v) {
  Gguf g;
  g.header(1, 1).kv_str("general.architecture", "test");
  g.tensor("w", {static_cast<std::uint64_t>(cols), static_cast<std::uint64_t>(rows)}, 0, 0).pad();
  for (float x : v) g.f32(x);
  return g.b;
}

io::GgufHeader parse(const Bytes& b) {
  return io::parse_gguf(b.data(), b.size(), "hostile.gguf");
}

/// Parsing `b` throws IoError whose message is one line, starts with the file's name and
/// contains `what`.
void check_bad(const Bytes& b, const std::string& what) {
  INFO("expecting: " << what);
  CHECK_THROWS_WITH_AS(parse(b), doctest::Contains(what.c_str()), io::IoError);
  try {
    (void)parse(b);
  } catch (const io::IoError& e) {
    const std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.rfind("hostile.gguf: gguf: ", 0) == 0);
    CHECK(msg.find('\n') == std::string::npos);
  }
}

/// float32 spacing at |x| (ulp), for x a float32 value.
double ulp32(double x) {
  const float f = std::fabs(static_cast<float>(x));
  return static_cast<double>(std::nextafter(f, std::numeric_limits<float>::infinity()) - f);
}

/// The converter's permutation (convert_hf_to_gguf.py's permute), written out: row h d + 2 i + t
/// of the result is row h d + t d / 2 + i of w.
Mat<double> llama_permute(const Mat<double>& w, Index n_head) {
  const Index d = w.rows() / n_head;
  Mat<double> out(w.rows(), w.cols());
  for (Index h = 0; h < n_head; ++h)
    for (Index i = 0; i < d / 2; ++i)
      for (Index t = 0; t < 2; ++t) out.row(h * d + 2 * i + t) = w.row(h * d + t * (d / 2) + i);
  return out;
}

}  // namespace

TEST_CASE("reads F32, F16, BF16 and F64 tensors written by gguf-py, bit for bit") {
  io::GgufFile f(data_path("floats.gguf"));
  CHECK(f.version() == 3);
  CHECK(f.header().alignment == 64);
  CHECK(f.header().data_start % 64 == 0);
  CHECK(f.names() == std::vector<std::string>{"f32", "f16", "bf16", "f64", "f32_3d"});
  const std::pair<const char*, io::GgmlType> types[] = {{"f32", io::GgmlType::F32},
                                                        {"f16", io::GgmlType::F16},
                                                        {"bf16", io::GgmlType::BF16},
                                                        {"f64", io::GgmlType::F64},
                                                        {"f32_3d", io::GgmlType::F32}};
  for (const auto& nt : types) {
    const std::string name = nt.first;
    const io::GgmlType type = nt.second;
    INFO("tensor " << name);
    const io::GgufTensorInfo& t = f.info(name);
    CHECK(t.type == type);
    CHECK(t.offset % 64 == 0);
    const io::NpyArray ref = reference("floats", name);
    CHECK(t.shape == ref.shape);
    const std::vector<double> v = f.values(name);
    REQUIRE(v.size() == ref.data.size());
    for (std::size_t k = 0; k < v.size(); ++k) {
      INFO("element " << k);
      CHECK(v[k] == ref.data[k]);
      CHECK(std::signbit(v[k]) == std::signbit(ref.data[k]));  // -0.0 stays -0.0
    }
    if (t.shape.size() == 2) {
      const Mat<double> m = f.matrix(name);
      CHECK(m == ref.to_matrix());
    }
  }
  // ne is the shape reversed: ggml's fastest-varying dimension first.
  CHECK(f.info("f32").shape == std::vector<std::int64_t>{3, 5});
  CHECK(f.info("f32").ne() == std::vector<std::int64_t>{5, 3});
  CHECK(f.info("f32").nbytes == 60);
  CHECK(f.info("f32_3d").shape == std::vector<std::int64_t>{2, 3, 4});
  CHECK(f.values("f32_3d")[1 * 12 + 2 * 4 + 3] == 11.5);  // T[1, 2, 3] = (12 + 8 + 3) / 2
  CHECK(f.matrix("f32")(2, 4) == static_cast<double>(1e-30f));
  CHECK(f.matrix("f16")(0, 3) == std::ldexp(1.0, -24));  // the smallest half subnormal
  CHECK(f.matrix("f16")(0, 2) == 65504.0);
  CHECK(f.matrix("f64")(1, 1) == std::ldexp(1.0, 60));
  CHECK_THROWS_WITH_AS(f.matrix("f32_3d"),
                       doctest::Contains("tensor 'f32_3d': has 3 dimensions; a matrix needs "
                                         "exactly 2"),
                       io::IoError);
  CHECK_THROWS_WITH_AS(f.info("nope"),
                       doctest::Contains("floats.gguf: gguf: tensor 'nope': no "
                                         "such tensor"),
                       io::IoError);
  // bytes() is the stored data: F32 little-endian.
  const io::ByteView raw = f.bytes("f32");
  REQUIRE(raw.size == 60);
  float first = 0;
  std::memcpy(&first, raw.data, 4);
  CHECK(static_cast<double>(first) == -7.0 / 8);
}

TEST_CASE("metadata of every value type written by gguf-py") {
  io::GgufFile f(data_path("floats.gguf"));
  CHECK(f.architecture() == "test");
  CHECK(f.get_int("test.u8") == 200);
  CHECK(f.get_int("test.i8") == -100);
  CHECK(f.get_int("test.u16") == 60000);
  CHECK(f.get_int("test.i16") == -30000);
  CHECK(f.get_int("test.u32") == 4000000000LL);
  CHECK(f.get_int("test.i32") == -2000000000LL);
  CHECK(f.get_int("test.i64") == -(std::int64_t{1} << 62));
  CHECK(f.get_int("general.alignment") == 64);
  CHECK_FALSE(f.get_int("test.absent").has_value());
  CHECK_FALSE(f.get_string("test.absent").has_value());
  CHECK(f.get_string("test.string") == "hello, gguf");
  // 2^64 - 1 does not fit in int64: get_int refuses it, as_uint has it.
  CHECK_THROWS_WITH_AS(f.get_int("test.u64"),
                       doctest::Contains("metadata 'test.u64': UINT64 18446744073709551615 is not "
                                         "an integer that fits in int64"),
                       io::IoError);
  CHECK(f.find_metadata("test.u64")->as_uint() == std::numeric_limits<std::uint64_t>::max());
  CHECK_THROWS_WITH_AS(f.get_int("test.string"),
                       doctest::Contains("metadata 'test.string': STRING 'hello, gguf' is not"),
                       io::IoError);
  CHECK_THROWS_WITH_AS(f.get_string("test.u8"),
                       doctest::Contains("metadata 'test.u8': UINT8 200 is not a string"),
                       io::IoError);
  const io::GgufValue& f32 = *f.find_metadata("test.f32");
  CHECK(f32.type() == io::GgufType::FLOAT32);
  CHECK(f32.as_double() == 0.25);
  CHECK_FALSE(f32.as_int().has_value());
  CHECK(f.find_metadata("test.f64")->as_double() == -1.5e300);
  CHECK(f.find_metadata("test.f64")->describe() == "FLOAT64 -1.5e+300");
  CHECK(f32.describe() == "FLOAT32 0.25");
  CHECK(f.find_metadata("test.bool")->describe() == "BOOL true");
  CHECK(f.find_metadata("test.i8")->describe() == "INT8 -100");
  CHECK(f.find_metadata("test.bool")->as_bool() == true);
  CHECK_FALSE(f.find_metadata("test.bool")->as_int().has_value());
  CHECK(f.find_metadata("test.i8")->as_uint() == std::nullopt);
  CHECK(f.find_metadata("test.i8")->as_double() == -100.0);

  const io::GgufValue& ai = *f.find_metadata("test.array_i32");
  CHECK(ai.is_array());
  CHECK(ai.element_type() == io::GgufType::INT32);
  CHECK(ai.size() == 3);
  CHECK(ai.describe() == "ARRAY of 3 INT32");
  const std::vector<io::GgufValue> ints = ai.elements();
  REQUIRE(ints.size() == 3);
  CHECK(ints[1].as_int() == -2);
  const std::vector<io::GgufValue> strs = f.find_metadata("test.array_str")->elements();
  REQUIRE(strs.size() == 3);
  CHECK(strs[0].as_string() == "a");
  CHECK(strs[1].as_string() == "bc");
  CHECK(strs[2].as_string() == "");
  const std::vector<io::GgufValue> nested = f.find_metadata("test.array_nested")->elements();
  REQUIRE(nested.size() == 2);
  CHECK(nested[0].element_type() == io::GgufType::INT32);
  REQUIRE(nested[0].elements().size() == 2);
  CHECK(nested[0].elements()[1].as_int() == 2);
  CHECK(nested[1].elements()[0].as_int() == 3);
  CHECK(f.metadata().size() == 17);
}

TEST_CASE("dequantizes Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants as gguf-py does") {
  // gguf-py dequantizes in float32; this reader gives the exact real number each block encodes
  // (scale x integer, minus min x integer), which double holds exactly: a half has 11
  // significant bits, the integers at most 8, and the terms' exponents span at most 50 bits.
  // Where the value is a single product of at most 24 bits, float32 is exact too and the two
  // agree exactly: d q of Q8_0 (18 bits), Q4_0 (14), Q5_0 (15); d (scale - 32) q of Q3_K (18);
  // d scale (q - 32) of Q6_K (23). Where it ends with an addition (d q + m of Q4_1 and Q5_1;
  // d scale q - dmin min of Q2_K, Q4_K and Q5_K) gguf-py rounds once to float32, so our value
  // rounded to float32 must equal gguf-py's bit for bit, and the two differ by at most half a
  // float32 ulp of the value. Q8_K's reference is d q in float64 (gguf-py has no Q8_K
  // dequantizer): exact.
  io::GgufFile f(data_path("quants.gguf"));
  struct Case {
    const char* name;
    io::GgmlType type;
    bool exact;
  };
  const Case cases[] = {{"q8_0", io::GgmlType::Q8_0, true},  {"q4_0", io::GgmlType::Q4_0, true},
                        {"q4_1", io::GgmlType::Q4_1, false}, {"q5_0", io::GgmlType::Q5_0, true},
                        {"q5_1", io::GgmlType::Q5_1, false}, {"q2_k", io::GgmlType::Q2_K, false},
                        {"q3_k", io::GgmlType::Q3_K, true},  {"q4_k", io::GgmlType::Q4_K, false},
                        {"q5_k", io::GgmlType::Q5_K, false}, {"q6_k", io::GgmlType::Q6_K, true},
                        {"q8_k", io::GgmlType::Q8_K, true}};
  for (const Case& c : cases) {
    INFO("tensor " << std::string(c.name));
    const io::GgufTensorInfo& t = f.info(c.name);
    CHECK(t.type == c.type);
    const io::GgmlTypeInfo& ti = *io::ggml_type_info(static_cast<std::uint32_t>(c.type));
    CHECK(t.nbytes == t.numel() / ti.block_size * ti.type_size);
    const io::NpyArray ref = reference("quants", c.name);
    CHECK(t.shape == ref.shape);
    const std::vector<double> v = f.values(c.name);
    REQUIRE(v.size() == ref.data.size());
    std::size_t rounded = 0, failures = 0;
    double max_ulps = 0;
    for (std::size_t k = 0; k < v.size(); ++k) {
      const double r = ref.data[k];
      if (v[k] != r) ++rounded;
      const bool ok = c.exact ? v[k] == r
                              : static_cast<double>(static_cast<float>(v[k])) == r &&
                                    std::fabs(v[k] - r) <= 0.5 * ulp32(r);
      if (!ok && failures++ < 5) {
        INFO("element " << k << ": ours " << v[k] << ", gguf-py " << r);
        CHECK(ok);
      }
      if (r != 0) max_ulps = std::max(max_ulps, std::fabs(v[k] - r) / ulp32(r));
    }
    CHECK(failures == 0);
    MESSAGE(std::string(c.name) << ": " << v.size() << " values, " << rounded
                                << " differ from gguf-py's float32 by at most " << max_ulps
                                << " float32 ulps");
    const Mat<double> m = f.matrix(c.name);
    CHECK(m.rows() == ref.shape[0]);
    CHECK(m.cols() == ref.shape[1]);
    CHECK(m(1, 3) == v[static_cast<std::size_t>(1 * m.cols() + 3)]);
  }
  // The all-zero block of Q8_0 (d = 0) is zeros; Q4_1's constant block is its min.
  const Mat<double> q8 = f.matrix("q8_0");
  CHECK(q8.block(3, 32, 1, 32).isZero(0));
  const Mat<double> q41 = f.matrix("q4_1");
  CHECK(q41(3, 0) == q41(3, 31));
}

TEST_CASE("undoes the llama Q/K permutation of llama.cpp's converter") {
  io::GgufFile f(data_path("llama.gguf"));
  CHECK(f.architecture() == "llama");
  const auto n_head = f.get_int("llama.attention.head_count");
  const auto n_head_kv = f.get_int("llama.attention.head_count_kv");
  REQUIRE(n_head == 4);
  REQUIRE(n_head_kv == 2);
  CHECK(f.get_int("llama.embedding_length") == 16);
  const Mat<double> q_orig = io::read_npy(data_path("llama.attn_q.orig.npy")).to_matrix();
  const Mat<double> k_orig = io::read_npy(data_path("llama.attn_k.orig.npy")).to_matrix();
  const Mat<double> q = f.matrix("blk.0.attn_q.weight");
  const Mat<double> k = f.matrix("blk.0.attn_k.weight");
  CHECK(q.rows() == 16);
  CHECK(k.rows() == 8);
  CHECK(q != q_orig);  // the file holds the permuted rows
  CHECK(io::undo_llama_rope_permutation(q, *n_head) == q_orig);
  CHECK(io::undo_llama_rope_permutation(k, *n_head_kv) == k_orig);
  CHECK(llama_permute(q_orig, *n_head) == q);  // the test's formula is the converter's
  // Round trip on random shapes.
  std::mt19937_64 rng(5);
  for (const auto& rh : {std::pair<Index, Index>{32, 4}, {8, 1}, {2, 1}, {24, 3}}) {
    const Index rows = rh.first, heads = rh.second;
    INFO(rows << " rows, " << heads << " heads");
    const Mat<double> w = sc_test::randn<double>(rows, 5, rng);
    const Mat<double> p = llama_permute(w, heads);
    CHECK(io::undo_llama_rope_permutation(p, heads) == w);
    CHECK(llama_permute(io::undo_llama_rope_permutation(w, heads), heads) == w);
  }
  CHECK_THROWS_WITH_AS(io::undo_llama_rope_permutation(q, 3),
                       doctest::Contains("rows (16) must be a multiple of 2 x n_head = 6"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(io::undo_llama_rope_permutation(q, 0),
                       doctest::Contains("n_head must be positive"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(io::undo_llama_rope_permutation(Mat<double>(6, 2), 2),
                       doctest::Contains("must be a multiple of 2 x n_head = 4"),
                       std::invalid_argument);
}

TEST_CASE("refuses big-endian files, GGUF v1, unknown versions and other formats") {
  CHECK_THROWS_WITH_AS(io::GgufFile(data_path("bigendian.gguf")),
                       doctest::Contains("bigendian.gguf: gguf: big-endian GGUF file (version 3 "
                                         "byte-swapped) is not supported"),
                       io::IoError);
  check_bad(Gguf().header(0, 0, 1).b, "GGUF version 1 is not supported");
  check_bad(Gguf().header(0, 0, 4).b, "unsupported GGUF version 4");
  check_bad(Gguf().header(0, 0, 0).b, "unsupported GGUF version 0");
  check_bad(Gguf().header(0, 0, 0x30000).b, "unsupported GGUF version 196608");
  check_bad(Gguf().header(0, 0, 0x02000000).b, "big-endian GGUF file (version 2 byte-swapped)");
  check_bad(Bytes{'G', 'G', 'U'}, "not a GGUF file");
  check_bad(Bytes{}, "not a GGUF file");
  check_bad(Bytes{'P', 'K', 3, 4, 0, 0, 0, 0}, "not a GGUF file");
  check_bad(Bytes{'G', 'G', 'U', 'F', 3, 0}, "has no version");
  // A version 2 file (gguf-py writes 3; the layout is the same) reads the same.
  const io::MappedFile m(data_path("floats.gguf"));
  Bytes v2(m.data(), m.data() + m.size());
  v2[4] = 2;
  const io::GgufView view(v2.data(), v2.size(), "v2.gguf");
  CHECK(view.version() == 2);
  CHECK(view.values("f16") == io::GgufFile(data_path("floats.gguf")).values("f16"));
  CHECK(view.buffer().size == v2.size());
}

TEST_CASE("hostile headers: counts, lengths, depths and dimensions are checked first") {
  CHECK_NOTHROW(parse(Gguf().header(0, 0).b));
  Bytes short_header = Gguf().header(0, 0).b;
  short_header.resize(10);
  check_bad(short_header, "file of 10 bytes is too short for the 24-byte header");

  // Counts of 2^63 fail at once, with nothing allocated or looped over.
  check_bad(Gguf().header(0, std::uint64_t{1} << 63).b, "metadata count 9223372036854775808");
  check_bad(Gguf().header(std::uint64_t{1} << 63, 0).b, "tensor count 9223372036854775808");
  check_bad(Gguf().header(0, 1000).zeros(100).b, "metadata count 1000 exceeds what the 100");
  check_bad(Gguf().header(1000, 0).zeros(100).b, "tensor count 1000 exceeds");

  // String lengths against the bytes left.
  check_bad(Gguf().header(0, 1).u64(std::uint64_t{1} << 62).zeros(16).b,
            "metadata entry 0: key length 4611686018427387904 exceeds the 16 bytes left");
  check_bad(Gguf().header(0, 1).str("k").u32(8).u64(~std::uint64_t{0}).b,
            "metadata 'k': string length 18446744073709551615 exceeds the 0 bytes left");
  CHECK(parse(Gguf().header(0, 1).str("k").u32(8).u64(5).raw("abc", 3).zeros(10).b)
            .metadata.at("k")
            .as_string() == std::string("abc\0\0", 5));  // 13 bytes left: 5 fit
  check_bad(Gguf().header(1, 0).u64(1000).zeros(30).b, "tensor info 0: name length 1000");
  check_bad(Gguf().header(0, 1).str("").u32(4).u32(1).b, "metadata entry 0: empty key");

  // Arrays: element types, lengths, nesting.
  check_bad(Gguf().header(0, 1).str("a").u32(9).u32(0).u64(std::uint64_t{1} << 62).zeros(8).b,
            "metadata 'a': array of 4611686018427387904 UINT8 needs at least 1 bytes each, only "
            "8 bytes left");
  check_bad(Gguf().header(0, 1).str("a").u32(9).u32(8).u64(1000).zeros(100).b,
            "array of 1000 STRING needs at least 8 bytes each");
  check_bad(Gguf().header(0, 1).str("a").u32(9).u32(8).u64(2).u64(1).raw("x", 1).u64(50).b,
            "metadata 'a': string length 50 exceeds the 0 bytes left");
  check_bad(Gguf().header(0, 1).str("a").u32(9).u32(13).u64(0).b,
            "metadata 'a': array of unknown value type 13");
  check_bad(Gguf().header(0, 1).str("a").u32(13).zeros(8).b, "metadata 'a': unknown value type 13");
  check_bad(Gguf().header(0, 1).str("a").u32(9).u32(7).u64(3).u8(1).u8(0).u8(2).b,
            "metadata 'a': array element 2: bool value 2 is neither 0 nor 1");
  check_bad(Gguf().header(0, 1).str("b").u32(7).u8(5).b,
            "metadata 'b': bool value 5 is neither 0 nor 1");
  {
    Gguf deep;
    deep.header(0, 1).str("deep").u32(9);
    for (int k = 0; k < 12; ++k) deep.u32(9).u64(1);
    deep.u32(4).u64(0);
    check_bad(deep.b, "metadata 'deep': arrays nested deeper than 8 levels");
    Gguf ok;  // 7 levels of arrays around an empty UINT8 array: 8 levels in all
    ok.header(0, 1).str("deep").u32(9);
    for (int k = 0; k < 7; ++k) ok.u32(9).u64(1);
    ok.u32(0).u64(0);
    const io::GgufHeader h = parse(ok.b);
    io::GgufValue v = h.metadata.at("deep");
    for (int k = 0; k < 7; ++k) {
      REQUIRE(v.size() == 1);
      v = v.elements().at(0);
    }
    CHECK(v.element_type() == io::GgufType::UINT8);
    CHECK(v.size() == 0);
  }
  check_bad(Gguf().header(0, 2).kv_u32("k", 1).kv_u32("k", 2).b, "metadata 'k': duplicate key");

  // general.alignment: a power of two, at most 64 KiB.
  check_bad(Gguf().header(0, 1).kv_u32("general.alignment", 48).b,
            "metadata 'general.alignment': UINT32 48 is not a power of two between 1 and 65536");
  check_bad(Gguf().header(0, 1).kv_u32("general.alignment", 0).b, "is not a power of two");
  check_bad(Gguf().header(0, 1).kv_u32("general.alignment", 1u << 20).b, "is not a power of two");
  check_bad(Gguf().header(0, 1).kv_str("general.alignment", "32").b,
            "metadata 'general.alignment': STRING '32' is not a power of two");

  // Tensor infos.
  const std::uint64_t big = std::uint64_t{1} << 32;
  check_bad(Gguf().header(1, 0).tensor("w", {1, 1, 1, 1, 1}, 0, 0).b,
            "tensor 'w': 5 dimensions (at most 4)");
  check_bad(Gguf().header(1, 0).str("w").u32(0xFFFFFFFFu).zeros(16).b,
            "tensor 'w': 4294967295 dimensions (at most 4)");
  check_bad(Gguf().header(1, 0).tensor("w", {big, big}, 0, 0).b,
            "tensor 'w': shape product overflows");
  check_bad(Gguf().header(1, 0).tensor("w", {0, big, big}, 0, 0).b,
            "tensor 'w': shape product overflows");  // empty, but no bounded extent
  check_bad(Gguf().header(1, 0).tensor("w", {std::uint64_t{1} << 63}, 0, 0).b,
            "tensor 'w': dimension ne[0] = 9223372036854775808 exceeds 2^63 - 1");
  check_bad(Gguf().header(1, 0).tensor("w", {std::uint64_t{1} << 62}, 0, 0).b,
            "tensor 'w': byte size overflows");  // 2^62 x 4 bytes
  check_bad(Gguf().header(1, 0).tensor("w", {4}, 99, 0).b, "tensor 'w': unknown ggml type 99");
  check_bad(Gguf().header(1, 0).tensor("w", {4}, 4, 0).b, "tensor 'w': unknown ggml type 4");
  check_bad(Gguf().header(1, 0).tensor("w", {48, 2}, 8, 0).pad().zeros(1000).b,
            "tensor 'w': row length 48 (ne[0]) is not a multiple of the Q8_0 block size 32");
  check_bad(Gguf().header(1, 0).tensor("w", {128}, 12, 0).pad().zeros(1000).b,
            "tensor 'w': row length 128 (ne[0]) is not a multiple of the Q4_K block size 256");
  check_bad(Gguf().header(2, 0).tensor("w", {4}, 0, 0).tensor("w", {4}, 0, 32).pad().zeros(64).b,
            "tensor 'w': duplicate tensor name");
  check_bad(Gguf().header(1, 0).tensor("", {4}, 0, 0).pad().zeros(16).b,
            "tensor info 0: empty name");
  check_bad(Gguf().header(1, 0).tensor("w", {4}, 0, 4).pad().zeros(64).b,
            "tensor 'w': offset 4 is not a multiple of the alignment 32");
  check_bad(Gguf().header(1, 0).tensor("w", {4}, 0, 32).pad().zeros(40).b,
            "tensor 'w': data [32, +16 bytes) lies outside the data section of 40 bytes");
  check_bad(Gguf().header(1, 0).tensor("w", {4}, 0, 0).b,
            "tensor 'w': data [0, +16 bytes) lies outside the data section of 0 bytes");
  check_bad(Gguf().header(2, 0).tensor("a", {16}, 0, 0).tensor("b", {4}, 0, 32).pad().zeros(64).b,
            "tensor 'b': data overlaps tensor 'a'");
  // Empty tensors may share an offset; a file whose data section is missing is fine without
  // tensor bytes.
  CHECK(parse(Gguf().header(2, 0).tensor("a", {0}, 0, 0).tensor("b", {0, 3}, 8, 0).b)
            .tensors.size() == 2);
  // Truncation inside a tensor info.
  Bytes cut = Gguf().header(1, 0).tensor("w", {4, 4}, 0, 0).b;
  cut.resize(cut.size() - 10);
  check_bad(cut, "tensor 'w': ggml type (4 bytes at offset");
  check_bad(cut, "runs past the end of the file");
}

TEST_CASE("values and matrix refuse NaN, infinities and types they cannot dequantize") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  {
    const Bytes b = f32_file(2, 3, {1, 2, 3, 4, 5, nan});
    const io::GgufView v(b.data(), b.size(), "nan.gguf");
    CHECK_THROWS_WITH_AS(v.matrix("w"),
                         doctest::Contains("nan.gguf: gguf: tensor 'w': entry [1, 2] is NaN"),
                         io::IoError);
    CHECK_THROWS_WITH_AS(v.values("w"), doctest::Contains("tensor 'w': entry [1, 2] is NaN"),
                         io::IoError);
  }
  {
    const Bytes b = f32_file(2, 3, {1, -inf, 3, 4, 5, 6});
    const io::GgufView v(b.data(), b.size(), "inf.gguf");
    CHECK_THROWS_WITH_AS(v.matrix("w"), doctest::Contains("tensor 'w': entry [0, 1] is -inf"),
                         io::IoError);
  }
  {
    const Bytes b = f32_file(2, 3, {1, 2, 3, 4, 5, 6});
    const io::GgufView v(b.data(), b.size(), "ok.gguf");
    Mat<double> want(2, 3);
    want << 1, 2, 3, 4, 5, 6;
    CHECK(v.matrix("w") == want);
  }
  {
    // Q8_0 with an infinite scale (half 0x7C00): q = 0 gives NaN, q = 1 +inf.
    Gguf g;
    g.header(1, 0).tensor("blk.0.attn_q.weight", {32, 1}, 8, 0).pad();
    g.u8(0x00).u8(0x7C).u8(1).zeros(31);
    const io::GgufView v(g.b.data(), g.b.size(), "q8.gguf");
    CHECK_THROWS_WITH_AS(
        v.values("blk.0.attn_q.weight"),
        doctest::Contains("q8.gguf: gguf: tensor 'blk.0.attn_q.weight': entry [0, 0] is +inf "
                          "after dequantizing Q8_0"),
        io::IoError);
  }
  {
    // Known types that are listed but not dequantized: the file opens, values() says why.
    Gguf g;
    g.header(2, 0).tensor("iq", {256}, 16, 0).tensor("ids", {4}, 26, 96).pad().zeros(128);
    const io::GgufView v(g.b.data(), g.b.size(), "iq.gguf");
    CHECK(v.info("iq").nbytes == 66);
    CHECK(v.info("iq").type == io::GgmlType::IQ2_XXS);
    CHECK(std::string(io::to_string(v.info("ids").type)) == "I32");
    CHECK_THROWS_WITH_AS(v.values("iq"),
                         doctest::Contains("tensor 'iq': type IQ2_XXS (16) cannot be dequantized"),
                         io::IoError);
    CHECK_THROWS_WITH_AS(v.matrix("ids"), doctest::Contains("a matrix needs exactly 2"),
                         io::IoError);
    CHECK_THROWS_WITH_AS(v.values("ids"), doctest::Contains("type I32 (26) cannot be dequantized"),
                         io::IoError);
    CHECK_THROWS_WITH_AS(v.architecture(),
                         doctest::Contains("iq.gguf: gguf: metadata 'general.architecture' is "
                                           "missing"),
                         io::IoError);
  }
  {
    // Empty tensors read as empty matrices, whatever their other dimension.
    Gguf g;
    g.header(1, 0).tensor("e", {0, std::uint64_t{1} << 40}, 0, 0);
    const io::GgufView v(g.b.data(), g.b.size(), "empty.gguf");
    const Mat<double> m = v.matrix("e");
    CHECK(m.rows() == Index{1} << 40);
    CHECK(m.cols() == 0);
  }
}

TEST_CASE("GgufFile: moves keep the mapping; names in messages are quoted") {
  io::GgufFile a(data_path("llama.gguf"));
  const Mat<double> before = a.matrix("blk.0.attn_v.weight");
  io::GgufFile b(std::move(a));
  CHECK(b.matrix("blk.0.attn_v.weight") == before);
  CHECK(b.path() == data_path("llama.gguf"));
  CHECK(b.name() == b.path());
  CHECK_THROWS_WITH_AS(io::GgufFile(data_path("absent.gguf")), doctest::Contains("absent.gguf"),
                       io::IoError);
  // A tensor name with control bytes is escaped: the message stays one line.
  Gguf g;
  g.header(1, 0).tensor("bad\nname", {4}, 99, 0);
  check_bad(g.b, "tensor 'bad\\x0aname': unknown ggml type 99");
}

TEST_CASE("every prefix and single-byte corruption of a file is an IoError or a valid parse") {
  // Both fixtures, to cover metadata arrays and quantized tensors; every tensor of every parse
  // that succeeds is also dequantized (under ASan this checks that no read leaves the buffer).
  for (const char* name : {"floats.gguf", "quants.gguf"}) {
    INFO("fixture " << std::string(name));
    const io::MappedFile m(data_path(name));
    const Bytes bytes(m.data(), m.data() + m.size());
    const io::GgufHeader full = io::parse_gguf(bytes.data(), bytes.size(), name);
    std::uint64_t data_end = 0;
    for (const auto& t : full.tensors)
      data_end = std::max(data_end, full.data_start + t.offset + t.nbytes);
    int ok = 0, rejected = 0, values_ok = 0, values_rejected = 0;
    auto attempt = [&](const Bytes& b) {
      try {
        const io::GgufView v(b.data(), b.size(), "p.gguf");
        ++ok;
        for (const auto& t : v.tensors()) {
          try {
            (void)v.values(t.name);
            ++values_ok;
          } catch (const io::IoError& e) {
            CHECK(std::string(e.what()).rfind("p.gguf: gguf: ", 0) == 0);
            ++values_rejected;
          }
        }
      } catch (const io::IoError& e) {
        CHECK(std::string(e.what()).rfind("p.gguf: gguf: ", 0) == 0);
        ++rejected;
      }
    };
    // Every prefix that cuts tensor data (or anything before it) fails; only the final
    // padding may be cut.
    const std::size_t step = SC_TEST_SANITIZED ? 7 : 1;
    int prefix_ok = 0;
    for (std::size_t n = 0; n < bytes.size(); n += step) {
      const Bytes b(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
      const int before = ok;
      attempt(b);
      if (ok > before) {
        ++prefix_ok;
        CHECK(n >= data_end);
      }
    }
    for (std::size_t k = 0; k < bytes.size(); k += step) {
      for (std::uint8_t x : {std::uint8_t{0x01}, std::uint8_t{0x80}, std::uint8_t{0xFF}}) {
        Bytes b = bytes;
        b[k] ^= x;
        attempt(b);
      }
    }
    CHECK(rejected > 0);
    CHECK(ok > 0);
    MESSAGE(std::string(name) << ": " << ok << " parses (" << prefix_ok << " prefixes), "
                              << rejected << " rejected; values: " << values_ok << " read, "
                              << values_rejected << " rejected");
  }
}

TEST_CASE(
    "open_checkpoint: a llama GGUF file, its layers found and Q/K back in Hugging Face order") {
  const io::CheckpointReader r = io::open_checkpoint(data_path("llama.gguf"));
  CHECK(r.format() == io::CheckpointFormat::Gguf);
  REQUIRE(r.gguf() != nullptr);
  const io::LayoutMatch m = io::detect_layers(r.layout_view(), io::Layout::Auto, r.path());
  CHECK(m.layout == io::Layout::Gguf);
  REQUIRE(m.layers.size() == 1);
  CHECK(m.layers[0].D == 16);
  CHECK(m.layers[0].q.width == 16);
  CHECK(m.layers[0].k.width == 8);  // two key/value heads of width 4
  // The converter's row permutation is undone: the matrices are the weights before it.
  CHECK(r.matrix("blk.0.attn_q.weight") ==
        io::read_npy(data_path("llama.attn_q.orig.npy")).to_matrix());
  CHECK(r.matrix("blk.0.attn_k.weight") ==
        io::read_npy(data_path("llama.attn_k.orig.npy")).to_matrix());
  CHECK(r.matrix("blk.0.attn_v.weight") == r.gguf()->matrix("blk.0.attn_v.weight"));
  CHECK(r.dtype("blk.0.attn_q.weight") == io::Dtype::F32);
  // Found in a directory, too.
  const io::CheckpointReader q = io::open_checkpoint(data_path("quants.gguf"));
  CHECK(q.format() == io::CheckpointFormat::Gguf);
}
