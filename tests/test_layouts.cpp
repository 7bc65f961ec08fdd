// Layout detection from tensor names (MATH.md §8), slot extraction/insertion and head counts.
#include <spectral_cond/io/layouts/detect.hpp>

#include <spectral_cond/engine/layout_wording.hpp>
#include "support/test_helpers.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <set>

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
  CHECK(g.layers[0].causal);  // a decoder layout

  auto b = detect_layers(names({{"bert.encoder.layer.3.attention.self.query.weight", {32, 32}},
                                {"bert.encoder.layer.3.attention.self.key.weight", {32, 32}},
                                {"bert.encoder.layer.3.attention.self.value.weight", {32, 32}},
                                {"bert.encoder.layer.3.attention.self.query.bias", {32}}}),
                         Layout::Auto, "bert");
  CHECK(b.layout == Layout::HfBert);
  CHECK_FALSE(b.layers[0].causal);
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
  hc.kv_heads = 0;  // no kv count given: W_K's width says 16 / d_k = 2
  CHECK(resolve_heads(l.layers[0], hc, "llama").kv_heads == 2);
  hc.heads = 16;  // d_k = 4, so W_K holds 4 kv heads
  CHECK(resolve_heads(l.layers[0], hc, "llama").kv_heads == 4);
  hc.heads = 8;
  hc.kv_heads = 4;  // the config's kv count must fit W_K
  CHECK_THROWS_WITH_AS(resolve_heads(l.layers[0], hc, "llama"),
                       doctest::Contains("has width 16, expected kv_heads x d_k = 32"), IoError);

  auto t = detect_layers(names({{"encoder.layers.2.self_attn.in_proj_weight", {24, 8}}}),
                         Layout::Auto, "mha");
  CHECK(t.layout == Layout::TorchMHA);
  CHECK(t.layers[0].index == 2);
}

TEST_CASE("errors name the file and tensor") {
  CHECK_THROWS_WITH_AS(detect_layers(names({{"fc.weight", {3, 3}}}), Layout::Auto, "m.safetensors"),
                       "m.safetensors: no attention layers found (looked for the timm, gpt2, "
                       "hf-bert, whisper, llama, gguf, albert, distilbert, t5, gpt-neox, falcon "
                       "and torch-mha layouts)",
                       IoError);
  // Names no layout knows: listed, with the layer map that would name them.
  CHECK_THROWS_WITH_AS(
      detect_layers(names({{"enc.0.attention.wq", {4, 4}},
                           {"enc.0.attention.wk", {4, 4}},
                           {"enc.1.attention.wq", {4, 4}},
                           {"enc.1.attention.wk", {4, 4}},
                           {"fc.weight", {3, 3}}}),
                    Layout::Auto, "m"),
      doctest::Contains("; tensors that look like attention: enc.0.attention.wq, "
                        "enc.0.attention.wk, enc.1.attention.wq and 1 more; name them with a "
                        "layer map q=REGEX,k=REGEX,v=REGEX (or qkv=REGEX)"),
      IoError);
  // A layer with W_Q but no W_V is an error naming the missing tensor.
  CHECK_THROWS_WITH_AS(
      detect_layers(
          names({{"albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query.weight",
                  {4, 4}},
                 {"albert.encoder.albert_layer_groups.0.albert_layers.0.attention.key.weight",
                  {4, 4}}}),
          Layout::Auto, "m"),
      doctest::Contains("but not "
                        "albert.encoder.albert_layer_groups.0.albert_layers.0.attention.value."
                        "weight"),
      IoError);
  CHECK_THROWS_WITH_AS(
      detect_layers(names({{"blocks.0.attn.qkv.weight", {10, 4}}}), Layout::Auto, "f"),
      "f: tensor blocks.0.attn.qkv.weight has shape [10, 4], expected [3D, D]", IoError);
  CHECK_THROWS_AS(
      detect_layers(names({{"bert.encoder.layer.0.attention.self.query.weight", {4, 4}}}),
                    Layout::Auto, "f"),
      IoError);
  auto m = detect_layers(names({{"blocks.0.attn.qkv.weight", {30, 10}}}), Layout::Timm, "f");
  HeadConfig hc;
  CHECK_THROWS_WITH_AS(resolve_heads(m.layers[0], hc, "f"),
                       "f: the number of heads is unknown; give it (and the key/value heads of "
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
  // A config that names a causal language model makes analyze --mask auto causal.
  CHECK_FALSE(head_config_from_json(nlohmann::json::parse(R"({"n_head": 2})"), "c").causal_lm);
  CHECK(head_config_from_json(nlohmann::json::parse(R"({"is_decoder": true})"), "c").causal_lm);
  CHECK(head_config_from_json(nlohmann::json::parse(R"({"architectures": ["MistralForCausalLM"]})"),
                              "c")
            .causal_lm);
  CHECK(
      head_config_from_json(nlohmann::json::parse(R"({"architectures": ["GPT2LMHeadModel"]})"), "c")
          .causal_lm);
  CHECK_FALSE(
      head_config_from_json(nlohmann::json::parse(R"({"architectures": ["BertForMaskedLM"]})"), "c")
          .causal_lm);
  {
    std::ofstream f(path);
    f << "{not json";
  }
  CHECK_THROWS_AS(read_head_config(path), IoError);
  std::remove(path.c_str());
}

TEST_CASE("name patterns: word boundaries, numbers, and no regex") {
  auto layout_of = [](const std::string& n, std::vector<std::int64_t> shape) {
    try {
      return to_string(detect_layers(names({{n, shape}}), Layout::Auto, "f").layout);
    } catch (const IoError&) {
      return "none";
    }
  };
  CHECK(std::string(layout_of("blocks.0.attn.qkv.weight", {12, 4})) == "timm");
  CHECK(std::string(layout_of("model.vit.blocks.11.attn.qkv.weight", {12, 4})) == "timm");
  CHECK(std::string(layout_of("myblocks.0.attn.qkv.weight", {12, 4})) == "none");  // no boundary
  CHECK(std::string(layout_of("blocks.x.attn.qkv.weight", {12, 4})) == "none");    // no number
  CHECK(std::string(layout_of("blocks.0.attn.qkv.weight.bak", {12, 4})) == "none");
  CHECK(std::string(layout_of("in_proj_weight", {12, 4})) == "torch-mha");
  CHECK(std::string(layout_of("layer1/in_proj_weight", {12, 4})) == "torch-mha");
  CHECK(std::string(layout_of("xin_proj_weight", {12, 4})) == "none");
  CHECK(std::string(layout_of("gblk.0.attn_q.weight", {4, 4})) == "none");  // gguf: whole name
  // A name of 100,000 characters ending like a layout is refused quickly, never matched.
  CHECK(std::string(layout_of(std::string(100000, '1') + ".attn.qkv.weight", {12, 4})) == "none");
  CHECK(attention_candidate("transformer.h.3.self_attention.query_key_value.weight"));
  CHECK(attention_candidate("encoder.block.0.layer.0.SelfAttention.q.weight"));
  CHECK_FALSE(attention_candidate("encoder.block.0.layer.1.DenseReluDense.wi.weight"));
}

TEST_CASE("layer numbers: a leading number, and model order where names carry none") {
  // torch.save of an nn.Sequential of MultiheadAttention modules: "0.in_proj_weight", ...
  std::vector<NamedShape> seq;
  for (int i = 0; i < 11; ++i) seq.push_back({std::to_string(i) + ".in_proj_weight", {12, 4}});
  std::sort(seq.begin(), seq.end(),
            [](const NamedShape& a, const NamedShape& b) { return a.name < b.name; });
  auto s = detect_layers(seq, Layout::Auto, "seq");
  REQUIRE(s.layers.size() == 11);
  for (int i = 0; i < 11; ++i) {
    CHECK(s.layers[static_cast<std::size_t>(i)].index == i);
    CHECK(s.layers[static_cast<std::size_t>(i)].prefix == std::to_string(i) + ".");
  }
  // --map groups that are not numbers: ordered with their digits compared as numbers.
  const LayerMap m = parse_layer_map(R"(q=(enc\.\d+)\.wq,k=(enc\.\d+)\.wk,v=(enc\.\d+)\.wv)");
  std::vector<NamedShape> ts;
  for (int i : {10, 2, 1})
    for (const char* r : {"wq", "wk", "wv"})
      ts.push_back({"enc." + std::to_string(i) + "." + r, {4, 4}});
  auto r = detect_layers(ts, Layout::Auto, "f", &m);
  REQUIRE(r.layers.size() == 3);
  CHECK(r.layers[0].prefix == "enc.1");
  CHECK(r.layers[1].prefix == "enc.2");
  CHECK(r.layers[2].prefix == "enc.10");
  CHECK(r.layers[2].index == 2);
  CHECK(io::detail::natural_less("a9", "a10"));
  CHECK_FALSE(io::detail::natural_less("a10", "a9"));
  CHECK(io::detail::natural_less("a", "a0"));
  CHECK_FALSE(io::detail::natural_less("a007", "a7"));
}

TEST_CASE("ALBERT: one shared layer, reported once with the layers it stands for") {
  const std::string p = "albert.encoder.albert_layer_groups.0.albert_layers.0.attention.";
  auto m = detect_layers(names({{p + "query.weight", {8, 8}},
                                {p + "key.weight", {8, 8}},
                                {p + "value.weight", {8, 8}},
                                {p + "dense.weight", {8, 8}}}),
                         Layout::Auto, "albert");
  CHECK(m.layout == Layout::Albert);
  REQUIRE(m.layers.size() == 1);
  CHECK(m.layers[0].shared);
  CHECK(m.layers[0].prefix == p);
  CHECK(m.layers[0].group == 0);
  HeadConfig c;
  CHECK(shared_by(m.layers[0], c) == "every layer (num_hidden_layers unknown)");
  c.hidden_layers = 12;
  CHECK(shared_by(m.layers[0], c) == "layers 0-11");
  AttentionLayerSpec g = m.layers[0];
  c.hidden_groups = 3;  // layer l uses group floor(3 l / 12)
  g.group = 1;
  CHECK(shared_by(g, c) == "layers 4-7");
  c.hidden_groups = 5;  // Hugging Face's int(l / 2.4): groups 0..4 take 0-2, 3-4, 5-7, 8-9, 10-11
  const char* want[] = {"layers 0-2", "layers 3-4", "layers 5-7", "layers 8-9", "layers 10-11"};
  for (int k = 0; k < 5; ++k) {
    g.group = k;
    CHECK(shared_by(g, c) == want[k]);
  }
  g.group = 5;
  CHECK(shared_by(g, c) == "no layer (group 5 of 5)");
  c.hidden_layers = INT64_MAX;  // a hostile config: no overflow, no range
  CHECK(shared_by(g, c) == "layers unknown (num_hidden_layers or num_hidden_groups beyond 2^31)");
  AttentionLayerSpec plain;
  CHECK(shared_by(plain, c).empty());
  // Two inner layers of one group (inner_group_num = 2): both are group 0's.
  auto two = detect_layers(
      names(
          {{p + "query.weight", {8, 8}},
           {p + "key.weight", {8, 8}},
           {p + "value.weight", {8, 8}},
           {"albert.encoder.albert_layer_groups.0.albert_layers.1.attention.query.weight", {8, 8}},
           {"albert.encoder.albert_layer_groups.0.albert_layers.1.attention.key.weight", {8, 8}},
           {"albert.encoder.albert_layer_groups.0.albert_layers.1.attention.value.weight",
            {8, 8}}}),
      Layout::Auto, "albert2");
  REQUIRE(two.layers.size() == 2);
  CHECK(two.layers[1].group == 0);
  CHECK(two.layers[1].index == 1);
  CHECK(two.layers[1].prefix == "albert.encoder.albert_layer_groups.0.albert_layers.1.attention.");
}

TEST_CASE("DistilBERT, RoBERTa, DeiT") {
  auto d =
      detect_layers(names({{"distilbert.transformer.layer.5.attention.q_lin.weight", {8, 8}},
                           {"distilbert.transformer.layer.5.attention.k_lin.weight", {8, 8}},
                           {"distilbert.transformer.layer.5.attention.v_lin.weight", {8, 8}},
                           {"distilbert.transformer.layer.5.attention.out_lin.weight", {8, 8}}}),
                    Layout::Auto, "distilbert");
  CHECK(d.layout == Layout::DistilBert);
  CHECK(d.layers[0].index == 5);
  CHECK(d.layers[0].v.tensor == "distilbert.transformer.layer.5.attention.v_lin.weight");
  for (const std::string root : {"roberta.encoder", "deit.encoder", "electra.encoder"}) {
    const std::string s = root == std::string("deit.encoder") ? "attention" : "self";
    auto r = detect_layers(names({{root + ".layer.1.attention." + s + ".query.weight", {8, 8}},
                                  {root + ".layer.1.attention." + s + ".key.weight", {8, 8}},
                                  {root + ".layer.1.attention." + s + ".value.weight", {8, 8}}}),
                           Layout::Auto, root);
    CHECK(r.layout == Layout::HfBert);
  }
}

TEST_CASE("T5 and Whisper: two stacks, self- and cross-attention, numbered in model order") {
  std::vector<NamedShape> ts;
  for (const char* stack : {"decoder", "encoder"})
    for (int b = 0; b < 2; ++b)
      for (const char* kind : {"0.SelfAttention", "1.EncDecAttention"}) {
        if (std::string(stack) == "encoder" && std::string(kind)[0] == '1') continue;
        for (const char* p : {"q", "k", "v", "o"})
          ts.push_back({std::string(stack) + ".block." + std::to_string(b) + ".layer." + kind +
                            "." + p + ".weight",
                        {8, 8}});
      }
  auto t = detect_layers(ts, Layout::Auto, "t5");
  CHECK(t.layout == Layout::T5);
  REQUIRE(t.layers.size() == 6);
  // Encoder first; numbers repeat across the stacks, so layers are numbered 0..5 in order.
  const char* prefixes[] = {
      "encoder.block.0.layer.0.SelfAttention.", "encoder.block.1.layer.0.SelfAttention.",
      "decoder.block.0.layer.0.SelfAttention.", "decoder.block.0.layer.1.EncDecAttention.",
      "decoder.block.1.layer.0.SelfAttention.", "decoder.block.1.layer.1.EncDecAttention."};
  for (int i = 0; i < 6; ++i) {
    CHECK(t.layers[static_cast<std::size_t>(i)].index == i);
    CHECK(t.layers[static_cast<std::size_t>(i)].prefix == prefixes[i]);
    CHECK(t.layers[static_cast<std::size_t>(i)].cross == (i == 3 || i == 5));
    CHECK(t.layers[static_cast<std::size_t>(i)].unscaled);
    // The decoder's self-attention is causal (analyze --mask auto); the rest is not.
    CHECK(t.layers[static_cast<std::size_t>(i)].causal == (i == 2 || i == 4));
  }

  std::vector<NamedShape> w;
  for (const char* stack : {"model.encoder", "model.decoder"})
    for (const char* kind : {"self_attn", "encoder_attn"}) {
      if (std::string(stack) == "model.encoder" && std::string(kind) == "encoder_attn") continue;
      for (const char* p : {"q", "k", "v"})
        w.push_back({std::string(stack) + ".layers.0." + kind + "." + p + "_proj.weight", {6, 6}});
    }
  // Whisper's self-attention names are llama's too; whisper claims them all, so it is chosen.
  auto wm = detect_layers(w, Layout::Auto, "whisper");
  CHECK(wm.layout == Layout::Whisper);
  REQUIRE(wm.layers.size() == 3);
  CHECK(wm.layers[0].prefix == "model.encoder.layers.0.self_attn.");
  CHECK(wm.layers[2].prefix == "model.decoder.layers.0.encoder_attn.");
  CHECK(wm.layers[2].cross);
  CHECK_FALSE(wm.layers[1].cross);
  CHECK_FALSE(wm.layers[0].unscaled);
  CHECK((!wm.layers[0].causal && wm.layers[1].causal && !wm.layers[2].causal));
  // Asked for llama, the same file gives the self-attention layers only.
  auto lm = detect_layers(w, Layout::Llama, "whisper");
  CHECK(lm.layers.size() == 2);
  // An encoder alone: both layouts claim the same tensors; the more specific (whisper) wins.
  w.resize(3);
  CHECK(detect_layers(w, Layout::Auto, "encoder").layout == Layout::Whisper);
  // Two layouts that share no tensor are still ambiguous.
  CHECK_THROWS_WITH_AS(detect_layers(names({{"blocks.0.attn.qkv.weight", {12, 4}},
                                            {"h.0.attn.c_attn.weight", {4, 12}}}),
                                     Layout::Auto, "f"),
                       doctest::Contains("match several layouts (timm, gpt2)"), IoError);
}

TEST_CASE("GPT-NeoX and Falcon: Q, K, V interleaved by head group in one tensor") {
  std::mt19937_64 rng(11);
  // GPT-NeoX: [3D, D] as (heads, 3, d, D).
  const Index D = 8, h = 4, d = 2;
  const Mat<double> T = sc_test::randn<double>(3 * D, D, rng);
  auto n = detect_layers(names({{"gpt_neox.layers.0.attention.query_key_value.weight", {24, 8}}}),
                         Layout::Auto, "neox");
  CHECK(n.layout == Layout::GptNeox);
  HeadConfig c;
  CHECK_THROWS_WITH_AS(resolve_heads(n.layers[0], c, "neox"),
                       doctest::Contains("the number of heads is unknown"), IoError);
  c.heads = h;
  AttentionLayerSpec L = n.layers[0];
  const LayerHeads H = resolve_heads(L, c, "neox");
  CHECK(H.kv_heads == h);
  CHECK(H.d_k == d);
  const Mat<double> WQ = extract_projection(L.q, T), WK = extract_projection(L.k, T),
                    WV = extract_projection(L.v, T);
  REQUIRE(WQ.cols() == D);
  for (Index j = 0; j < h; ++j) {
    CHECK(WQ.middleCols(j * d, d) == T.middleRows(j * 3 * d, d).transpose());
    CHECK(WK.middleCols(j * d, d) == T.middleRows(j * 3 * d + d, d).transpose());
    CHECK(WV.middleCols(j * d, d) == T.middleRows(j * 3 * d + 2 * d, d).transpose());
  }
  // Inserting the three back rebuilds the tensor exactly.
  Mat<double> T2 = Mat<double>::Zero(T.rows(), T.cols());
  insert_projection(L.q, WQ, T2);
  insert_projection(L.k, WK, T2);
  insert_projection(L.v, WV, T2);
  CHECK(T2 == T);

  // Falcon-40B style: 4 query heads in 2 groups, each group [q, q, k, v] of d rows.
  const Mat<double> F = sc_test::randn<double>(16, 8, rng);
  auto f =
      detect_layers(names({{"transformer.h.2.self_attention.query_key_value.weight", {16, 8}}}),
                    Layout::Auto, "falcon");
  CHECK(f.layout == Layout::Falcon);
  CHECK(f.layers[0].index == 2);
  AttentionLayerSpec G = f.layers[0];
  const LayerHeads FH = resolve_heads(G, c, "falcon");
  CHECK(FH.kv_heads == 2);
  const Mat<double> FQ = extract_projection(G.q, F), FK = extract_projection(G.k, F),
                    FV = extract_projection(G.v, F);
  CHECK(FQ.cols() == 8);
  CHECK(FK.cols() == 4);
  CHECK(FQ.middleCols(6, 2) == F.middleRows(10, 2).transpose());  // head 3: group 1, second q
  CHECK(FK.middleCols(2, 2) == F.middleRows(12, 2).transpose());
  CHECK(FV.middleCols(2, 2) == F.middleRows(14, 2).transpose());
  // Falcon-7B: multi-query, [q x 4, k, v]: one key/value head.
  auto f7 =
      detect_layers(names({{"transformer.h.0.self_attention.query_key_value.weight", {12, 8}}}),
                    Layout::Falcon, "falcon7b");
  AttentionLayerSpec M = f7.layers[0];
  CHECK(resolve_heads(M, c, "falcon7b").kv_heads == 1);
  CHECK(M.k.offset == 8);
  CHECK(M.v.offset == 10);
  // A config that disagrees with the tensor is an error naming both.
  HeadConfig bad = c;
  bad.kv_heads = 2;
  AttentionLayerSpec M2 = f7.layers[0];
  CHECK_THROWS_WITH_AS(resolve_heads(M2, bad, "falcon7b"),
                       doctest::Contains("kv_heads = 2 but tensor "
                                         "transformer.h.0.self_attention.query_key_value.weight "
                                         "holds 1 key/value heads"),
                       IoError);
  bad.kv_heads = 0;
  bad.heads = 3;  // 3 does not divide D = 8
  AttentionLayerSpec M3 = f7.layers[0];
  CHECK_THROWS_WITH_AS(resolve_heads(M3, bad, "falcon7b"),
                       doctest::Contains("heads = 3 does not divide D = 8"), IoError);
  CHECK_THROWS_WITH_AS(
      detect_layers(names({{"transformer.h.0.self_attention.query_key_value.weight", {8, 8}}}),
                    Layout::Auto, "f"),
      doctest::Contains("expected [rows, D] with rows > D"), IoError);
}

TEST_CASE("--map: any model's names by regular expression") {
  const LayerMap m =
      parse_layer_map(R"(q=enc\.(\d{1,3})\.wq,k=enc\.(\d{1,3})\.wk,v=enc\.(\d{1,3})\.wv)");
  CHECK(m.q == R"(enc\.(\d{1,3})\.wq)");  // the comma inside {1,3} stays in the expression
  CHECK(m.v == R"(enc\.(\d{1,3})\.wv)");
  std::vector<NamedShape> ts = {{"enc.1.wq", {4, 6}}, {"enc.1.wk", {2, 6}}, {"enc.1.wv", {2, 6}},
                                {"enc.0.wq", {4, 6}}, {"enc.0.wk", {2, 6}}, {"enc.0.wv", {2, 6}},
                                {"enc.0.wo", {6, 4}}};
  for (const NamedShape& t : ts) CHECK(map_candidate(m, t.name) == (t.name != "enc.0.wo"));
  auto r = detect_layers(ts, Layout::Auto, "f", &m);
  CHECK(r.layout == Layout::Map);
  REQUIRE(r.layers.size() == 2);
  CHECK(r.layers[0].index == 0);
  CHECK(r.layers[1].index == 1);
  CHECK(r.layers[1].k.tensor == "enc.1.wk");
  CHECK(r.layers[1].D == 6);
  CHECK(r.layers[1].k.width == 2);
  // Groups that are not a number: layers numbered in order of their groups.
  const LayerMap named = parse_layer_map(R"(q=(\w+)\.wq,k=(\w+)\.wk,v=(\w+)\.wv)");
  auto nm = detect_layers(names({{"decoder.wq", {4, 4}},
                                 {"decoder.wk", {4, 4}},
                                 {"decoder.wv", {4, 4}},
                                 {"encoder.wq", {4, 4}},
                                 {"encoder.wk", {4, 4}},
                                 {"encoder.wv", {4, 4}}}),
                          Layout::Auto, "f", &named);
  REQUIRE(nm.layers.size() == 2);
  CHECK(nm.layers[0].prefix == "encoder");  // the decoder's layers come after the encoder's
  CHECK(nm.layers[1].index == 1);
  // Errors: a layer without W_V, two tensors for one layer, a built-in layout with the map.
  ts.pop_back();
  ts.erase(ts.begin() + 2);
  CHECK_THROWS_WITH_AS(detect_layers(ts, Layout::Auto, "f", &m),
                       "f: layer map: layer '1' has W_Q enc.1.wq but no v tensor matches", IoError);
  const LayerMap loose = parse_layer_map(R"(q=.*wq,k=.*wk,v=.*wv)");
  CHECK_THROWS_WITH_AS(detect_layers(ts, Layout::Auto, "f", &loose),
                       doctest::Contains("layer map: q matches two tensors for layer ''"), IoError);
  CHECK_THROWS_WITH_AS(detect_layers(ts, Layout::Timm, "f", &m),
                       doctest::Contains("a layer map replaces the built-in layouts"), IoError);
  const LayerMap none = parse_layer_map("q=x,k=y,v=z");
  CHECK_THROWS_WITH_AS(detect_layers(ts, Layout::Auto, "f", &none),
                       doctest::Contains("the layer map matched no tensor"), IoError);
  // A fused tensor, GPT-2 style.
  const LayerMap fused = parse_layer_map(R"(qkv=tr\.(\d+)\.qkv,storage=conv1d)");
  auto fr = detect_layers(names({{"tr.7.qkv", {4, 12}}, {"tr.7.proj", {4, 4}}}), Layout::Auto, "f",
                          &fused);
  REQUIRE(fr.layers.size() == 1);
  CHECK(fr.layers[0].index == 7);
  CHECK_FALSE(fr.layers[0].q.transposed);
  CHECK(fr.layers[0].v.offset == 8);
  // Malformed maps say what is wrong.
  CHECK_THROWS_WITH_AS(parse_layer_map("q=a,k=b"),
                       "layer map: v is missing (q, k and v go together)", IoError);
  CHECK_THROWS_WITH_AS(parse_layer_map("q=a,k=b,v=(c"),
                       doctest::Contains("layer map: v: not a valid"), IoError);
  CHECK_THROWS_WITH_AS(parse_layer_map("x=a"), doctest::Contains("layer map: expected q=REGEX"),
                       IoError);
  CHECK_THROWS_WITH_AS(parse_layer_map("q=a,k=b,v=c,qkv=d"), doctest::Contains("not both"),
                       IoError);
  CHECK_THROWS_WITH_AS(parse_layer_map("qkv=a,storage=rows"),
                       doctest::Contains("storage must be linear or conv1d"), IoError);
  CHECK_THROWS_WITH_AS(parse_layer_map("q=a,q=b"), "layer map: q given twice", IoError);
  CHECK_THROWS_WITH_AS(parse_layer_map("q=a,k=b,v=c,storage=conv1d"),
                       "layer map: storage=conv1d applies to a fused qkv tensor only", IoError);
  // W_K and W_V of a layer whose W_Q the expression misses: an error, never a dropped layer.
  const LayerMap partial = parse_layer_map(R"(q=x\.(\d)\.q,k=x\.(\d)\.k,v=x\.(\d)\.v)");
  CHECK_THROWS_WITH_AS(detect_layers(names({{"x.0.q", {4, 4}},
                                            {"x.0.k", {4, 4}},
                                            {"x.0.v", {4, 4}},
                                            {"x.1.k", {4, 4}},
                                            {"x.1.v", {4, 4}}}),
                                     Layout::Auto, "f", &partial),
                       "f: layer map: layer '1' has x.1.k (k) but no q tensor matches", IoError);
  CHECK(parse_layer_map("").empty());
}

namespace {
/// The LayoutError that `f` throws, if it throws one.
std::optional<LayoutError> layout_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const LayoutError& e) {
    return e;
  }
  return std::nullopt;
}
}  // namespace

TEST_CASE("layout errors: the library's message names no flag, the tool's wording does") {
  const LayerMap sep = parse_layer_map(R"(q=x\.(\d)\.q,k=x\.(\d)\.k,v=x\.(\d)\.v)");
  const LayerMap loose = parse_layer_map(R"(q=.*wq,k=.*wk,v=.*wv)");
  const LayerMap fused = parse_layer_map(R"(qkv=.*qkv)");
  const LayerMap none = parse_layer_map("q=a,k=b,v=c");
  const std::vector<NamedShape> looks = {{"enc.0.attention.wq", {4, 4}},
                                         {"enc.0.attention.wk", {4, 4}},
                                         {"enc.1.attention.wq", {4, 4}},
                                         {"enc.1.attention.wk", {4, 4}},
                                         {"fc.weight", {3, 3}}};
  const std::string all = std::string("auto, ") + kLayoutNames;
  const auto conv =
      detect_layers(names({{"blocks.0.attn.qkv.weight", {30, 10}}}), Layout::Timm, "f");
  struct Case {
    LayoutProblem problem;
    std::function<void()> provoke;
    std::string library, tool;
  };
  const std::vector<Case> cases = {
      {LayoutProblem::UnknownLayout, [] { parse_layout("resnet"); },
       "unknown layout 'resnet' (expected " + all + "; or a layer map for any other)",
       "--layout: unknown layout 'resnet' (expected " + all + "; or --map for any other)"},
      {LayoutProblem::MapSyntax, [] { parse_layer_map("q=a,k=b"); },
       "layer map: v is missing (q, k and v go together)",
       "--map: v is missing (q, k and v go together)"},
      {LayoutProblem::MapSyntax, [] { parse_layer_map("x=a"); },
       "layer map: expected q=REGEX,k=REGEX,v=REGEX or qkv=REGEX (optionally "
       "storage=linear|conv1d), got 'x=a'",
       "--map: expected q=REGEX,k=REGEX,v=REGEX or qkv=REGEX (optionally "
       "storage=linear|conv1d), got 'x=a'"},
      {LayoutProblem::MapWithLayout,
       [&] {
         detect_layers(names({{"x.0.q", {4, 4}}}), Layout::Timm, "f", &sep);
       },
       "a layer map replaces the built-in layouts; it cannot be combined with layout timm",
       "--map replaces the built-in layouts; drop --layout timm"},
      {LayoutProblem::MapDuplicate,
       [&] {
         detect_layers(names({{"a.wq", {4, 4}}, {"b.wq", {4, 4}}}), Layout::Auto, "f", &loose);
       },
       "f: layer map: q matches two tensors for layer '' (a.wq, b.wq); use a capture group for "
       "the layer number",
       "f: --map q matches two tensors for layer '' (a.wq, b.wq); use a capture group for the "
       "layer number"},
      {LayoutProblem::MapDuplicate,
       [&] {
         detect_layers(names({{"a.qkv", {12, 4}}, {"b.qkv", {12, 4}}}), Layout::Auto, "f", &fused);
       },
       "f: layer map: qkv matches two tensors for layer '' (a.qkv, b.qkv); use a capture group "
       "for the layer number",
       "f: --map qkv: two tensors for layer '' (use a capture group for the layer number)"},
      {LayoutProblem::MapIncomplete,
       [&] {
         detect_layers(names({{"x.1.q", {4, 4}}, {"x.1.k", {4, 4}}}), Layout::Auto, "f", &sep);
       },
       "f: layer map: layer '1' has W_Q x.1.q but no v tensor matches",
       "f: --map: layer '1' has W_Q x.1.q but no v tensor matches"},
      {LayoutProblem::MapIncomplete,
       [&] {
         detect_layers(names({{"x.1.k", {4, 4}}, {"x.1.v", {4, 4}}}), Layout::Auto, "f", &sep);
       },
       "f: layer map: layer '1' has x.1.k (k) but no q tensor matches",
       "f: --map: layer '1' has x.1.k (k) but no q tensor matches"},
      {LayoutProblem::MapMatchedNothing,
       [&] {
         detect_layers(names({{"x.0.q", {4, 4}}}), Layout::Auto, "f", &none);
       },
       "f: the layer map matched no tensor (the expressions must match whole names)",
       "f: --map matched no tensor (the expressions must match whole names)"},
      {LayoutProblem::SeveralLayouts,
       [] {
         detect_layers(
             names({{"blocks.0.attn.qkv.weight", {12, 4}}, {"h.0.attn.c_attn.weight", {4, 12}}}),
             Layout::Auto, "f");
       },
       "f: tensor names match several layouts (timm, gpt2); choose one",
       "f: tensor names match several layouts (timm, gpt2); choose one with --layout"},
      {LayoutProblem::NoLayers, [&] { detect_layers(looks, Layout::Auto, "m"); },
       "m: no attention layers found (looked for the " + std::string(kLayoutNames) +
           " layouts); tensors that look like attention: enc.0.attention.wq, enc.0.attention.wk, "
           "enc.1.attention.wq and 1 more; name them with a layer map q=REGEX,k=REGEX,v=REGEX (or "
           "qkv=REGEX)",
       "m: no attention layers found (looked for the " + std::string(kLayoutNames) +
           " layouts); tensors that look like attention: enc.0.attention.wq, enc.0.attention.wk, "
           "enc.1.attention.wq and 1 more; name them with --map q=REGEX,k=REGEX,v=REGEX (or "
           "qkv=REGEX)"},
      {LayoutProblem::NoLayers,
       [] {
         detect_layers(names({{"fc.weight", {3, 3}}}), Layout::Llama, "m");
       },
       "m: no attention layers found in layout llama",
       "m: no attention layers found in layout llama"},
      {LayoutProblem::HeadsUnknown,
       [&] {
         AttentionLayerSpec L = conv.layers[0];
         resolve_heads(L, HeadConfig{}, "f");
       },
       "f: the number of heads is unknown; give it (and the key/value heads of grouped-query "
       "models) or put a config.json beside the checkpoint",
       "f: the number of heads is unknown; pass --heads (and --kv-heads for grouped-query "
       "models) or put a config.json beside the checkpoint"},
  };
  std::set<LayoutProblem> seen;
  for (const Case& c : cases) {
    CAPTURE(c.tool);
    const std::optional<LayoutError> e = layout_error(c.provoke);
    REQUIRE(e.has_value());
    seen.insert(e->problem);
    CHECK(to_string(e->problem) == std::string(to_string(c.problem)));
    const std::string library = e->what();
    CHECK(library == c.library);
    CHECK(library.find("--") == std::string::npos);
    CHECK(engine::layout_message(*e) == c.tool);
    CHECK(std::string(e->what()) ==
          LayoutError::message(e->problem, e->file, e->reason, e->value, e->names));
  }
  // Every problem kind was provoked, and a LayoutError is still an IoError.
  for (int p = 0; p <= static_cast<int>(LayoutProblem::HeadsUnknown); ++p)
    CHECK(seen.count(static_cast<LayoutProblem>(p)) == 1);
  CHECK_THROWS_AS(parse_layout("resnet"), IoError);
  // The fields: the value given, and the layer and tensors concerned.
  const auto dup = layout_error([&] {
    detect_layers(names({{"a.wq", {4, 4}}, {"b.wq", {4, 4}}}), Layout::Auto, "f", &loose);
  });
  REQUIRE(dup.has_value());
  CHECK(dup->file == "f");
  CHECK(dup->value == "q");
  CHECK(dup->names == std::vector<std::string>{"", "a.wq", "b.wq"});
  const auto syntax = layout_error([] { parse_layer_map("q=a,k=b"); });
  REQUIRE(syntax.has_value());
  CHECK(syntax->value == "q=a,k=b");
  CHECK(syntax->reason == "v is missing (q, k and v go together)");
}
