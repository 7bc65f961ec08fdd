// kappa(J) by the two accurate methods, qr (MATH.md §3, "Squaring is not affordable", "The
// compressed Jacobian") and lobpcg (jacobian_kappa.hpp), against a dense SVD of the assembled J,
// on a PyTorch-style instance (X ~ N(0, 1), W ~ N(0, 1/D), c = 1/sqrt(d_k)). A plain main:
// every number is a ratio measured in this run.
//
//   bench_qr_kappa                      (64, 64, 64, 64): qr and lobpcg vs Eigen BDCSVD and
//                                       LAPACK gesdd of J (time ratios, σ_min agreement), the
//                                       QR's flop rate vs the GEMM rate
//   bench_qr_kappa --vitb               the ViT-B head (197, 768, 64, 64): time, κ(J), accuracy
//   bench_qr_kappa --size N D dk dv     another size (qr only, with --no-dense)
//   bench_qr_kappa --write-npy DIR      also writes X, W_Q, W_K, W_V, J and the qr and lobpcg
//                                       results as .npy for bench/peers/numpy_svd.py
//   --threads T, --panel NB, --block M  QrKappaOptions; --no-dense skips the dense SVD; --seed S
#include <spectral_cond/conditioning/kappa.hpp>
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>
#include <spectral_cond/conditioning/methods/qr.hpp>
#include <spectral_cond/io/formats/npy.hpp>
#include <spectral_cond/jacobian/jacobian.hpp>

#include "bench_common.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <tuple>

using namespace spectral_cond;

namespace {

using sc_bench::Clock;
using sc_bench::since;
Mat<double> randn(Index r, Index c, std::mt19937_64& rng, double s) {
  return sc_bench::randn<Mat<double>>(r, c, rng, s);
}

/// Double GEMM rate (flop/s) on n x k times k x n, best of three single calls: Eigen's
/// (one thread, portable kernels) or, with `blas`, BLAS's with its own threads, the machine's
/// rate for the qr method built with LAPACKE, whose updates are BLAS GEMMs.
double gemm_rate(Index n, Index k, bool blas) {
  std::mt19937_64 rng(1);
  const Mat<double> A = randn(n, k, rng, 1.0), B = randn(k, n, rng, 1.0);
  Mat<double> C(n, n);
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t = Clock::now();
#ifdef SPECTRAL_COND_HAVE_LAPACKE
    if (blas)
      cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, int(n), int(n), int(k), 1.0, A.data(),
                  int(n), B.data(), int(k), 0.0, C.data(), int(n));
    else
#endif
      C.noalias() = A * B;
    best = std::min(best, since(t));
  }
  (void)blas;
  std::printf("  (GEMM check value %.3e)\n", C(0, 0));
  return 2.0 * double(n) * double(n) * double(k) / best;
}

struct Args {
  Index N = 64, D = 64, dk = 64, dv = 64;
  bool vitb = false, dense = true;
  std::string npy_dir;
  QrKappaOptions q;
  std::uint64_t seed = 2025;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", s.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (s == "--vitb") {
      a.vitb = true;
      a.dense = false;
      a.N = 197;
      a.D = 768;
      a.dk = a.dv = 64;
    } else if (s == "--size") {
      a.N = std::atol(next());
      a.D = std::atol(next());
      a.dk = std::atol(next());
      a.dv = std::atol(next());
    } else if (s == "--no-dense")
      a.dense = false;
    else if (s == "--write-npy")
      a.npy_dir = next();
    else if (s == "--threads")
      a.q.threads = static_cast<unsigned>(std::atoi(next()));
    else if (s == "--panel")
      a.q.panel = std::atol(next());
    else if (s == "--block")
      a.q.block_cols = std::atol(next());
    else if (s == "--seed")
      a.seed = std::strtoull(next(), nullptr, 10);
    else if (s.rfind("--benchmark", 0) == 0)
      continue;  // tolerated: scripts pass these to every bench
    else {
      std::fprintf(stderr, "unknown argument %s (see the comment at the top)\n", s.c_str());
      std::exit(2);
    }
  }
  return a;
}

/// kappa_jacobian_qr, timing the factorisation (until the progress callback reports 0.95).
ConditionResult<double> run_qr(const Args& a, const Mat<double>& X, const Mat<double>& WQ,
                               const Mat<double>& WK, const Mat<double>& WV, QrKappaOptions q,
                               double& total_s, double& factor_s, bool show_progress) {
  const auto t0 = Clock::now();
  factor_s = -1;
  q.progress = [&](double f) {
    if (f >= 0.95 && factor_s < 0) factor_s = since(t0);
    if (show_progress) std::fprintf(stderr, "\r  qr: %5.1f%% after %6.1f s", 100 * f, since(t0));
  };
  AttentionOptions<double> opts;
  const auto r = kappa_jacobian_qr<double>(X, WQ, WK, WV, opts, q);
  total_s = since(t0);
  if (show_progress) std::fprintf(stderr, "\n");
  (void)a;
  return r;
}

void print_result(const char* what, const ConditionResult<double>& r) {
  std::printf(
      "%s: sigma_max %.15e  sigma_min %.15e  kappa %.10e  rank %ld  accuracy %.2e  "
      "iterations %ld  residual %.1e  info %s\n  note: %s\n",
      what, r.sigma_max, r.sigma_min, r.kappa, static_cast<long>(r.rank), r.accuracy,
      static_cast<long>(r.iterations), r.residual, to_string(r.info), r.note.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  std::printf(
      "bench_qr_kappa: (N, D, d_k, d_v) = (%ld, %ld, %ld, %ld), seed %llu, threads %u, "
      "panel %ld (MATH.md §3, the qr method)\n",
      static_cast<long>(a.N), static_cast<long>(a.D), static_cast<long>(a.dk),
      static_cast<long>(a.dv), static_cast<unsigned long long>(a.seed), a.q.resolved_threads(),
      static_cast<long>(a.q.panel));
  std::mt19937_64 rng(a.seed);
  const double ws = 1.0 / std::sqrt(double(a.D));
  const Mat<double> X = randn(a.N, a.D, rng, 1.0), WQ = randn(a.D, a.dk, rng, ws),
                    WK = randn(a.D, a.dk, rng, ws), WV = randn(a.D, a.dv, rng, ws);
  // Rows of J~^T streamed into R: the reduced query-key part (ReducedCompressedJacobian).
  const Index n = a.N * a.dv, r = std::min(a.N, a.D), excess = std::max<Index>(0, r - a.dk),
              streamed = r * r - excess * excess;
  const bool wide = n <= streamed + r * a.dv;
  const double flops = wide ? 2.0 * double(streamed) * double(n) * double(n) : 0.0;

  double total = 0, factor = 0;
  const auto qr = run_qr(a, X, WQ, WK, WV, a.q, total, factor, a.vitb);
  print_result("qr", qr);
  std::printf(
      "qr: %.3f s total, %.3f s to stream J~ into R (%.3g flop, %.2f Gflop/s with %u "
      "threads)\n",
      total, factor, flops, flops / factor / 1e9, a.q.resolved_threads());
  const auto tl = Clock::now();
  const auto lob = kappa_jacobian_lobpcg<double>(X, WQ, WK, WV, AttentionOptions<double>{});
  const double lob_s = since(tl);
  print_result("lobpcg", lob);
  std::printf("lobpcg: %.3f s total (qr / lobpcg = %.1fx); sigma_min rel. diff to qr %.2e\n", lob_s,
              total / lob_s, std::abs(lob.sigma_min - qr.sigma_min) / qr.sigma_min);

#ifdef SPECTRAL_COND_HAVE_LAPACKE
  if (!a.vitb) {
    // The updates are BLAS GEMMs with BLAS's threads: judged against BLAS's own GEMM rate, each
    // the best of three runs (the first QR above and two more).
    double best = factor;
    for (int rep = 0; rep < 2; ++rep) {
      double t = 0, f = 0;
      run_qr(a, X, WQ, WK, WV, a.q, t, f, false);
      best = std::min(best, f);
    }
    const double gemm = gemm_rate(2048, 1024, true), eigen_gemm = gemm_rate(2048, 1024, false);
    std::printf(
        "qr streaming, best of 3: %.2f Gflop/s (runs of this machine vary by up to 25%%); BLAS "
        "GEMM 2048 x 1024 x 2048, best of 3: %.2f Gflop/s (same threads); QR at %.0f%% of the "
        "GEMM rate (goal >= 50%%); Eigen's portable GEMM, one thread: %.2f Gflop/s\n",
        flops / best / 1e9, gemm / 1e9, 100 * flops / best / gemm, eigen_gemm / 1e9);
  }
#else
  if (!a.vitb) {
    // The flop-rate goal is judged single-threaded against Eigen's (single-threaded) GEMM.
    QrKappaOptions q1 = a.q;
    q1.threads = 1;
    double total1 = 0, factor1 = 0;
    const auto qr1 = run_qr(a, X, WQ, WK, WV, q1, total1, factor1, false);
    const double rate1 = flops / factor1;
    const double gemm = gemm_rate(2048, 1024, false);
    std::printf(
        "qr, 1 thread: %.3f s total, %.3f s streaming, %.2f Gflop/s; Eigen GEMM 2048 x "
        "1024 x 2048: %.2f Gflop/s; QR at %.0f%% of the GEMM rate (goal >= 50%%); "
        "sigma_min 1 vs %u threads: rel. diff %.1e\n",
        total1, factor1, rate1 / 1e9, gemm / 1e9, 100 * rate1 / gemm, a.q.resolved_threads(),
        std::abs(qr1.sigma_min - qr.sigma_min) / qr.sigma_min);
  }
#endif

  Mat<double> J;
  if (a.dense || !a.npy_dir.empty()) J = attention_jacobian(X, WQ, WK, WV);
  // A dense SVD of J by `svd`, timed, against the qr and lobpcg results (goal: >= 20x at <= 1e-9).
  auto dense = [&](SvdMethod svd, const char* name) {
    const auto t0 = Clock::now();
    KappaOptions<double> ko;
    ko.svd = svd;
    const auto d = kappa(J, ko);
    const double dense_s = since(t0);
    print_result(name, d);
    std::printf(
        "%s (%ld x %ld): %.3f s (both carry about eps kappa = %.1e; goals >= 20x at <= "
        "1e-9)\n",
        name, static_cast<long>(J.rows()), static_cast<long>(J.cols()), dense_s,
        2.22e-16 * d.kappa);
    for (const auto& [m, res, s] :
         {std::tuple{"qr", &qr, total}, std::tuple{"lobpcg", &lob, lob_s}})
      std::printf(
          "  time ratio dense / %s = %.1fx; sigma_min rel. diff %.2e, kappa rel. diff %.2e\n", m,
          dense_s / s, std::abs(res->sigma_min - d.sigma_min) / d.sigma_min,
          std::abs(res->kappa - d.kappa) / d.kappa);
  };
  if (a.dense) dense(SvdMethod::BDC, "dense Eigen BDCSVD of J");
  if (a.dense && have_lapacke()) dense(SvdMethod::Lapack, "dense LAPACK gesdd of J");
  if (!a.npy_dir.empty()) {
    io::write_npy(a.npy_dir + "/X.npy", X);
    io::write_npy(a.npy_dir + "/WQ.npy", WQ);
    io::write_npy(a.npy_dir + "/WK.npy", WK);
    io::write_npy(a.npy_dir + "/WV.npy", WV);
    io::write_npy(a.npy_dir + "/J.npy", J);
    Mat<double> res(1, 4);
    res << qr.sigma_max, qr.sigma_min, qr.kappa, total;
    io::write_npy(a.npy_dir + "/qr_result.npy", res);
    res << lob.sigma_max, lob.sigma_min, lob.kappa, lob_s;
    io::write_npy(a.npy_dir + "/lobpcg_result.npy", res);
    std::printf(
        "wrote X, WQ, WK, WV, J, qr_result and lobpcg_result (sigma_max, sigma_min, kappa, "
        "seconds) to %s\n",
        a.npy_dir.c_str());
  }
  return 0;
}
