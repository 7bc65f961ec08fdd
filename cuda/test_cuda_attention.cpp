// The CUDA forward, JVP, VJP, structured Gram and dense Jacobian against the CPU path on the
// same inputs (MATH.md §2–3): relative error <= 1e-10 in double, 1e-4 in float.
#include "cuda_test_main.hpp"

#include "spectral_cond/core/multihead.hpp"
#include "spectral_cond/jacobian/gram.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"

using sc::Index;
using sc::Mat;

namespace {

template <typename Scalar>
void set_mask(scc::AttentionBatch<Scalar>& b, sc::MaskKind mask) {
  b.opts.mask = mask;
  if (mask == sc::MaskKind::Additive) {
    const Index N = b.X[0].rows();
    b.opts.additive_mask = Mat<Scalar>::Zero(N, N);
    for (Index i = 0; i < N; ++i)
      for (Index j = 0; j < N; ++j)
        if ((i + 2 * j) % 3 == 1 && i != j)
          b.opts.additive_mask(i, j) = -sc::ScalarTraits<Scalar>::inf();
        else
          b.opts.additive_mask(i, j) = static_cast<Scalar>(0.1 * double(i - j));
  }
}

template <typename Scalar>
void check_forward(bool per_item_x, sc::MaskKind mask) {
  auto b = make_batch<Scalar>(7, 5, 3, 4, 3, per_item_x, 11);
  set_mask(b, mask);
  const auto gpu_out = scc::attention_forward_batched(gpu(), b);
  REQUIRE(gpu_out.size() == 3);
  for (Index h = 0; h < b.size(); ++h) {
    const size_t u = static_cast<size_t>(h);
    const auto cpu = sc::attention_forward(b.x(h), b.WQ[u], b.WK[u], b.WV[u], b.opts);
    CHECK(rel(gpu_out[u].Q, cpu.Q) <= tol<Scalar>());
    CHECK(rel(gpu_out[u].P, cpu.P) <= tol<Scalar>());
    CHECK(rel(gpu_out[u].A, cpu.A) <= tol<Scalar>());
    CHECK(gpu_out[u].scale == cpu.scale);
  }
}

template <typename Scalar>
void check_jvp_vjp(sc::MaskKind mask, bool only_v) {
  auto b = make_batch<Scalar>(6, 5, 3, 2, 2, true, 12);
  set_mask(b, mask);
  std::mt19937_64 g(13);
  std::vector<sc::AttentionTangents<Scalar>> t(2);
  std::vector<Mat<Scalar>> G;
  for (auto& ti : t) {
    ti.dWV = randn<Scalar>(5, 2, g);
    if (!only_v) {
      ti.dWQ = randn<Scalar>(5, 3, g);
      ti.dWK = randn<Scalar>(5, 3, g);
      ti.dX = randn<Scalar>(6, 5, g);
    }
    G.push_back(randn<Scalar>(6, 2, g));
  }
  const auto dA = scc::attention_jvp_batched(gpu(), b, t);
  const auto grads = scc::attention_vjp_batched(gpu(), b, G);
  for (Index h = 0; h < b.size(); ++h) {
    const size_t u = static_cast<size_t>(h);
    const auto cache = sc::attention_forward(b.x(h), b.WQ[u], b.WK[u], b.WV[u], b.opts);
    const Mat<Scalar> cpu_dA =
        sc::attention_jvp<Scalar>(b.x(h), b.WQ[u], b.WK[u], b.WV[u], cache, t[u]);
    CHECK(rel(dA[u], cpu_dA) <= tol<Scalar>());
    const auto cg = sc::attention_vjp<Scalar>(b.x(h), b.WQ[u], b.WK[u], b.WV[u], cache, G[u]);
    CHECK(rel(grads[u].dWQ, cg.dWQ) <= tol<Scalar>());
    CHECK(rel(grads[u].dWK, cg.dWK) <= tol<Scalar>());
    CHECK(rel(grads[u].dWV, cg.dWV) <= tol<Scalar>());
    CHECK(rel(grads[u].dX, cg.dX) <= tol<Scalar>());
  }
}

}  // namespace

TEST_CASE_TEMPLATE("cuda forward matches attention_forward", Scalar, float, double) {
  for (auto mask : {sc::MaskKind::None, sc::MaskKind::Causal, sc::MaskKind::Additive}) {
    CAPTURE(sc::to_string(mask));
    check_forward<Scalar>(false, mask);
    check_forward<Scalar>(true, mask);
  }
}

TEST_CASE_TEMPLATE("cuda JVP and VJP match the CPU", Scalar, float, double) {
  for (auto mask : {sc::MaskKind::None, sc::MaskKind::Causal}) {
    CAPTURE(sc::to_string(mask));
    check_jvp_vjp<Scalar>(mask, false);
    check_jvp_vjp<Scalar>(mask, true);
  }
}

TEST_CASE("cuda heads_of_layer matches multihead_forward (grouped-query)") {
  std::mt19937_64 g(14);
  const Mat<double> X = randn<double>(9, 8, g), WQ = randn<double>(8, 4 * 2, g),
                    WK = randn<double>(8, 2 * 2, g), WV = randn<double>(8, 2 * 3, g);
  sc::MultiHeadOptions<double> o;
  o.heads = 4;
  o.kv_heads = 2;
  o.mask = sc::MaskKind::Causal;
  const auto cpu = sc::multihead_forward(X, WQ, WK, WV, o);
  const auto out = scc::attention_forward_batched(gpu(), scc::heads_of_layer(X, WQ, WK, WV, o));
  for (Index j = 0; j < 4; ++j)
    CHECK(rel(out[static_cast<size_t>(j)].A, Mat<double>(cpu.A.middleCols(j * 3, 3))) <= 1e-10);
}

TEST_CASE_TEMPLATE("cuda structured Gram matches attention_gram", Scalar, float, double) {
  for (auto mask : {sc::MaskKind::None, sc::MaskKind::Causal}) {
    CAPTURE(sc::to_string(mask));
    auto b = make_batch<Scalar>(5, 7, 3, 4, 3, false, 15);
    b.opts.mask = mask;
    b.opts.scale = static_cast<Scalar>(0.8);
    const auto G = scc::attention_gram_batched(gpu(), b);
    for (Index h = 0; h < b.size(); ++h) {
      const size_t u = static_cast<size_t>(h);
      const Mat<Scalar> cpu = sc::attention_gram(b.x(h), b.WQ[u], b.WK[u], b.WV[u], b.opts);
      CHECK(rel(G[u], cpu) <= tol<Scalar>());
    }
  }
}

TEST_CASE_TEMPLATE("cuda dense Jacobian matches attention_jacobian", Scalar, float, double) {
  auto b = make_batch<Scalar>(5, 4, 3, 2, 1, false, 16);
  b.opts.mask = sc::MaskKind::Causal;
  const Mat<Scalar> J = scc::attention_jacobian(gpu(), b.X[0], b.WQ[0], b.WK[0], b.WV[0], b.opts);
  const Mat<Scalar> cpu = sc::attention_jacobian(b.X[0], b.WQ[0], b.WK[0], b.WV[0], b.opts);
  CHECK(rel(J, cpu) <= tol<Scalar>());
  // The Gram matrix of the device J is the structured one.
  const Mat<Scalar> G = scc::attention_gram_batched(gpu(), b)[0];
  CHECK(rel(Mat<Scalar>(J * J.transpose()), G) <= 10 * tol<Scalar>());
}

TEST_CASE("cuda errors: bad shapes throw invalid_argument, a bad device throws CudaError") {
  auto b = make_batch<double>(4, 3, 2, 2, 2, false, 17);
  b.WK[1] = Mat<double>::Zero(3, 5);
  CHECK_THROWS_AS(scc::attention_forward_batched(gpu(), b), std::invalid_argument);
  bool threw = false;
  try {
    scc::Context bad(scc::device_count() + 7);
  } catch (const std::runtime_error& e) {
    threw = true;
    MESSAGE(e.what());
    CHECK(std::string(e.what()).find("cudaSetDevice") != std::string::npos);
  }
  CHECK(threw);
}
