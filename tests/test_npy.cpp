// The .npy reader and writer (spectral_cond/io/formats/npy.hpp) and atomic writes
// (atomic_file.hpp): round trips, hand-written files of every supported kind, and every malformed
// case.
#include <spectral_cond/io/formats/npy.hpp>
#include <spectral_cond/jacobian/jacobian.hpp>

#include "support/temp_dir.hpp"
#include "support/test_helpers.hpp"

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#ifdef __linux__
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace fs = std::filesystem;
using namespace spectral_cond;
using io::IoError;
using io::NpyArray;
using sc_test::randn;

namespace {

using Bytes = std::vector<std::uint8_t>;

/// A temporary directory of this test file's (tests/support/temp_dir.hpp).
struct TempDir : sc_test::TempDir {
  TempDir() : sc_test::TempDir("sc-npy") {}
};

/// A .npy file by hand: magic, version (major.0), header length, `dict` padded with spaces to
/// a multiple of 64 and a '\n' (unless pad is false), then `data`.
Bytes make_npy(unsigned major, const std::string& dict, const Bytes& data, bool pad = true) {
  const std::size_t pre = major == 1 ? 10 : 12;
  std::string h = dict;
  if (pad) {
    h.append((64 - (pre + h.size() + 1) % 64) % 64, ' ');
    h += '\n';
  }
  Bytes out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<std::uint8_t>(major), 0};
  const std::size_t len = h.size();
  for (std::size_t b = 0; b < pre - 8; ++b)
    out.push_back(static_cast<std::uint8_t>(len >> (8 * b)));
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

template <typename T>
Bytes le_bytes(std::initializer_list<T> values) {
  Bytes out;
  for (const T v : values) {
    std::uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));  // the test hosts are little-endian (checked below)
    out.insert(out.end(), b, b + sizeof(T));
  }
  return out;
}

NpyArray parse(const Bytes& b, const std::string& name = "t.npy") {
  return io::parse_npy(b.data(), b.size(), name);
}

void write_file(const std::string& path, const Bytes& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

Bytes read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

/// The IoError message of parse_npy on `b`, "" when it does not throw.
std::string parse_error(const Bytes& b, const std::string& name = "bad.npy") {
  try {
    parse(b, name);
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

const std::string kF8_2x3 = "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }";

bool bit_equal(const Mat<double>& a, const Mat<double>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(),
                                       sizeof(double) * static_cast<std::size_t>(a.size())) == 0);
}

}  // namespace

TEST_CASE("npy: the test host is little-endian") {
  const std::uint16_t one = 1;
  std::uint8_t b[2];
  std::memcpy(b, &one, 2);
  REQUIRE(b[0] == 1);
}

TEST_CASE("npy: float64 C-order round trip is bit-exact, header as the spec says") {
  TempDir dir;
  std::mt19937_64 rng(11);
  INFO("seed 11");
  for (const auto& shape : {std::pair<Index, Index>{5, 7}, {1, 1}, {0, 3}, {4, 0}, {40, 300}}) {
    Mat<double> m = randn<double>(shape.first, shape.second, rng);
    if (m.size() > 2) {
      m(0, 1) = -0.0;
      m(1, 0) = std::numeric_limits<double>::infinity();
      m(0, 2) = std::numeric_limits<double>::denorm_min();
    }
    const std::string path = dir.file("m.npy");
    io::write_npy(path, m);
    const Bytes bytes = read_file(path);
    REQUIRE(bytes.size() >= 64);
    const std::size_t hlen = bytes[8] | std::size_t(bytes[9]) << 8;
    CHECK(bytes[6] == 1);
    CHECK(bytes[7] == 0);
    CHECK((10 + hlen) % 64 == 0);
    CHECK(bytes[10 + hlen - 1] == '\n');
    const std::string header(bytes.begin() + 10, bytes.begin() + 10 + static_cast<long>(hlen));
    CHECK(header.find("'descr': '<f8'") != std::string::npos);
    CHECK(header.find("'fortran_order': False") != std::string::npos);
    CHECK(header.find("'shape': (" + std::to_string(m.rows()) + ", " + std::to_string(m.cols()) +
                      ")") != std::string::npos);
    REQUIRE(bytes.size() == 10 + hlen + 8 * static_cast<std::size_t>(m.size()));
    // Entry [i, j] of the C-order array sits at data + 8 (i cols + j).
    for (Index i = 0; i < m.rows(); ++i)
      for (Index j = 0; j < m.cols(); ++j) {
        double v;
        std::memcpy(&v, bytes.data() + 10 + hlen + 8 * static_cast<std::size_t>(i * m.cols() + j),
                    8);
        CHECK(std::memcmp(&v, &m(i, j), 8) == 0);
      }
    const NpyArray a = io::read_npy(path);
    CHECK(a.dtype == "<f8");
    CHECK_FALSE(a.fortran_order);
    CHECK(a.shape == std::vector<std::int64_t>{m.rows(), m.cols()});
    CHECK(bit_equal(a.to_matrix(), m));
    CHECK(bit_equal(parse(io::encode_npy(m)).to_matrix(), m));
    CHECK(io::encode_npy(m) == bytes);
  }
}

TEST_CASE("npy: writing from expressions, blocks and float") {
  TempDir dir;
  std::mt19937_64 rng(12);
  const Mat<double> m = randn<double>(6, 4, rng);
  io::write_npy(dir.file("t.npy"), m.transpose());
  CHECK(io::read_npy(dir.file("t.npy")).to_matrix() == m.transpose());
  io::write_npy(dir.file("b.npy"), m.block(1, 1, 3, 2));
  CHECK(io::read_npy(dir.file("b.npy")).to_matrix() == m.block(1, 1, 3, 2));

  const Mat<float> f = randn<float>(3, 5, rng);
  io::write_npy(dir.file("f.npy"), f);
  const NpyArray a = io::read_npy(dir.file("f.npy"));
  CHECK(a.dtype == "<f4");
  CHECK(a.as<float>() == f);
  CHECK(a.to_matrix() == f.cast<double>());
  CHECK(dir.entries().size() == 3);  // no temporary files left
}

TEST_CASE("npy: writing replaces an existing file") {
  TempDir dir;
  const std::string path = dir.file("m.npy");
  io::write_npy(path, Mat<double>::Ones(2, 2));
  io::write_npy(path, Mat<double>::Zero(3, 1));
  CHECK(io::read_npy(path).to_matrix() == Mat<double>::Zero(3, 1));
  CHECK(dir.entries() == std::vector<std::string>{"m.npy"});
}

TEST_CASE("npy: hand-written float32, Fortran order, versions 2.0 and 3.0, float16") {
  // float32 C order, 2 x 3: [[1, 2, 3], [4, 5, 6]]
  const NpyArray f4 =
      parse(make_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                     le_bytes<float>({1, 2, 3, 4, 5, 6})));
  Mat<double> expect(2, 3);
  expect << 1, 2, 3, 4, 5, 6;
  CHECK(f4.to_matrix() == expect);
  CHECK(f4.dtype == "<f4");

  // float64 Fortran order: the data is column-major.
  const NpyArray fo =
      parse(make_npy(1, "{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3), }",
                     le_bytes<double>({1, 4, 2, 5, 3, 6})));
  CHECK(fo.fortran_order);
  CHECK(fo.to_matrix() == expect);

  // float32 Fortran order, version 2.0 header, keys in another order, double quotes.
  const NpyArray v2 =
      parse(make_npy(2, "{\"shape\": (2, 3), \"fortran_order\": True, \"descr\": \"<f4\"}",
                     le_bytes<float>({1, 4, 2, 5, 3, 6})));
  CHECK(v2.to_matrix() == expect);
  const NpyArray v3 = parse(make_npy(3, kF8_2x3, le_bytes<double>({1, 2, 3, 4, 5, 6})));
  CHECK(v3.to_matrix() == expect);

  // Unpadded header without '\n', no spaces, no trailing comma, Python 2 long literals.
  const NpyArray tight = parse(make_npy(1, "{'descr':'<f8','fortran_order':False,'shape':(2L,3L)}",
                                        le_bytes<double>({1, 2, 3, 4, 5, 6}), false));
  CHECK(tight.to_matrix() == expect);

  // float16: 1, -2, 65504 (max), 2^-24 (smallest subnormal), +inf, -0
  const NpyArray f2 =
      parse(make_npy(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (6,), }",
                     le_bytes<std::uint16_t>({0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00, 0x8000})));
  REQUIRE(f2.data.size() == 6);
  CHECK(f2.data[0] == 1.0);
  CHECK(f2.data[1] == -2.0);
  CHECK(f2.data[2] == 65504.0);
  CHECK(f2.data[3] == std::ldexp(1.0, -24));
  CHECK(f2.data[4] == std::numeric_limits<double>::infinity());
  CHECK(std::signbit(f2.data[5]));
  CHECK(f2.shape_string() == "(6,)");
}

TEST_CASE("npy: 0-d, 1-d, 3-d and empty arrays") {
  const NpyArray s = parse(make_npy(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (), }",
                                    le_bytes<double>({2.5})));
  CHECK(s.shape.empty());
  CHECK(s.numel() == 1);
  CHECK(s.data[0] == 2.5);
  CHECK(s.shape_string() == "()");
  const NpyArray t =
      parse(make_npy(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 2, 2), }",
                     le_bytes<double>({1, 2, 3, 4})));
  CHECK(t.ndim() == 3);
  CHECK(t.shape_string() == "(1, 2, 2)");
  const NpyArray e =
      parse(make_npy(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (0, 5), }", {}));
  CHECK(e.to_matrix().rows() == 0);
  CHECK(e.to_matrix().cols() == 5);
  // to_matrix needs a 2-D array, and says so naming the file.
  for (const NpyArray* a : {&s, &t}) {
    try {
      (void)a->to_matrix();
      FAIL("to_matrix of a non-2-D array did not throw");
    } catch (const IoError& err) {
      CHECK(std::string(err.what()).rfind("t.npy: expected a 2-D array, got shape (", 0) == 0);
    }
  }
}

TEST_CASE("npy: every malformed input is an IoError naming the file") {
  const Bytes good = make_npy(1, kF8_2x3, le_bytes<double>({1, 2, 3, 4, 5, 6}));
  REQUIRE(parse_error(good).empty());

  struct Case {
    const char* what;
    Bytes bytes;
    const char* expect;  // a substring of the message
  };
  Bytes bad_magic = good;
  bad_magic[1] = 'M';
  Bytes v4 = good;
  v4[6] = 4;
  Bytes v11 = good;
  v11[7] = 1;
  Bytes past_end = good;
  past_end[8] = 0xff;
  past_end[9] = 0x7f;  // 32767 > file size
  Bytes huge_header = make_npy(2, kF8_2x3, {});
  huge_header[10] = 0x40;  // 0x40000000 = 1 GiB
  Bytes truncated = good;
  truncated.resize(truncated.size() - 8);
  Bytes trailing = good;
  trailing.push_back(0);
  const Bytes d48 = le_bytes<double>({1, 2, 3, 4, 5, 6});
  auto hdr = [&](const std::string& dict, const Bytes& data = {}) {
    return make_npy(1, dict, data);
  };

  const std::vector<Case> cases = {
      {"empty", {}, "not a .npy file (bad magic"},
      {"short", {0x93, 'N', 'U'}, "not a .npy file (bad magic"},
      {"wrong magic", bad_magic, "not a .npy file (bad magic"},
      {"ends in version", Bytes(good.begin(), good.begin() + 7), "truncated"},
      {"ends in header length", Bytes(good.begin(), good.begin() + 9), "truncated"},
      {"version 4.0", v4, "unsupported .npy format version 4.0"},
      {"version 1.1", v11, "unsupported .npy format version 1.1"},
      {"header past end", past_end, "header length 32767 runs past the end of the file"},
      {"header too long", huge_header, "exceeds the limit"},
      {"truncated data", truncated,
       "truncated: header says 2 x 3 float64 = 48 bytes of data, file has 40"},
      {"trailing bytes", trailing, "1 trailing bytes after the data"},
      {"not a dict", hdr("['descr', '<f8']"), "bad header: expected '{'"},
      {"unterminated dict", hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3)"),
       "bad header"},
      {"unterminated string", hdr("{'descr: '<f8'"), "bad header"},
      {"missing key", hdr("{'descr': '<f8', 'shape': (2, 3)}", d48), "missing key 'fortran_order'"},
      {"extra key", hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), 'x': 1}"),
       "unexpected key 'x'"},
      {"duplicate key", hdr("{'descr': '<f8', 'descr': '<f8', 'fortran_order': False}"),
       "appears twice"},
      {"bad bool", hdr("{'descr': '<f8', 'fortran_order': 0, 'shape': (2, 3)}"),
       "must be True or False"},
      {"text after dict", hdr(kF8_2x3 + " x", d48), "unexpected text after the dict"},
      {"missing comma", hdr("{'descr': '<f8' 'fortran_order': False, 'shape': (2, 3)}"),
       "expected ',' or '}'"},
      {"shape not tuple", hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (6)}", d48),
       "is not a tuple"},
      {"shape list", hdr("{'descr': '<f8', 'fortran_order': False, 'shape': [2, 3]}"),
       "expected '('"},
      {"shape float", hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (2.0, 3)}"),
       "expected ',' or ')'"},
      {"negative shape", hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (-2, 3)}"),
       "negative dimension"},
      {"huge dimension",
       hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999999999,)}"),
       "too large (overflow)"},
      {"overflowing product",
       hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296)}"),
       "is too large (dimensions overflow)"},
      {"large product",
       hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000, 1000000)}"),
       "truncated: header says 1000000 x 1000000 float64"},
      {"nul in header", hdr(std::string("{'descr': '<f8'\0", 16)), "non-ASCII or control byte"},
      {"big-endian", hdr("{'descr': '>f8', 'fortran_order': False, 'shape': (2, 3)}", d48),
       "big-endian dtype '>f8' is not supported"},
      {"int64", hdr("{'descr': '<i8', 'fortran_order': False, 'shape': (2, 3)}", d48),
       "unsupported dtype '<i8'"},
      {"complex", hdr("{'descr': '<c16', 'fortran_order': False, 'shape': (2, 3)}", d48),
       "unsupported dtype '<c16'"},
      {"no byte order", hdr("{'descr': '|f8', 'fortran_order': False, 'shape': (2, 3)}", d48),
       "unsupported dtype '|f8'"},
      {"structured", hdr("{'descr': [('a', '<f8')], 'fortran_order': False, 'shape': (2, 3)}", d48),
       "structured arrays"},
      {"escape", hdr("{'descr': '<f\\8', 'fortran_order': False, 'shape': (2, 3)}", d48),
       "escapes"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    const std::string msg = parse_error(c.bytes, "bad.npy");
    CHECK(msg.rfind("bad.npy: ", 0) == 0);
    CHECK(msg.find(c.expect) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
    if (msg.find(c.expect) == std::string::npos) MESSAGE("got: " << msg);
  }
}

TEST_CASE("npy: every truncation and random corruption parses or throws IoError") {
  // Run under -DSPECTRAL_COND_SANITIZE=ON this also checks that no corruption reads out of
  // bounds or allocates from an unchecked size.
  const std::uint64_t seed = 14;
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<Bytes> goods = {
      make_npy(1, kF8_2x3, le_bytes<double>({1, 2, 3, 4, 5, 6})),
      make_npy(2, "{'descr': '<f4', 'fortran_order': True, 'shape': (3, 1), }",
               le_bytes<float>({1, 2, 3})),
      make_npy(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }",
               le_bytes<std::uint16_t>({0x3c00, 0x7e00}))};
  std::size_t parsed = 0, rejected = 0;
  auto attempt = [&](const Bytes& b) {
    try {
      const NpyArray a = parse(b);
      CHECK(a.data.size() == a.numel());
      ++parsed;
    } catch (const IoError& e) {
      CHECK(std::string(e.what()).rfind("t.npy: ", 0) == 0);
      ++rejected;
    }
  };
  for (const Bytes& good : goods) {
    for (std::size_t len = 0; len < good.size(); ++len)
      attempt(Bytes(good.begin(), good.begin() + static_cast<long>(len)));
    std::uniform_int_distribution<std::size_t> pos(0, good.size() - 1);
    std::uniform_int_distribution<int> byte(0, 255), count(1, 4);
    for (int trial = 0; trial < 3000; ++trial) {
      Bytes b = good;
      for (int k = count(rng); k > 0; --k) b[pos(rng)] = static_cast<std::uint8_t>(byte(rng));
      attempt(b);
    }
  }
  CHECK(parsed > 0);
  CHECK(rejected > 0);
}

TEST_CASE("npy: read_npy checks files the same way and names them") {
  TempDir dir;
  const Bytes good = make_npy(1, kF8_2x3, le_bytes<double>({1, 2, 3, 4, 5, 6}));
  Bytes truncated = good;
  truncated.resize(good.size() - 40);
  Bytes trailing = good;
  trailing.insert(trailing.end(), 8, 0);
  Bytes bad_magic = good;
  bad_magic[0] = 'x';
  auto error_of = [&](const std::string& path) -> std::string {
    try {
      io::read_npy(path);
    } catch (const IoError& e) {
      return e.what();
    }
    return "";
  };
  write_file(dir.file("X.npy"), truncated);
  CHECK(error_of(dir.file("X.npy")) ==
        dir.file("X.npy") +
            ": truncated: header says 2 x 3 float64 = 48 bytes of data, file has 8");
  write_file(dir.file("T.npy"), trailing);
  CHECK(error_of(dir.file("T.npy")).find(dir.file("T.npy") + ": 8 trailing bytes") == 0);
  write_file(dir.file("M.npy"), bad_magic);
  CHECK(error_of(dir.file("M.npy")).find(dir.file("M.npy") + ": not a .npy file") == 0);
  write_file(dir.file("E.npy"), {});
  CHECK(error_of(dir.file("E.npy")).find(dir.file("E.npy") + ": not a .npy file") == 0);
  write_file(dir.file("S.npy"), Bytes(good.begin(), good.begin() + 20));
  CHECK(error_of(dir.file("S.npy")).find("runs past the end of the file (20 bytes)") !=
        std::string::npos);
  CHECK(error_of(dir.file("missing.npy")).find(dir.file("missing.npy") + ": cannot open") == 0);
  CHECK(error_of(dir.path.string()).find(": a directory, not a regular file") != std::string::npos);
  write_file(dir.file("G.npy"), good);
  CHECK(error_of(dir.file("G.npy")).empty());
}

TEST_CASE("atomic writes: a failed write leaves no file and no temporary file") {
  TempDir dir;
  const Mat<double> m = Mat<double>::Ones(3, 3);
  // The directory does not exist: no temporary file can be made.
  const std::string nodir = dir.file("nodir/J.npy");
  CHECK_THROWS_AS(io::write_npy(nodir, m), IoError);
  try {
    io::write_npy(nodir, m);
  } catch (const IoError& e) {
    CHECK(std::string(e.what()).rfind(nodir + ": cannot write: the directory", 0) == 0);
  }
  CHECK(dir.entries().empty());

  // The target is a directory: the rename fails, the temporary file is removed.
  fs::create_directory(dir.file("J.npy"));
  CHECK_THROWS_AS(io::write_npy(dir.file("J.npy"), m), IoError);
  CHECK(dir.entries() == std::vector<std::string>{"J.npy"});
  CHECK(fs::is_directory(dir.file("J.npy")));

  // The writer throws midway: the temporary file is removed, the old target is untouched.
  const std::string path = dir.file("K.npy");
  io::write_npy(path, m);
  const Bytes before = read_file(path);
  CHECK_THROWS_AS(io::atomic_write(path,
                                   [](std::FILE* f) {
                                     std::fputs("partial", f);
                                     throw IoError("K.npy: simulated failure");
                                   }),
                  IoError);
  CHECK(read_file(path) == before);
  CHECK(dir.entries().size() == 2);

  CHECK(dir.entries().size() == 2);
}

#ifdef __linux__
// On Linux the temporary file has no name until it is complete (O_TMPFILE): a process killed
// midway, by SIGKILL or by a file-size limit (SIGXFSZ), leaves nothing beside the target.
TEST_CASE("atomic writes: a process killed midway leaves no file beside the target") {
  TempDir dir;
  const std::string path = dir.file("old.npy");
  io::write_npy(path, Mat<double>::Ones(2, 2));
  const Bytes before = read_file(path);
  for (const int sig : {SIGKILL, SIGXFSZ}) {
    for (const bool fresh : {false, true}) {  // over an existing file, and to a new name
      const std::string target = fresh ? dir.file("new.npy") : path;
      INFO("signal " << sig << (fresh ? ", new target" : ", existing target"));
      const pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        if (sig == SIGXFSZ) {
          const rlimit lim{4096, 4096};
          ::setrlimit(RLIMIT_FSIZE, &lim);
        }
        io::atomic_write(target, [sig](std::FILE* f) {
          const std::vector<char> block(1024, 'x');
          for (int i = 0; i < 64; ++i) {
            std::fwrite(block.data(), 1, block.size(), f);
            std::fflush(f);
          }
          ::raise(sig);
        });
        ::_exit(0);  // not reached
      }
      int status = 0;
      REQUIRE(::waitpid(pid, &status, 0) == pid);
      CHECK(WIFSIGNALED(status));
      CHECK(dir.entries() == std::vector<std::string>{"old.npy"});
      CHECK(read_file(path) == before);
    }
  }
}
#endif

TEST_CASE("atomic writes: bytes, and permissions follow the umask") {
  TempDir dir;
  const std::string path = dir.file("b.bin");
  const char text[] = "hello";
  io::atomic_write_bytes(path, text, 5);
  const Bytes got = read_file(path);
  CHECK(std::string(got.begin(), got.end()) == "hello");
  const auto perms = fs::status(path).permissions();
  CHECK((perms & fs::perms::owner_read) != fs::perms::none);
  CHECK((perms & fs::perms::owner_write) != fs::perms::none);
  CHECK(dir.entries().size() == 1);
}

TEST_CASE("npy: J from the library survives write_npy and read_npy bit for bit") {
  TempDir dir;
  std::mt19937_64 rng(13);
  INFO("seed 13");
  const Mat<double> X = randn<double>(4, 3, rng), WQ = randn<double>(3, 2, rng, 0.5),
                    WK = randn<double>(3, 2, rng, 0.5), WV = randn<double>(3, 2, rng, 0.5);
  const Mat<double> J = attention_jacobian(X, WQ, WK, WV);
  io::write_npy(dir.file("J.npy"), J);
  const NpyArray a = io::read_npy(dir.file("J.npy"));
  CHECK(a.shape == std::vector<std::int64_t>{J.rows(), J.cols()});
  CHECK(bit_equal(a.to_matrix(), J));
}
