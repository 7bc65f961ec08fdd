// Attention as trained models compute it (MATH.md §10): Q/K/V biases and RoPE in both
// pairings, through the forward pass, JVP, VJP, J, J_b, the Gram and normal matrices, the
// compressed J~, the operators, the multi-head layer and every κ(J) method. The reference is
// a forward pass written here from the Hugging Face formulas (explicit rotation matrices, not
// the library's tables) and its central finite differences; the exact routines are then checked
// against each other to rounding.
#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>
#include <spectral_cond/jacobian/compressed.hpp>
#include <spectral_cond/jacobian/gram.hpp>
#include <spectral_cond/jacobian/multihead_jacobian.hpp>
#include <spectral_cond/jacobian/operators.hpp>
#include <spectral_cond/testing/finite_diff.hpp>

#include <Eigen/SVD>

#include "support/test_helpers.hpp"

using namespace spectral_cond;
using sc_test::randn;
using sc_test::rel_err;

namespace {

/// R with q~ = q R for the token at position `pos` (MATH.md §10), from the definitions:
/// rotate_half: q~[j] = q[j] cos - q[j + h] sin, q~[j + h] = q[j + h] cos + q[j] sin;
/// interleaved: the same on (2j, 2j + 1).
Mat<double> rotation(Index pos, Index dk, const RopeOptions& o) {
  const Index rd = o.dims == 0 ? dk : o.dims, half = rd / 2;
  Mat<double> R = Mat<double>::Identity(dk, dk);
  for (Index j = 0; j < half; ++j) {
    const double w = std::pow(o.theta, -2.0 * static_cast<double>(j) / static_cast<double>(rd));
    const double a = static_cast<double>(o.offset + pos) * w;
    const Index b = o.pairing == RopePairing::RotateHalf ? j : 2 * j;
    const Index p = o.pairing == RopePairing::RotateHalf ? j + half : 2 * j + 1;
    R(b, b) = std::cos(a);
    R(p, b) = -std::sin(a);
    R(p, p) = std::cos(a);
    R(b, p) = std::sin(a);
  }
  return R;
}

struct Block {
  Mat<double> X, WQ, WK, WV;
  AttentionOptions<double> opts;
};

/// The reference forward pass, written from the formulas of MATH.md §1 and §10.
Mat<double> reference_forward(const Mat<double>& X, const Mat<double>& WQ, const Mat<double>& WK,
                              const Mat<double>& WV, const AttentionOptions<double>& o) {
  const Index N = X.rows(), dk = WQ.cols();
  Mat<double> Q = X * WQ, K = X * WK, V = X * WV;
  if (o.bias_q.size() > 0) Q.rowwise() += o.bias_q.transpose();
  if (o.bias_k.size() > 0) K.rowwise() += o.bias_k.transpose();
  if (o.bias_v.size() > 0) V.rowwise() += o.bias_v.transpose();
  if (o.rope)
    for (Index i = 0; i < N; ++i) {
      const Mat<double> R = rotation(i, dk, *o.rope);
      Q.row(i) = Q.row(i) * R;
      K.row(i) = K.row(i) * R;
    }
  const double c = o.resolved_scale(dk);
  Mat<double> Z = c * Q * K.transpose();
  if (o.mask == MaskKind::Causal)
    for (Index i = 0; i < N; ++i)
      for (Index j = i + 1; j < N; ++j) Z(i, j) = -std::numeric_limits<double>::infinity();
  for (Index i = 0; i < N; ++i) {
    const double m = Z.row(i).maxCoeff();
    Z.row(i) = (Z.row(i).array() - m).exp().matrix();
    Z.row(i) /= Z.row(i).sum();
  }
  return Z * V;
}

Block make_block(Index N, Index D, Index dk, Index dv, std::uint64_t seed, bool biases,
                 std::optional<RopeOptions> rope, MaskKind mask = MaskKind::None) {
  std::mt19937_64 rng(seed);
  Block b;
  b.X = randn<double>(N, D, rng);
  const double ws = 1.0 / std::sqrt(static_cast<double>(D));
  b.WQ = randn<double>(D, dk, rng, 2 * ws);
  b.WK = randn<double>(D, dk, rng, 2 * ws);
  b.WV = randn<double>(D, dv, rng, ws);
  if (biases) {
    b.opts.bias_q = randn<double>(dk, 1, rng, 0.5);
    b.opts.bias_k = randn<double>(dk, 1, rng, 0.5);
    b.opts.bias_v = randn<double>(dv, 1, rng, 0.5);
  }
  b.opts.rope = rope;
  b.opts.mask = mask;
  return b;
}

/// The four variants every test runs: biases, RoPE rotate_half (partial, with an offset),
/// RoPE interleaved, and both together.
std::vector<Block> variants(Index N, Index D, Index dk, Index dv, std::uint64_t seed) {
  RopeOptions half;
  half.pairing = RopePairing::RotateHalf;
  half.theta = 100;  // large angles at small N, so that every pair rotates visibly
  half.dims = dk >= 4 ? dk - 2 : 0;
  half.offset = 3;
  RopeOptions inter;
  inter.pairing = RopePairing::Interleaved;
  inter.theta = 10000;
  return {make_block(N, D, dk, dv, seed, true, std::nullopt),
          make_block(N, D, dk, dv, seed + 1, false, half),
          make_block(N, D, dk, dv, seed + 2, false, inter, MaskKind::Causal),
          make_block(N, D, dk, dv, seed + 3, true, half)};
}

std::string describe(const Block& b) {
  std::string s = b.opts.has_biases() ? "biases" : "no biases";
  if (b.opts.rope) s += std::string(", rope ") + to_string(b.opts.rope->pairing);
  if (b.opts.mask == MaskKind::Causal) s += ", causal";
  return s;
}

/// [vec W_Q; vec W_K; vec W_V] as one column.
Mat<double> stack_weights(const Block& b) {
  const Index nq = b.WQ.size(), nk = b.WK.size(), nv = b.WV.size();
  Mat<double> w(nq + nk + nv, 1);
  w.col(0) << Eigen::Map<const Vec<double>>(b.WQ.data(), nq),
      Eigen::Map<const Vec<double>>(b.WK.data(), nk),
      Eigen::Map<const Vec<double>>(b.WV.data(), nv);
  return w;
}

Mat<double> fd_weight_jacobian(const Block& b) {
  const Index D = b.X.cols(), dk = b.WQ.cols(), dv = b.WV.cols();
  auto f = [&](const Mat<double>& w) {
    const Mat<double> WQ = Eigen::Map<const Mat<double>>(w.data(), D, dk);
    const Mat<double> WK = Eigen::Map<const Mat<double>>(w.data() + D * dk, D, dk);
    const Mat<double> WV = Eigen::Map<const Mat<double>>(w.data() + 2 * D * dk, D, dv);
    return reference_forward(b.X, WQ, WK, WV, b.opts);
  };
  return numerical_jacobian<double>(f, stack_weights(b));
}

Mat<double> fd_bias_jacobian(const Block& b) {
  const Index dk = b.WQ.cols(), dv = b.WV.cols();
  Mat<double> bias(2 * dk + dv, 1);
  auto part = [](const Vec<double>& v, Index n) { return v.size() > 0 ? v : Vec<double>::Zero(n); };
  bias.col(0) << part(b.opts.bias_q, dk), part(b.opts.bias_k, dk), part(b.opts.bias_v, dv);
  auto f = [&](const Mat<double>& x) {
    AttentionOptions<double> o = b.opts;
    o.bias_q = x.col(0).head(dk);
    o.bias_k = x.col(0).segment(dk, dk);
    o.bias_v = x.col(0).tail(dv);
    return reference_forward(b.X, b.WQ, b.WK, b.WV, o);
  };
  return numerical_jacobian<double>(f, bias);
}

Mat<double> svd_values(const Mat<double>& M) {
  return Eigen::JacobiSVD<Mat<double>>(M).singularValues();
}

}  // namespace

TEST_CASE("forward: biases and RoPE as the reference written from the formulas") {
  for (const Block& b : variants(7, 6, 6, 3, 101)) {
    INFO(describe(b));
    const AttentionCache<double> ca = attention_forward(b.X, b.WQ, b.WK, b.WV, b.opts);
    CHECK(rel_err(ca.A, reference_forward(b.X, b.WQ, b.WK, b.WV, b.opts)) < 1e-14);
    // Without the extensions the result differs: the test data exercise them.
    AttentionOptions<double> plain;
    plain.mask = b.opts.mask;
    CHECK(rel_err(attention(b.X, b.WQ, b.WK, b.WV, plain), ca.A) > 1e-3);
  }
  // rotate_half and interleaved are different rotations of the same pairs' angles.
  Block h = make_block(5, 4, 4, 2, 7, false, RopeOptions{});
  Block i = h;
  i.opts.rope->pairing = RopePairing::Interleaved;
  CHECK(rel_err(attention(h.X, h.WQ, h.WK, h.WV, h.opts),
                attention(i.X, i.WQ, i.WK, i.WV, i.opts)) > 1e-6);
  // float follows double to float rounding.
  const Block b = variants(7, 6, 6, 3, 111)[3];
  AttentionOptions<float> fo;
  fo.bias_q = b.opts.bias_q.cast<float>();
  fo.bias_k = b.opts.bias_k.cast<float>();
  fo.bias_v = b.opts.bias_v.cast<float>();
  fo.rope = b.opts.rope;
  const Mat<float> Af = attention(b.X.cast<float>().eval(), b.WQ.cast<float>().eval(),
                                  b.WK.cast<float>().eval(), b.WV.cast<float>().eval(), fo);
  CHECK(rel_err(Af.cast<double>().eval(), attention(b.X, b.WQ, b.WK, b.WV, b.opts)) < 1e-5);
}

TEST_CASE("J and J_b against finite differences of the reference; J_bK = 0 exactly without RoPE") {
  for (const Block& b : variants(6, 5, 4, 3, 201)) {
    INFO(describe(b));
    const Mat<double> J = attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts);
    CHECK(rel_err(J, fd_weight_jacobian(b)) < 1e-8);
    const Mat<double> Jb = attention_bias_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts);
    CHECK(rel_err(Jb, fd_bias_jacobian(b)) < 1e-8);
    const Index dk = b.WQ.cols();
    const double key_bias = Jb.middleCols(dk, dk).cwiseAbs().maxCoeff();
    if (b.opts.rope)
      CHECK(key_bias > 1e-3);  // RoPE rotates the key bias differently at every position
    else
      CHECK(key_bias == 0.0);
    // J_bV = I ⊗ 1_N: P 1 = 1.
    const Index N = b.X.rows(), dv = b.WV.cols();
    for (Index e = 0; e < dv; ++e)
      CHECK(rel_err(Jb.col(2 * dk + e).segment(e * N, N), Vec<double>::Ones(N)) < 1e-15);
  }
}

TEST_CASE("JVP and VJP with biases and RoPE are J and J^T exactly, bias tangents included") {
  for (const Block& b : variants(6, 5, 4, 3, 301)) {
    INFO(describe(b));
    const AttentionCache<double> ca = attention_forward(b.X, b.WQ, b.WK, b.WV, b.opts);
    const Mat<double> J = attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts);
    const Mat<double> Jb = attention_bias_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts);
    std::mt19937_64 rng(5);
    const Index D = b.X.cols(), dk = b.WQ.cols(), dv = b.WV.cols();
    AttentionTangents<double> t;
    t.dWQ = randn<double>(D, dk, rng);
    t.dWK = randn<double>(D, dk, rng);
    t.dWV = randn<double>(D, dv, rng);
    t.dbQ = randn<double>(dk, 1, rng);
    t.dbK = randn<double>(dk, 1, rng);
    t.dbV = randn<double>(dv, 1, rng);
    Vec<double> w(J.cols()), db(Jb.cols());
    w << Eigen::Map<const Vec<double>>(t.dWQ.data(), t.dWQ.size()),
        Eigen::Map<const Vec<double>>(t.dWK.data(), t.dWK.size()),
        Eigen::Map<const Vec<double>>(t.dWV.data(), t.dWV.size());
    db << t.dbQ, t.dbK, t.dbV;
    const Mat<double> dA = attention_jvp<double>(b.X, b.WQ, b.WK, b.WV, ca, t);
    const Vec<double> expect = J * w + Jb * db;
    CHECK(rel_err(Eigen::Map<const Vec<double>>(dA.data(), dA.size()), expect) < 1e-13);

    const Mat<double> G = randn<double>(b.X.rows(), dv, rng);
    const AttentionGradients<double> g = attention_vjp<double>(b.X, b.WQ, b.WK, b.WV, ca, G);
    const Vec<double> gv = Eigen::Map<const Vec<double>>(G.data(), G.size());
    const Vec<double> JTg = J.transpose() * gv, JbTg = Jb.transpose() * gv;
    CHECK(rel_err(Eigen::Map<const Vec<double>>(g.dWQ.data(), g.dWQ.size()), JTg.head(D * dk)) <
          1e-13);
    CHECK(rel_err(Eigen::Map<const Vec<double>>(g.dWK.data(), g.dWK.size()),
                  JTg.segment(D * dk, D * dk)) < 1e-13);
    CHECK(rel_err(Eigen::Map<const Vec<double>>(g.dWV.data(), g.dWV.size()), JTg.tail(D * dv)) <
          1e-13);
    CHECK(rel_err(g.dbQ, JbTg.head(dk)) < 1e-13);
    CHECK(rel_err(g.dbV, JbTg.tail(dv)) < 1e-13);
    if (b.opts.rope)
      CHECK(rel_err(g.dbK, JbTg.segment(dk, dk)) < 1e-13);
    else
      CHECK(g.dbK.cwiseAbs().maxCoeff() < 1e-13 * g.dbQ.cwiseAbs().maxCoeff());

    // J_X through the operator (the closed form refuses RoPE) against finite differences.
    auto fx = [&](const Mat<double>& X) { return reference_forward(X, b.WQ, b.WK, b.WV, b.opts); };
    const Mat<double> JXfd = numerical_jacobian<double>(fx, b.X);
    const JacobianOp<double> op(b.X, b.WQ, b.WK, b.WV, b.opts, JacobianBlock::X);
    Mat<double> JX(op.rows(), op.cols());
    Vec<double> e = Vec<double>::Zero(op.cols());
    for (Index k = 0; k < op.cols(); ++k) {
      e.setZero();
      e(k) = 1;
      op.perform_op(e.data(), JX.col(k).data());
    }
    CHECK(rel_err(JX, JXfd) < 1e-8);
    if (b.opts.rope) {
      CHECK_THROWS_WITH_AS(attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts, JacobianBlock::X),
                           doctest::Contains("does not model RoPE"), std::invalid_argument);
      CHECK_THROWS_AS(compressed_input_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts),
                      std::invalid_argument);
    } else {
      CHECK(rel_err(attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts, JacobianBlock::X), JXfd) <
            1e-8);
    }
  }
}

TEST_CASE("Gram, normal and compressed forms with biases and RoPE equal those of J") {
  for (const Block& b : variants(6, 5, 4, 3, 401)) {
    INFO(describe(b));
    for (JacobianBlock blk :
         {JacobianBlock::All, JacobianBlock::Q, JacobianBlock::K, JacobianBlock::V}) {
      INFO("block " << std::string(to_string(blk)));
      const Mat<double> J = attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts, blk);
      const Mat<double> JJt = J * J.transpose(), JtJ = J.transpose() * J;
      CHECK(rel_err(attention_gram(b.X, b.WQ, b.WK, b.WV, b.opts, blk), JJt) < 1e-13);
      CHECK(rel_err(attention_normal(b.X, b.WQ, b.WK, b.WV, b.opts, blk), JtJ) < 1e-13);
    }
    const Mat<double> J = attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts);
    const Mat<double> Jc = compressed_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts);
    CHECK(rel_err(Jc * Jc.transpose(), J * J.transpose()) < 1e-13);
    CHECK_THROWS_WITH_AS(ReducedCompressedJacobian<double>(b.X, b.WQ, b.WK, b.WV, b.opts),
                         doctest::Contains("without biases or RoPE"), std::invalid_argument);
  }
}

TEST_CASE("every kappa(J) method with biases and RoPE agrees with the SVD of J") {
  // Wide J: N d_v = 16 < D (2 d_k + d_v) = 144, conditioned well enough (kappa ~ 1e2) for the
  // methods that square J to answer.
  for (const Block& b : variants(4, 12, 4, 4, 501)) {
    INFO(describe(b));
    const Vec<double> sv = svd_values(attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts));
    const double kref = sv(0) / sv(sv.size() - 1);
    MESSAGE(describe(b) << ": kappa(J) = " << kref);
    for (JacobianKappaMethod m :
         {JacobianKappaMethod::Dense, JacobianKappaMethod::Gram, JacobianKappaMethod::Iterative,
          JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Qr, JacobianKappaMethod::Auto}) {
      INFO("method " << std::string(to_string(m)));
      JacobianKappaOptions jo;
      jo.method = m;
      const ConditionResult<double> r = kappa_jacobian<double>(b.X, b.WQ, b.WK, b.WV, b.opts, jo);
      INFO("note: " << r.note);
      REQUIRE(r.info == Info::Success);
      const double tol = std::max(1e-9, 100 * sc_test::eps<double>() * kref * kref);
      CHECK(std::abs(r.sigma_max - sv(0)) < 1e-12 * sv(0));
      CHECK(std::abs(r.kappa - kref) < tol * kref);
    }
    // Weights and biases together: [J_W | J_b].
    Mat<double> Jwb(b.X.rows() * b.WV.cols(), 0);
    {
      const Mat<double> J = attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts);
      const Mat<double> Jb = attention_bias_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts);
      Jwb.resize(J.rows(), J.cols() + Jb.cols());
      Jwb << J, Jb;
    }
    const Vec<double> svb = svd_values(Jwb);
    for (JacobianKappaMethod m : {JacobianKappaMethod::Dense, JacobianKappaMethod::Qr}) {
      JacobianKappaOptions jo;
      jo.method = m;
      jo.include_biases = true;
      const ConditionResult<double> r = kappa_jacobian<double>(b.X, b.WQ, b.WK, b.WV, b.opts, jo);
      INFO("include_biases, method " << std::string(to_string(m)) << ": " << r.note);
      CHECK(r.note.find("weights and biases") != std::string::npos);
      CHECK(std::abs(r.sigma_max - svb(0)) < 1e-12 * svb(0));
      CHECK(std::abs(r.sigma_min - svb(svb.size() - 1)) < 1e-9 * svb(svb.size() - 1));
    }
    JacobianKappaOptions jo;
    jo.include_biases = true;
    CHECK_THROWS_WITH_AS(kappa_jacobian_dense<double>(b.X, b.WQ, b.WK, b.WV, b.opts, jo),
                         doctest::Contains("with_bias_parameters"), std::invalid_argument);
  }
  // Tall J (N d_v = 32 > D (2 d_k + d_v) = 18): the gauge null space makes kappa = +inf, and
  // kappa_plus with the rank is the answer (gram goes through J^T J here).
  for (const Block& b : variants(16, 3, 2, 2, 601)) {
    if (b.opts.rope && b.opts.rope->dims != 0) continue;  // d_k = 2: no room for partial RoPE
    INFO(describe(b));
    const ConditionResult<double> d =
        kappa(attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts), KappaOptions<double>{});
    for (JacobianKappaMethod m : {JacobianKappaMethod::Gram, JacobianKappaMethod::Qr}) {
      JacobianKappaOptions jo;
      jo.method = m;
      const ConditionResult<double> r = kappa_jacobian<double>(b.X, b.WQ, b.WK, b.WV, b.opts, jo);
      INFO("method " << std::string(to_string(m)) << ": " << r.note);
      CHECK(r.rank == d.rank);
      CHECK(std::abs(r.kappa_plus - d.kappa_plus) < 1e-6 * d.kappa_plus);
    }
  }
}

TEST_CASE("multi-head layer with fused biases and RoPE: each head is the single-head block") {
  const Index N = 6, D = 8, h = 4, hkv = 2, dk = 4, dv = 3;
  std::mt19937_64 rng(77);
  MultiHeadOptions<double> mo;
  mo.heads = h;
  mo.kv_heads = hkv;
  mo.bias_q = randn<double>(h * dk, 1, rng);
  mo.bias_k = randn<double>(hkv * dk, 1, rng);
  mo.bias_v = randn<double>(hkv * dv, 1, rng);
  mo.rope = RopeOptions{};
  mo.rope->theta = 50;
  const Mat<double> X = randn<double>(N, D, rng);
  const Mat<double> WQ = randn<double>(D, h * dk, rng, 0.5),
                    WK = randn<double>(D, hkv * dk, rng, 0.5),
                    WV = randn<double>(D, hkv * dv, rng, 0.5);
  const MultiHeadCache<double> mc = multihead_forward(X, WQ, WK, WV, mo);
  const MultiHeadShape s = mo.check("test", X, WQ, WK, WV);
  for (Index j = 0; j < h; ++j) {
    const Index g = s.kv_of(j);
    const AttentionOptions<double> ho = detail::head_options(mo, s, j);
    const Mat<double> Aj = reference_forward(
        X, WQ.middleCols(j * dk, dk), WK.middleCols(g * dk, dk), WV.middleCols(g * dv, dv), ho);
    CHECK(rel_err(mc.A.middleCols(j * dv, dv), Aj) < 1e-14);
  }
  // The layer's JVP against finite differences of its forward pass, and its VJP as J^T.
  const Mat<double> J = multihead_jacobian<double>(X, WQ, WK, WV, mo);
  auto f = [&](const Mat<double>& w) {
    const Mat<double> q = Eigen::Map<const Mat<double>>(w.data(), D, h * dk);
    const Mat<double> k = Eigen::Map<const Mat<double>>(w.data() + D * h * dk, D, hkv * dk);
    const Mat<double> v = Eigen::Map<const Mat<double>>(w.data() + D * (h + hkv) * dk, D, hkv * dv);
    return multihead_forward(X, q, k, v, mo).A;
  };
  Mat<double> w(WQ.size() + WK.size() + WV.size(), 1);
  w.col(0) << Eigen::Map<const Vec<double>>(WQ.data(), WQ.size()),
      Eigen::Map<const Vec<double>>(WK.data(), WK.size()),
      Eigen::Map<const Vec<double>>(WV.data(), WV.size());
  const Mat<double> Jfd = numerical_jacobian<double>(f, w);
  // multihead_jacobian's rows are head-major bands of N d_v; the layer's A is N x h d_v, whose
  // vec has the same order (column j d_v + e of A is band j's column e).
  CHECK(rel_err(J, Jfd) < 1e-8);
  AttentionTangents<double> t;
  t.dWQ = randn<double>(D, h * dk, rng);
  t.dWK = randn<double>(D, hkv * dk, rng);
  t.dWV = randn<double>(D, hkv * dv, rng);
  t.dX = randn<double>(N, D, rng);
  const Mat<double> dA = multihead_jvp<double>(X, WQ, WK, WV, mo, mc, t);
  const Mat<double> dAfd = central_difference<double>(
      [&](const Mat<double>& x) {
        const Index n = D * h * dk, m = D * hkv * dk;
        return multihead_forward(
                   Mat<double>(Eigen::Map<const Mat<double>>(x.data(), N, D)),
                   Mat<double>(Eigen::Map<const Mat<double>>(x.data() + N * D, D, h * dk)),
                   Mat<double>(Eigen::Map<const Mat<double>>(x.data() + N * D + n, D, hkv * dk)),
                   Mat<double>(
                       Eigen::Map<const Mat<double>>(x.data() + N * D + n + m, D, hkv * dv)),
                   mo)
            .A;
      },
      [&] {
        Mat<double> x(N * D + WQ.size() + WK.size() + WV.size(), 1);
        x.col(0) << Eigen::Map<const Vec<double>>(X.data(), X.size()),
            Eigen::Map<const Vec<double>>(WQ.data(), WQ.size()),
            Eigen::Map<const Vec<double>>(WK.data(), WK.size()),
            Eigen::Map<const Vec<double>>(WV.data(), WV.size());
        return x;
      }(),
      [&] {
        Mat<double> x(N * D + WQ.size() + WK.size() + WV.size(), 1);
        x.col(0) << Eigen::Map<const Vec<double>>(t.dX.data(), t.dX.size()),
            Eigen::Map<const Vec<double>>(t.dWQ.data(), t.dWQ.size()),
            Eigen::Map<const Vec<double>>(t.dWK.data(), t.dWK.size()),
            Eigen::Map<const Vec<double>>(t.dWV.data(), t.dWV.size());
        return x;
      }());
  CHECK(rel_err(dA, dAfd) < 1e-7);  // one central difference along a long tangent
  const Mat<double> G = randn<double>(N, h * dv, rng);
  const AttentionGradients<double> g = multihead_vjp<double>(X, WQ, WK, WV, mo, mc, G);
  const Vec<double> JTg = J.transpose() * Eigen::Map<const Vec<double>>(G.data(), G.size());
  CHECK(rel_err(Eigen::Map<const Vec<double>>(g.dWQ.data(), g.dWQ.size()), JTg.head(WQ.size())) <
        1e-13);
  CHECK(rel_err(Eigen::Map<const Vec<double>>(g.dWV.data(), g.dWV.size()), JTg.tail(WV.size())) <
        1e-13);
}

TEST_CASE("biases and RoPE: bad input named, and the routines that do not model them refuse") {
  Block b = make_block(5, 4, 4, 2, 9, true, RopeOptions{});
  AttentionOptions<double> o = b.opts;
  o.bias_q = Vec<double>::Ones(3);
  CHECK_THROWS_WITH_AS(attention(b.X, b.WQ, b.WK, b.WV, o),
                       doctest::Contains("bias_q must have length 4 (got 3)"),
                       std::invalid_argument);
  o = b.opts;
  o.bias_v(0) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(attention(b.X, b.WQ, b.WK, b.WV, o),
                       doctest::Contains("bias_v must be finite"), std::invalid_argument);
  o = b.opts;
  o.rope->dims = 3;
  CHECK_THROWS_WITH_AS(attention(b.X, b.WQ, b.WK, b.WV, o),
                       doctest::Contains("rope dims must be even"), std::invalid_argument);
  o = b.opts;
  o.rope->theta = 0;
  CHECK_THROWS_WITH_AS(attention(b.X, b.WQ, b.WK, b.WV, o), doctest::Contains("rope theta"),
                       std::invalid_argument);
  CHECK(parse_rope_pairing("interleaved") == RopePairing::Interleaved);
  CHECK_THROWS_WITH_AS(parse_rope_pairing("neox"), doctest::Contains("rotate_half or interleaved"),
                       std::invalid_argument);
}

TEST_CASE("theorem34 with biases and RoPE: every term computed, the bound not applicable") {
  // Without them the bound applies (the control).
  const Block plain = make_block(6, 5, 4, 3, 700, false, std::nullopt);
  const Theorem34Report r0 = theorem34<double>(plain.X, plain.WQ, plain.WK, plain.WV, plain.opts);
  CHECK(r0.bound_applies);
  CHECK(std::isfinite(r0.bound_plus));
  CHECK(r0.holds_plus);
  for (const Block& b : variants(6, 5, 4, 3, 701)) {
    CAPTURE(describe(b));
    REQUIRE(b.opts.extended());
    const Theorem34Report r = theorem34<double>(b.X, b.WQ, b.WK, b.WV, b.opts);
    const Vec<double> s =
        attention_jacobian(b.X, b.WQ, b.WK, b.WV, b.opts).jacobiSvd().singularValues();
    const double kref = s(0) / s(s.size() - 1);
    CHECK(std::abs(r.J.kappa - kref) <= std::max(1e-9, 100 * sc_test::eps<double>() * kref * kref));
    CHECK(r.J.kappa == kappa_jacobian<double>(b.X, b.WQ, b.WK, b.WV, b.opts).kappa);
    CHECK(r.X.kappa == kappa(b.X).kappa);
    CHECK(r.WQ.kappa == kappa(b.WQ).kappa);
    // P of the biased, rotated logits.
    CHECK(r.P.kappa == kappa(attention_forward(b.X, b.WQ, b.WK, b.WV, b.opts).P).kappa);
    CHECK_FALSE(r.bound_applies);
    CHECK(std::isnan(r.bound));
    CHECK(std::isnan(r.bound_plus));
    CHECK(std::isnan(r.ratio_plus));
    CHECK_FALSE(r.holds);
    CHECK_FALSE(r.holds_plus);
    CHECK(r.verdict.find("not applicable") != std::string::npos);
    // The hypothesis-free bound holds with biases and RoPE: J_V = I (x) P X still.
    REQUIRE(r.have_diagnostics);
    CHECK(r.free_bound_holds);
  }
}
