// What a checkpoint says beyond W_Q, W_K, W_V (spectral_cond/io/layouts/attention_config.hpp,
// MATH.md §10): bias names and slices, CheckpointReader::vector, and RoPE from config.json and GGUF
// metadata, with every refusal.
#include <doctest/doctest.h>
#include <spectral_cond/io/checkpoint.hpp>
#include <spectral_cond/io/formats/detail/safetensors_writer.hpp>
#include <spectral_cond/io/layouts/attention_config.hpp>
#include "support/gguf_bytes.hpp"
#include "support/temp_dir.hpp"

#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace io = spectral_cond::io;
using spectral_cond::Index;
using spectral_cond::Mat;
using spectral_cond::RopePairing;
using spectral_cond::Vec;

namespace {

using sc_test::Gguf;

/// A temporary directory of this test file's (tests/support/temp_dir.hpp).
struct TempDir : sc_test::TempDir {
  TempDir() : sc_test::TempDir("sc-attention-config") {}
};
io::RopeConfig from(const std::string& json) {
  const nlohmann::json j = nlohmann::json::parse(json);
  return io::rope_config_from_json(j, "config.json");
}

void write_file(const fs::path& p, const std::vector<std::uint8_t>& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

}  // namespace

TEST_CASE("bias_name_for and extract_bias follow the weight's name and slot") {
  CHECK(io::bias_name_for("model.layers.0.self_attn.q_proj.weight") ==
        "model.layers.0.self_attn.q_proj.bias");
  CHECK(io::bias_name_for("encoder.layers.1.self_attn.in_proj_weight") ==
        "encoder.layers.1.self_attn.in_proj_bias");
  CHECK(io::bias_name_for("blk.3.attn_k.weight") == "blk.3.attn_k.bias");
  CHECK(io::bias_name_for("q").empty());

  Vec<double> b(12);
  for (Index i = 0; i < 12; ++i) b(i) = static_cast<double>(i);
  // A contiguous slot: features 4..7.
  io::ProjectionSlot s{"qkv.weight", true, 4, 4, 0, 0};
  CHECK(io::extract_bias(s, b, 12, "qkv.bias") == b.segment(4, 4));
  // A packed slot: blocks of 2 features every 6 (GPT-NeoX's per-head q, k, v).
  io::ProjectionSlot p{"qkv.weight", true, 2, 4, 2, 6};
  Vec<double> want(4);
  want << 2, 3, 8, 9;
  CHECK(io::extract_bias(p, b, 12, "qkv.bias") == want);
  CHECK_THROWS_WITH_AS(io::extract_bias(s, b, 9, "m.st: tensor 'qkv.bias'"),
                       doctest::Contains("'qkv.bias' has 12 entries, expected 9"), io::IoError);
}

TEST_CASE("CheckpointReader::vector reads 1-D tensors and names what it refuses") {
  TempDir d;
  std::deque<std::vector<std::uint8_t>> bufs;
  std::vector<io::TensorToWrite> ts;
  auto add = [&](const std::string& name, const Mat<double>& m, std::vector<std::int64_t> shape) {
    bufs.push_back(io::encode_matrix(m, io::Dtype::F32));
    io::TensorToWrite t;
    t.name = name;
    t.dtype = io::Dtype::F32;
    t.shape = std::move(shape);
    t.bytes = {bufs.back().data(), bufs.back().size()};
    ts.push_back(std::move(t));
  };
  Mat<double> w(2, 3);
  w << 1, 2, 3, 4, 5, 6;
  Mat<double> b(3, 1);
  b << 0.5, -1.25, 2;
  Mat<double> bad = b;
  bad(1, 0) = std::numeric_limits<double>::infinity();
  add("w", w, {2, 3});
  add("b", b, {3});
  add("bad", bad, {3});
  const std::string path = (d.path / "m.safetensors").string();
  io::write_safetensors(path, ts, {});
  const io::CheckpointReader r = io::open_checkpoint(path);
  CHECK(r.vector("b") == Vec<double>(b.col(0)));
  CHECK_THROWS_WITH_AS(r.vector("w"), doctest::Contains("'w' has shape [2, 3], expected a 1-D"),
                       io::IoError);
  CHECK_THROWS_WITH_AS(r.vector("bad"), doctest::Contains("'bad' has a NaN or Inf entry at [1]"),
                       io::IoError);
}

TEST_CASE("RoPE from config.json: pairing, base and width by model type; refusals") {
  io::RopeConfig c = from(R"({"model_type": "llama", "rope_theta": 500000.0})");
  CHECK(c.decided);
  CHECK(c.present);
  CHECK(c.refusal.empty());
  CHECK(c.pairing == RopePairing::RotateHalf);
  CHECK(c.theta == 500000.0);
  CHECK(c.for_head(128).dims == 0);  // all of d_k
  CHECK(c.source == "config.json (model_type llama)");

  c = from(R"({"model_type": "qwen2", "rope_scaling": null})");
  CHECK((c.present && c.theta == 10000.0 && c.refusal.empty()));
  c = from(R"({"model_type": "mistral", "rope_scaling": {"rope_type": "default"}})");
  CHECK((c.present && c.refusal.empty()));

  // GPT-NeoX: rotary_pct (default 0.25) and rotary_emb_base.
  c = from(R"({"model_type": "gpt_neox", "rotary_emb_base": 500})");
  CHECK((c.present && c.theta == 500.0 && c.fraction == 0.25));
  CHECK(c.for_head(64).dims == 16);
  c = from(R"({"model_type": "gpt_neox", "rotary_pct": 1.0})");
  CHECK(c.for_head(64).dims == 0);
  // Phi: partial_rotary_factor, default 0.5.
  CHECK(from(R"({"model_type": "phi"})").for_head(80).dims == 40);
  CHECK(from(R"({"model_type": "phi", "partial_rotary_factor": 0.4})").for_head(80).dims == 32);
  // GPT-J: interleaved pairs, rotary_dim absolute.
  c = from(R"({"model_type": "gptj", "rotary_dim": 64})");
  CHECK((c.present && c.pairing == RopePairing::Interleaved));
  CHECK(c.for_head(256).dims == 64);

  // Absolute positions: decided, no RoPE.
  for (const char* t :
       {R"({"model_type": "bert"})", R"({"model_type": "opt"})", R"({"model_type": "vit"})"}) {
    c = from(t);
    CHECK((c.decided && !c.present && c.refusal.empty()));
  }
  // No model type and no rope key: the config does not say.
  c = from(R"({"hidden_size": 16})");
  CHECK_FALSE(c.decided);
  // An unlisted type with a RoPE base has RoPE.
  c = from(R"({"model_type": "newmodel", "rope_theta": 1e6})");
  CHECK((c.decided && c.present && c.theta == 1e6));

  // Refusals: scaled RoPE, ALiBi, rotary of unknown pairing.
  c = from(R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8}})");
  CHECK(c.refusal.find("rope_scaling llama3 is not modelled") != std::string::npos);
  c = from(R"({"model_type": "falcon", "alibi": true})");
  CHECK((!c.present && c.refusal.find("ALiBi") != std::string::npos));
  CHECK(from(R"({"model_type": "bloom"})").refusal.find("ALiBi") != std::string::npos);
  CHECK(from(R"({"model_type": "esm", "position_embedding_type": "rotary"})")
            .refusal.find("pairing is not known") != std::string::npos);

  // transformers 5: rope_theta, partial_rotary_factor and rope_type live in rope_parameters.
  c = from(R"({"model_type": "llama", "rope_parameters": {"rope_theta": 500000.0,
               "rope_type": "default"}})");
  CHECK((c.present && c.theta == 500000.0 && c.refusal.empty()));
  c = from(R"({"model_type": "phi", "rope_parameters": {"rope_theta": 10000.0,
               "partial_rotary_factor": 0.4, "rope_type": "default"}})");
  CHECK((c.present && c.fraction == 0.4 && c.for_head(80).dims == 32));
  c = from(R"({"model_type": "llama", "rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn",
               "factor": 4.0}})");
  CHECK(c.refusal.find("rope_type yarn is not modelled") != std::string::npos);
  // One object per layer type: the same parameters are read, differing ones refused.
  c = from(R"({"model_type": "qwen3", "rope_parameters": {
               "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
               "sliding_attention": {"rope_theta": 1e6, "rope_type": "default"}}})");
  CHECK((c.present && c.theta == 1e6 && c.refusal.empty()));
  c = from(R"({"model_type": "qwen3", "rope_parameters": {
               "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
               "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}})");
  CHECK(c.refusal.find("differ between layer types") != std::string::npos);
  CHECK_THROWS_WITH_AS(from(R"({"model_type": "llama", "rope_parameters": 3})"),
                       doctest::Contains("\"rope_parameters\" must be an object"), io::IoError);

  // Bad values are named.
  CHECK_THROWS_WITH_AS(from(R"({"model_type": "llama", "rope_theta": "big"})"),
                       doctest::Contains("\"rope_theta\" must be a finite number"), io::IoError);
  CHECK_THROWS_WITH_AS(from(R"({"model_type": "phi", "partial_rotary_factor": 1.5})"),
                       doctest::Contains("partial rotary factor must be in (0, 1]"), io::IoError);
  CHECK_THROWS_WITH_AS(from(R"({"model_type": "gpt_neox"})").for_head(4),
                       doctest::Contains("rotated width 1 is not even"), io::IoError);
  CHECK_THROWS_WITH_AS(from("[1]"), doctest::Contains("expected a JSON object"), io::IoError);
}

TEST_CASE("RoPE and biases from GGUF: llama's Q/K biases back in Hugging Face order") {
  TempDir d;
  // Architecture llama, 2 query heads of d = 4 over D = 3, one key/value head. The converter
  // stores row h d + 2 i + t of the Hugging Face row h d + t d / 2 + i: per head o0, o2, o1, o3.
  const Index D = 3;
  std::vector<float> q(8 * D), bq = {1, 3, 2, 4, 5, 7, 6, 8}, bk = {9, 11, 10, 12};
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i) / 8;
  Gguf g;
  g.header(3, 5);
  g.kv_str("general.architecture", "llama")
      .kv_u32("llama.attention.head_count", 2)
      .kv_u32("llama.attention.head_count_kv", 1)
      .kv_f32("llama.rope.freq_base", 500000.0F)
      .kv_u32("llama.rope.dimension_count", 4);
  g.tensor("blk.0.attn_q.weight", {3, 8}, 0, 0).tensor("blk.0.attn_q.bias", {8}, 0, 96);
  g.tensor("blk.0.attn_k.bias", {4}, 0, 128).pad();  // type 0: F32
  for (float x : q) g.f32(x);
  for (float x : bq) g.f32(x);
  for (float x : bk) g.f32(x);
  g.pad();
  const fs::path path = d.path / "m.gguf";
  write_file(path, g.b);

  const io::CheckpointReader r = io::open_checkpoint(path.string());
  Vec<double> want_q(8), want_k(4);
  want_q << 1, 2, 3, 4, 5, 6, 7, 8;
  want_k << 9, 10, 11, 12;
  CHECK(r.vector("blk.0.attn_q.bias") == want_q);
  CHECK(r.vector("blk.0.attn_k.bias") == want_k);
  // The weight's rows go back the same way.
  const Mat<double> w = r.matrix("blk.0.attn_q.weight");
  CHECK(w(1, 0) == static_cast<double>(q[2 * D]));
  CHECK(w(2, 0) == static_cast<double>(q[1 * D]));

  const io::RopeConfig c = io::rope_config_from_gguf(*r.gguf());
  CHECK((c.decided && c.present && c.refusal.empty()));
  CHECK(c.pairing == RopePairing::RotateHalf);
  CHECK(c.theta == 500000.0);
  CHECK(c.dims == 4);
  CHECK(c.for_head(4).dims == 0);
}

TEST_CASE("RoPE from GGUF: an architecture with rope metadata but unknown pairing is refused") {
  TempDir d;
  for (const bool rope : {true, false}) {
    Gguf g;
    g.header(0, rope ? 2 : 1);
    g.kv_str("general.architecture", "newarch");
    if (rope) g.kv_f32("newarch.rope.freq_base", 10000.0F);
    const fs::path path = d.path / (rope ? "a.gguf" : "b.gguf");
    write_file(path, g.pad().b);
    const io::GgufFile f(path.string());
    const io::RopeConfig c = io::rope_config_from_gguf(f);
    CHECK(c.decided);
    CHECK_FALSE(c.present);
    CHECK(c.refusal.empty() == !rope);
  }
}
