// Layout detection from tensor names (MATH.md §8), slot extraction/insertion and head counts.
#include <spectral_cond/io/layouts.hpp>

#include "support/test_helpers.hpp"

#include <cstdio>
#include <fstream>

using namespace spectral_cond;
using namespace spectral_cond::io;

namespace {
std::vector<NamedShape> names(std::initializer_list<NamedShape> l) {
  return l;
}
}  // namespace

TEST_CASE("timm ViT: blocks.i.attn.qkv.weight, 3D x D, rows Q, K, V") {
  const auto ts = names({{"blocks.1.attn.qkv.weight", {576, 192}},
                         {"blocks.0.attn.qkv.weight", {576, 192}},
                         {"blocks.0.attn.qkv.bias", {576}},
                         {"blocks.0.mlp.fc1.weight", {768, 192}}});
  const LayoutMatch m = detect_layers(ts, Layout::Auto, "vit.safetensors");
  CHECK(m.layout == Layout::Timm);
  REQUIRE(m.layers.size() == 2);
  CHECK(m.layers[0].index == 0);
  CHECK(m.layers[1].index == 1);
  CHECK(m.layers[0].D == 192);
  CHECK(m.layers[0].k.offset == 192);
  CHECK(m.layers[0].v.offset == 384);
  CHECK(m.layers[0].q.transposed);
}

TEST_CASE("extract and insert are inverse, for Linear and Conv1D slots") {
  std::mt19937_64 rng(5);
  Mat<double> T = sc_test::randn<double>(12, 4, rng);  // 3D x D with D = 4
  const ProjectionSlot k{"t", true, 4, 4};
  const Mat<double> WK = extract_projection(k, T);
  CHECK(WK.rows() == 4);
  CHECK(WK(1, 2) == T(4 + 2, 1));  // W = T[4:8, :]^T
  Mat<double> T2 = T;
  insert_projection(k, Mat<double>(WK * 2.0), T2);
  CHECK(T2.middleRows(4, 4) == 2.0 * T.middleRows(4, 4));
  CHECK(T2.topRows(4) == T.topRows(4));
  Mat<double> C = sc_test::randn<double>(4, 12, rng);  // GPT-2 Conv1D D x 3D
  const ProjectionSlot v{"c", false, 8, 4};
  CHECK(extract_projection(v, C) == C.middleCols(8, 4));
}

TEST_CASE("GPT-2, Hugging Face BERT/ViT, Llama with grouped-query K/V, torch MHA") {
  auto g = detect_layers(names({{"transformer.h.0.attn.c_attn.weight", {64, 192}},
                                {"transformer.h.0.attn.c_proj.weight", {64, 64}}}),
                         Layout::Auto, "gpt2");
  CHECK(g.layout == Layout::Gpt2);
  CHECK_FALSE(g.layers[0].q.transposed);
  CHECK(g.layers[0].v.offset == 128);

  auto b = detect_layers(names({{"bert.encoder.layer.3.attention.self.query.weight", {32, 32}},
                                {"bert.encoder.layer.3.attention.self.key.weight", {32, 32}},
                                {"bert.encoder.layer.3.attention.self.value.weight", {32, 32}},
                                {"bert.encoder.layer.3.attention.self.query.bias", {32}}}),
                         Layout::Auto, "bert");
  CHECK(b.layout == Layout::HfBert);
  CHECK(b.layers[0].index == 3);
  CHECK(b.layers[0].k.tensor == "bert.encoder.layer.3.attention.self.key.weight");

  auto v = detect_layers(names({{"vit.encoder.layer.0.attention.attention.query.weight", {8, 8}},
                                {"vit.encoder.layer.0.attention.attention.key.weight", {8, 8}},
                                {"vit.encoder.layer.0.attention.attention.value.weight", {8, 8}}}),
                         Layout::Auto, "hf-vit");
  CHECK(v.layout == Layout::HfBert);

  auto l = detect_layers(names({{"model.layers.0.self_attn.q_proj.weight", {64, 64}},
                                {"model.layers.0.self_attn.k_proj.weight", {16, 64}},
                                {"model.layers.0.self_attn.v_proj.weight", {16, 64}},
                                {"model.layers.0.self_attn.o_proj.weight", {64, 64}}}),
                         Layout::Auto, "llama");
  CHECK(l.layout == Layout::Llama);
  CHECK(l.layers[0].k.width == 16);
  HeadConfig hc;
  hc.heads = 8;
  hc.kv_heads = 2;
  const LayerHeads lh = resolve_heads(l.layers[0], hc, "llama");
  CHECK(lh.d_k == 8);
  CHECK(lh.d_v == 8);
  hc.kv_heads = 0;  // K narrower than heads x d_k: a clear error
  CHECK_THROWS_AS(resolve_heads(l.layers[0], hc, "llama"), IoError);

  auto t = detect_layers(names({{"encoder.layers.2.self_attn.in_proj_weight", {24, 8}}}),
                         Layout::Auto, "mha");
  CHECK(t.layout == Layout::TorchMHA);
  CHECK(t.layers[0].index == 2);
}

TEST_CASE("errors name the file and tensor") {
  CHECK_THROWS_WITH_AS(detect_layers(names({{"fc.weight", {3, 3}}}), Layout::Auto, "m.safetensors"),
                       "m.safetensors: no attention layers found (looked for the torch-mha, timm, "
                       "hf-bert, gpt2, llama and gguf layouts)",
                       IoError);
  // ALBERT's shared layer: named, with the tensors that look like attention.
  CHECK_THROWS_WITH_AS(
      detect_layers(
          names({{"albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query.weight",
                  {4, 4}},
                 {"albert.encoder.albert_layer_groups.0.albert_layers.0.attention.key.weight",
                  {4, 4}},
                 {"fc.weight", {3, 3}}}),
          Layout::Auto, "m"),
      doctest::Contains(
          "; tensors that look like attention: "
          "albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query."
          "weight, "
          "albert.encoder.albert_layer_groups.0.albert_layers.0.attention.key.weight"),
      IoError);
  CHECK_THROWS_WITH_AS(
      detect_layers(names({{"blocks.0.attn.qkv.weight", {10, 4}}}), Layout::Auto, "f"),
      "f: tensor blocks.0.attn.qkv.weight has shape [10, 4], expected [3D, D]", IoError);
  CHECK_THROWS_AS(
      detect_layers(names({{"bert.encoder.layer.0.attention.self.query.weight", {4, 4}}}),
                    Layout::Auto, "f"),
      IoError);
  const auto m = detect_layers(names({{"blocks.0.attn.qkv.weight", {30, 10}}}), Layout::Timm, "f");
  HeadConfig hc;
  CHECK_THROWS_WITH_AS(resolve_heads(m.layers[0], hc, "f"),
                       "f: the number of heads is unknown; pass --heads (and --kv-heads for "
                       "grouped-query models) or put a config.json beside the checkpoint",
                       IoError);
  hc.heads = 3;
  CHECK_THROWS_AS(resolve_heads(m.layers[0], hc, "f"), IoError);  // 3 does not divide 10
  CHECK_THROWS_AS(parse_layout("resnet"), IoError);
  CHECK(parse_layout("gpt2") == Layout::Gpt2);
}

TEST_CASE("config.json: Hugging Face and GPT-2 names") {
  const std::string path = "test_layouts_config.json";
  {
    std::ofstream f(path);
    f << R"({"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096})";
  }
  HeadConfig c = read_head_config(path);
  CHECK(c.heads == 32);
  CHECK(c.kv_heads == 8);
  CHECK(c.hidden == 4096);
  {
    std::ofstream f(path);
    f << R"({"n_head": 12, "n_embd": 768})";
  }
  c = read_head_config(path);
  CHECK(c.heads == 12);
  CHECK(c.hidden == 768);
  {
    std::ofstream f(path);
    f << R"({"n_head": "twelve"})";
  }
  CHECK_THROWS_AS(read_head_config(path), IoError);
  {
    std::ofstream f(path);
    f << "{not json";
  }
  CHECK_THROWS_AS(read_head_config(path), IoError);
  std::remove(path.c_str());
}
