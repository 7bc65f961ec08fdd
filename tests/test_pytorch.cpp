// The PyTorch checkpoint reader (spectral_cond/io/formats/pytorch.hpp): files torch.save wrote
// (tests/data/pytorch/make_pytorch.py) against the float64 values numpy computed from the same
// tensors, and hostile pickles built byte by byte here.
#include <doctest/doctest.h>
#include <spectral_cond/io/checkpoint.hpp>
#include <spectral_cond/io/formats/pytorch.hpp>
#include "support/temp_dir.hpp"

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace std::string_literals;
namespace io = spectral_cond::io;
using spectral_cond::Index;
using spectral_cond::Mat;

namespace {

std::string data(const char* name) {
  return (fs::path(__FILE__).parent_path() / "data" / "pytorch" / name).string();
}

/// A temporary directory of this test file's (tests/support/temp_dir.hpp).
struct TempDir : sc_test::TempDir {
  TempDir() : sc_test::TempDir("sc-pytorch") {}
};

const char* kFloatNames[] = {"attn.query.weight", "attn.key.weight", "attn.value.weight",
                             "attn.out.weight",   "fused.q",         "fused.k",
                             "fused.v",           "double"};

void check_against_reference(const io::PytorchFile& f, const std::string& prefix) {
  const io::NpzFile ref(data("reference.npz"));
  for (const char* n : kFloatNames) {
    INFO(n);
    const Mat<double> want = ref.array(n).to_matrix();
    const Mat<double> got = f.matrix(prefix + n);
    REQUIRE(got.rows() == want.rows());
    REQUIRE(got.cols() == want.cols());
    CHECK(got == want);  // F32, F16, BF16 and F64 all convert to double exactly
  }
  const Mat<double> bias = f.matrix(prefix + "bias");  // 1-D: a column
  CHECK(bias.cols() == 1);
  const io::NpyArray rb = ref.array("bias");
  REQUIRE(static_cast<std::size_t>(bias.rows()) == rb.numel());
  for (Index i = 0; i < bias.rows(); ++i) CHECK(bias(i, 0) == rb.data[static_cast<std::size_t>(i)]);
}

// Pickle pieces (protocol 2).
std::string u32(std::uint32_t v) {
  return std::string(reinterpret_cast<const char*>(&v), 4);
}
std::string u64(std::uint64_t v) {
  return std::string(reinterpret_cast<const char*>(&v), 8);
}
std::string ustr(const std::string& s) {
  return "X" + u32(static_cast<std::uint32_t>(s.size())) + s;
}

/// _rebuild_tensor_v2 of a FloatStorage key "0" of `numel` elements (legacy persistent id).
std::string tensor_pickle(int numel, int rows, int cols, int s0, int s1, int offset = 0) {
  auto k = [](int v) { return std::string("K") + static_cast<char>(v); };
  return "ctorch._utils\n_rebuild_tensor_v2\n(" + std::string("(") + ustr("storage") +
         "ctorch\nFloatStorage\n" + ustr("0") + ustr("cpu") + k(numel) + "NtQ" + k(offset) +
         k(rows) + k(cols) + "\x86" + k(s0) + k(s1) + "\x86\x89" +
         "ccollections\nOrderedDict\n)RtR";
}

/// A legacy-format file: magic, protocol 1001, system info, `object`, the key list `keys`, and
/// the storage bytes `rest`.
std::string legacy_file(const std::string& object, const std::string& keys,
                        const std::string& rest) {
  const std::string magic = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.";
  return magic + "\x80\x02M\xe9\x03." + "\x80\x02}." + "\x80\x02" + object + "." + "\x80\x02" +
         keys + "." + rest;
}

std::string floats(std::initializer_list<float> v) {
  std::string s = u64(v.size());
  for (float x : v) s += std::string(reinterpret_cast<const char*>(&x), 4);
  return s;
}

/// One pickle read by the restricted unpickler; the value lives as long as this object.
struct Unpickled {
  std::string bytes;
  io::detail::PickleReader reader;
  io::detail::PickleRef value = nullptr;
  explicit Unpickled(std::string b)
      : bytes(std::move(b)),
        reader(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), "test.pkl",
               true) {
    std::size_t pos = 0;
    value = reader.load(pos);
  }
};

}  // namespace

TEST_CASE("pytorch: the zip format torch.save writes") {
  const io::PytorchFile f(data("zip.pt"));
  CHECK(std::string(f.format()) == "zip");
  CHECK(f.names() == std::vector<std::string>{"attn.key.weight", "attn.out.weight",
                                              "attn.query.weight", "attn.value.weight", "bias",
                                              "double", "fused.k", "fused.q", "fused.v",
                                              "position_ids"});
  CHECK(f.info("attn.value.weight").dtype == io::Dtype::F16);
  CHECK(f.info("attn.out.weight").dtype == io::Dtype::BF16);
  CHECK(f.info("double").dtype == io::Dtype::F64);
  CHECK(f.info("position_ids").dtype == io::Dtype::I64);
  CHECK(f.info("attn.key.weight").shape == std::vector<std::int64_t>{4, 6});
  CHECK_FALSE(f.info("attn.key.weight").contiguous());  // a transposed view
  CHECK(f.info("fused.k").offset == 16);                // a view into a shared storage
  CHECK(f.info("fused.k").storage == f.info("fused.q").storage);
  check_against_reference(f, "");
  CHECK_THROWS_WITH_AS(f.matrix("position_ids"), doctest::Contains("dtype I64"), io::IoError);
  CHECK_THROWS_WITH_AS(f.info("nosuch"), doctest::Contains("no tensor 'nosuch'"), io::IoError);
}

TEST_CASE("pytorch: the legacy format reads the same tensors") {
  const io::PytorchFile f(data("legacy.pt"));
  CHECK(std::string(f.format()) == "legacy");
  CHECK(f.names() == io::PytorchFile(data("zip.pt")).names());
  check_against_reference(f, "");
}

TEST_CASE("pytorch: a training checkpoint: nested dicts, Parameters, objects passed over") {
  const io::PytorchFile f(data("training.pt"));
  check_against_reference(f, "model.");
  CHECK(f.matrix("extra.0") == Mat<double>::Ones(2, 2));
  CHECK(f.matrix("extra.1.w") == Mat<double>::Constant(2, 3, 0.5));  // an nn.Parameter
  CHECK_FALSE(f.tensors().count("epoch"));
}

TEST_CASE("pytorch: bytes() gives row-major bytes, gathered for a strided view") {
  const io::PytorchFile f(data("zip.pt"));
  std::vector<std::uint8_t> buf;
  const io::ByteView b = f.bytes("attn.key.weight", buf);
  REQUIRE(b.size == 4 * 6 * 4);
  const Mat<double> m = f.matrix("attn.key.weight");
  for (Index i = 0; i < 4; ++i)
    for (Index j = 0; j < 6; ++j) {
      float x = 0;
      std::memcpy(&x, b.data + 4 * (i * 6 + j), 4);
      CHECK(static_cast<double>(x) == m(i, j));
    }
  const io::ByteView k = f.bytes("fused.k", buf);  // contiguous: in place, at its offset
  float first = 0;
  std::memcpy(&first, k.data, 4);
  CHECK(static_cast<double>(first) == f.matrix("fused.k")(0, 0));
}

TEST_CASE("open_checkpoint: finds PyTorch checkpoints by their bytes, in files and directories") {
  const io::CheckpointReader r = io::open_checkpoint(data("zip.pt"));
  CHECK(r.format() == io::CheckpointFormat::Pytorch);
  CHECK(r.pytorch() != nullptr);
  CHECK(r.shape("attn.query.weight") == std::vector<std::int64_t>{4, 6});
  CHECK(r.dtype("attn.value.weight") == io::Dtype::F16);
  CHECK(r.matrix("attn.key.weight") == io::PytorchFile(data("zip.pt")).matrix("attn.key.weight"));
  CHECK_THROWS_WITH_AS(r.matrix("bias"), doctest::Contains("expected a 2-D matrix"), io::IoError);

  TempDir d;
  fs::copy_file(data("legacy.pt"), d.path / "pytorch_model.bin");
  const io::CheckpointReader rd = io::open_checkpoint(d.path.string());
  CHECK(rd.format() == io::CheckpointFormat::Pytorch);
  CHECK(rd.file_of("double") == (d.path / "pytorch_model.bin").string());
  // A PyTorch checkpoint under a .safetensors name is still found by its bytes.
  fs::copy_file(data("zip.pt"), d.path / "renamed.safetensors");
  CHECK(io::open_checkpoint((d.path / "renamed.safetensors").string()).format() ==
        io::CheckpointFormat::Pytorch);
}

TEST_CASE("open_checkpoint: a sharded PyTorch checkpoint (pytorch_model.bin.index.json)") {
  // Two shards: a legacy-format BERT and a zip-format MHA model, each tensor mapped to its shard.
  const io::PytorchFile bert(data("bert_legacy.bin")), mha(data("mha_zip.bin"));
  auto index = [&](const std::string& extra) {
    std::string j = R"({"metadata": {"total_size": 1}, "weight_map": {)";
    bool first = true;
    for (const auto& [file, shard] :
         {std::pair<const io::PytorchFile*, const char*>{&bert, "a.bin"}, {&mha, "b.bin"}})
      for (const std::string& n : file->names()) {
        j += (first ? "" : ", ") + ("\"" + n + "\": \"" + shard + "\"");
        first = false;
      }
    return j + extra + "}}";
  };
  TempDir d;
  fs::copy_file(data("bert_legacy.bin"), d.path / "a.bin");
  fs::copy_file(data("mha_zip.bin"), d.path / "b.bin");
  d.write("pytorch_model.bin.index.json", index(""));
  const io::CheckpointReader r = io::open_checkpoint(d.path.string());
  CHECK(r.format() == io::CheckpointFormat::Pytorch);
  CHECK(r.pytorch() == nullptr);  // no single file
  CHECK(r.names().size() == bert.names().size() + mha.names().size());
  const std::string q = "encoder.layer.1.attention.self.query.weight";
  const std::string w = "layers.0.self_attn.in_proj_weight";
  CHECK(r.matrix(q) == bert.matrix(q));
  CHECK(r.matrix(w) == mha.matrix(w));
  CHECK(r.file_of(w) == (d.path / "b.bin").string());
  CHECK(r.pytorch_for(q)->path() == (d.path / "a.bin").string());
  CHECK(r.directory() == d.path.string());
  // The index file itself opens the same checkpoint.
  CHECK(io::open_checkpoint((d.path / "pytorch_model.bin.index.json").string()).matrix(q) ==
        bert.matrix(q));

  // The index and the shards are checked against each other, both ways, naming what is wrong.
  TempDir e;
  fs::copy_file(data("bert_legacy.bin"), e.path / "a.bin");
  fs::copy_file(data("mha_zip.bin"), e.path / "b.bin");
  e.write("pytorch_model.bin.index.json", index(R"(, "ghost.weight": "a.bin")"));
  const io::CheckpointReader re = io::open_checkpoint(e.path.string());
  CHECK_THROWS_WITH_AS(re.matrix(q), doctest::Contains("tensor 'ghost.weight' is not in shard"),
                       io::IoError);
  e.write("pytorch_model.bin.index.json",
          R"({"weight_map": {"encoder.layer.0.attention.self.query.weight": "a.bin"}})");
  CHECK_THROWS_WITH_AS(
      io::open_checkpoint(e.path.string()).shape("encoder.layer.0.attention.self.query.weight"),
      doctest::Contains("is not listed in the index"), io::IoError);
  e.write("pytorch_model.bin.index.json", R"({"weight_map": {"x": "missing.bin"}})");
  CHECK_THROWS_WITH_AS(io::open_checkpoint(e.path.string()),
                       doctest::Contains("shard 'missing.bin' of tensor 'x' does not exist"),
                       io::IoError);
  e.write("pytorch_model.bin.index.json", R"({"weight_map": {"x": "../a.bin"}})");
  CHECK_THROWS_WITH_AS(io::open_checkpoint(e.path.string()),
                       doctest::Contains("not a relative path inside the directory"), io::IoError);
  e.write("not_torch.bin", std::string("\x02\0\0\0\0\0\0\0{}", 10));  // a safetensors file
  e.write("pytorch_model.bin.index.json", R"({"weight_map": {"x": "not_torch.bin"}})");
  CHECK_THROWS_WITH_AS(io::open_checkpoint(e.path.string()).shape("x"),
                       doctest::Contains("that is not a PyTorch checkpoint"), io::IoError);
}

TEST_CASE("open_checkpoint: any other format is named, with the supported ones") {
  TempDir d;
  const std::string h5 = d.write("model.h5", std::string("\x89HDF\r\n\x1a\n", 8) + "rest");
  CHECK_THROWS_WITH_AS(io::open_checkpoint(h5),
                       doctest::Contains("unsupported format: this looks like an HDF5 file"),
                       io::IoError);
  const std::string gz = d.write("model.bin", "\x1f\x8b\x08\x00");
  CHECK_THROWS_WITH_AS(io::open_checkpoint(gz), doctest::Contains("gzip stream; supported: "),
                       io::IoError);
  const std::string junk = d.write("x.safetensors", "abcdefgh");
  CHECK_THROWS_WITH_AS(io::open_checkpoint(junk),
                       doctest::Contains("none of them (first bytes 6162636465666768)"),
                       io::IoError);
  TempDir two;
  fs::copy_file(data("zip.pt"), two.path / "a.pt");
  fs::copy_file(data("zip.pt"), two.path / "b.pt");
  CHECK_THROWS_WITH_AS(io::open_checkpoint(two.path.string()),
                       doctest::Contains("2 candidate files (a.pt, b.pt): pass one of them"),
                       io::IoError);
  TempDir empty;
  CHECK_THROWS_WITH_AS(io::open_checkpoint(empty.path.string()),
                       doctest::Contains("holds no checkpoint; looked for safetensors"),
                       io::IoError);
}

TEST_CASE("pytorch: a crafted legacy file reads, and its checks fire") {
  TempDir d;
  const std::string keys = "]" + ustr("0") + "a";
  // The positive control: a 2 x 2 view of a 4-element storage.
  const std::string ok =
      d.write("ok.pt", legacy_file("}" + ustr("w") + tensor_pickle(4, 2, 2, 2, 1) + "s", keys,
                                   floats({1, 2, 3, 4})));
  const io::PytorchFile f(ok);
  Mat<double> want(2, 2);
  want << 1, 2, 3, 4;
  CHECK(f.matrix("w") == want);
  // Transposed strides over the same bytes.
  const io::PytorchFile t(
      d.write("t.pt", legacy_file("}" + ustr("w") + tensor_pickle(4, 2, 2, 1, 2) + "s", keys,
                                  floats({1, 2, 3, 4}))));
  CHECK(t.matrix("w") == want.transpose());

  auto fails = [&](const std::string& bytes, const char* msg) {
    const std::string p = d.write("bad.pt", bytes);
    CHECK_THROWS_WITH_AS(io::PytorchFile{p}, doctest::Contains(msg), io::IoError);
    CHECK_THROWS_WITH_AS(io::open_checkpoint(p), doctest::Contains(p.c_str()), io::IoError);
  };
  fails(
      legacy_file("}" + ustr("w") + tensor_pickle(4, 3, 3, 3, 1) + "s", keys, floats({1, 2, 3, 4})),
      "tensor 'w': reaches element 8 of storage '0', which holds 4");
  fails(legacy_file("}" + ustr("w") + tensor_pickle(4, 2, 2, 2, 1, 1) + "s", keys,
                    floats({1, 2, 3, 4})),
        "reaches element 4");
  fails(legacy_file("}" + ustr("w") + tensor_pickle(4, 2, 2, 2, 1) + "s", keys,
                    floats({1, 2, 3, 4, 5})),
        "storage '0' holds 5 elements, its persistent id declares 4");
  fails(legacy_file("}" + ustr("w") + tensor_pickle(4, 2, 2, 2, 1) + "s", keys,
                    floats({1, 2, 3, 4}) + "x"),
        "1 bytes after the last storage");
  fails(legacy_file("}" + ustr("w") + tensor_pickle(4, 2, 2, 2, 1) + "s", keys,
                    floats({1, 2, 3, 4}).substr(0, 12)),
        "runs past the end of the file");
  fails(legacy_file("}" + ustr("w") + tensor_pickle(4, 2, 2, 2, 1) + "s", "]", ""),
        "storage '0' is not in the file");
  fails(legacy_file("}" + ustr("w") + tensor_pickle(4, 2, 2, 2, 1) + "s" + ustr("w") +
                        tensor_pickle(4, 2, 2, 2, 1) + "s",
                    keys, floats({1, 2, 3, 4})),
        "tensor 'w': two tensors have this name");
  fails(std::string("\x80\x02}."), "not a torch.save checkpoint (no magic number)");
}

TEST_CASE("pytorch: no code is run: a global is an opaque value, never called") {
  TempDir d;
  const fs::path marker = d.path / "ran";
  const std::string cmd = "touch " + marker.string();
  const std::string evil = "cposix\nsystem\n" + ustr(cmd) + "\x85R";
  const std::string p = d.write("evil.pt", legacy_file(evil, "]", ""));
  CHECK_THROWS_WITH_AS(io::PytorchFile{p},
                       doctest::Contains("holds no tensors (it pickles posix.system"), io::IoError);
  const std::string p2 = d.write("evil2.pt", legacy_file("]" + evil + "a", "]", ""));
  CHECK_THROWS_AS(io::PytorchFile{p2}, io::IoError);
  CHECK_FALSE(fs::exists(marker));
  // An unknown torch rebuild function is refused by name, not passed over.
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02"
                                 "ctorch._utils\n_rebuild_qtensor\n)R."),
                       doctest::Contains("_rebuild_qtensor (quantized, sparse or device"),
                       io::IoError);
}

TEST_CASE("pytorch: the unpickler's bounds") {
  using io::detail::kPickleMaxCells;
  using io::detail::kPickleMaxValues;
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02I12\n."), doctest::Contains("opcode 0x49"), io::IoError);
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02X\xff\xff\xff\xff"
                                 "abc."),
                       doctest::Contains("truncated (4294967295 bytes wanted, 4 left)"),
                       io::IoError);
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02h\x05."),
                       doctest::Contains("memo entry 5 was never stored"), io::IoError);
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x09}."), doctest::Contains("pickle protocol 9"),
                       io::IoError);
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02}}."), doctest::Contains("2 values on its stack"),
                       io::IoError);
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02"
                                 "0."),
                       doctest::Contains("pops an empty stack"), io::IoError);
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02}"), doctest::Contains("truncated"), io::IoError);
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02" + std::string(kPickleMaxValues + 1, ']') + "."),
                       doctest::Contains("values: too large"), io::IoError);
  CHECK_THROWS_WITH_AS(Unpickled("\x80\x02]" + std::string(kPickleMaxCells + 1, '2') + "."),
                       doctest::Contains("cells: too large"), io::IoError);
  // A list that holds itself: read, and walking it for tensors terminates.
  const Unpickled self(
      "\x80\x02]q\x00h\x00"
      "a."s);
  REQUIRE(self.value->items.size() == 1);
  CHECK(self.value->items[0] == self.value);
  TempDir d;
  const std::string p = d.write("cycle.pt", legacy_file("]q\x01h\x01"
                                                        "a",
                                                        "]", ""));
  CHECK_THROWS_WITH_AS(io::PytorchFile{p}, doctest::Contains("holds no tensors"), io::IoError);
}
