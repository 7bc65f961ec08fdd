// The out-parameter forms allocate nothing once their buffers have their shapes. Built with
// EIGEN_RUNTIME_NO_MALLOC: any Eigen heap allocation inside the guarded region aborts.
// (Small sizes: Eigen's GEMM keeps its blocking buffers on the stack below 128 KiB.)
#include <spectral_cond/spectral_cond.hpp>

#include "support/test_helpers.hpp"

using namespace spectral_cond;

TEST_CASE("forward, JVP and VJP allocate nothing in steady state") {
  std::mt19937_64 rng(11);
  const Index N = 8, D = 6, dk = 4, dv = 3;
  const Mat<double> X = sc_test::randn<double>(N, D, rng), WQ = sc_test::randn<double>(D, dk, rng);
  const Mat<double> WK = sc_test::randn<double>(D, dk, rng),
                    WV = sc_test::randn<double>(D, dv, rng);
  const Mat<double> dW = sc_test::randn<double>(D, dk, rng), G = sc_test::randn<double>(N, dv, rng);
  const Mat<double> dX = sc_test::randn<double>(N, D, rng),
                    dWV = sc_test::randn<double>(D, dv, rng);
  AttentionOptions<double> opts;
  opts.mask = MaskKind::Causal;
  AttentionCache<double> cache;
  AttentionWorkspace<double> ws;
  Mat<double> dA(N, dv), gQ(D, dk), gK(D, dk), gV(D, dv), gX(N, D);
  const Mat<double> none;
  auto run = [&] {
    attention_forward<double>(X, WQ, WK, WV, opts, cache);
    attention_jvp<double>(X, WQ, WK, WV, cache, dW, dW, dWV, dX, ws, dA);
    attention_jvp<double>(X, WQ, WK, WV, cache, dW, none, none, none, ws, dA);
    attention_vjp<double>(X, WQ, WK, WV, cache, G, ws, gQ, gK, gV, gX);
  };
  run();  // sizes the buffers
  Eigen::internal::set_is_malloc_allowed(false);
  run();
  run();
  Eigen::internal::set_is_malloc_allowed(true);
  CHECK(dA.allFinite());

  MultiHeadOptions<double> mo;
  mo.heads = 2;
  mo.kv_heads = 1;
  const Mat<double> WQ2 = sc_test::randn<double>(D, 2 * dk, rng);
  MultiHeadCache<double> mc;
  MultiHeadWorkspace<double> mw;
  Mat<double> dA2(N, 2 * dv), gQ2(D, 2 * dk), G2 = sc_test::randn<double>(N, 2 * dv, rng);
  auto run_mh = [&] {
    multihead_forward<double>(X, WQ2, WK, WV, mo, mc);
    multihead_jvp<double>(X, WQ2, WK, WV, mo, mc, none, dW, none, dX, mw, dA2);
    multihead_vjp<double>(X, WQ2, WK, WV, mo, mc, G2, mw, gQ2, gK, gV, gX);
  };
  run_mh();
  Eigen::internal::set_is_malloc_allowed(false);
  run_mh();
  Eigen::internal::set_is_malloc_allowed(true);
  CHECK(dA2.allFinite());
}
