// Benchmarks of the CUDA path (docs/cuda.md), a plain program printing the GPU model, times and
// accuracy against the CPU path on smaller sizes (STYLE.md habit 13). Parts, run all by default
// or named on the command line:
//   accuracy  κ(J) (MATH.md §3–4, gram and qr routes) and κ of weights vs the CPU, small sizes
//   head      κ(J) of one ViT-B head (N = 197, D = 768, d = 64) in double   goal <= 10 s
//   layer     κ(J) of all 12 heads of a ViT-B layer, batched                goal <= 30 s
//   weights   κ of the 144 W_Q/W_K/W_V head blocks of ViT-B (768 x 64)      goal <= 1 s
//             and their exact corrections (MATH.md §6, Theorem 3.5)
// Inputs: X ~ N(0, 1), W ~ N(0, 1/D), c = 1/sqrt(d_k) (MATH.md §3), seeded.
#include "spectral_cond/cuda/api.hpp"

#include <chrono>
#include <cstdio>
#include <random>
#include <string>

namespace sc = spectral_cond;
namespace scc = spectral_cond::cuda;
using sc::Index;
using sc::Mat;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Mat<double> randn(Index r, Index c, std::mt19937_64& g, double s) {
  std::normal_distribution<double> d(0.0, s);
  Mat<double> m(r, c);
  for (Index j = 0; j < c; ++j)
    for (Index i = 0; i < r; ++i) m(i, j) = d(g);
  return m;
}

scc::AttentionBatch<double> layer(Index N, Index D, Index d, Index heads, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  sc::MultiHeadOptions<double> o;
  o.heads = heads;
  const double ws = 1.0 / std::sqrt(static_cast<double>(D));
  return scc::heads_of_layer(randn(N, D, g, 1.0), randn(D, heads * d, g, ws),
                             randn(D, heads * d, g, ws), randn(D, heads * d, g, ws), o);
}

void print(const char* what, const sc::ConditionResult<double>& r) {
  std::printf(
      "  %-14s kappa = %.6e  sigma_max = %.6e  sigma_min = %.6e  accuracy = %.2e  info = %s\n"
      "  %-14s method: %s\n",
      what, r.kappa, r.sigma_max, r.sigma_min, r.accuracy, sc::to_string(r.info), "",
      r.method.c_str());
}

double rel(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-300);
}

scc::CudaKappaOptions opts(sc::JacobianKappaMethod m) {
  scc::CudaKappaOptions o;
  o.jacobian.method = m;
  o.jacobian.tol = 1e-6;
  return o;
}

void accuracy(scc::Context& ctx) {
  std::printf("== accuracy vs the CPU (MATH.md §3-4): N = 32, D = 64, d_k = d_v = 16, 2 heads\n");
  const auto b = layer(32, 64, 16, 2, 7);
  for (auto m : {sc::JacobianKappaMethod::Gram, sc::JacobianKappaMethod::Qr}) {
    double t0 = now();
    const auto g = scc::kappa_jacobian_batched(ctx, b, opts(m));
    const double tg = now() - t0;
    for (Index h = 0; h < b.size(); ++h) {
      const size_t u = static_cast<size_t>(h);
      t0 = now();
      const auto c =
          m == sc::JacobianKappaMethod::Gram
              ? sc::kappa_jacobian_gram<double>(b.x(h), b.WQ[u], b.WK[u], b.WV[u], b.opts)
              : sc::kappa_jacobian_qr<double>(b.x(h), b.WQ[u], b.WK[u], b.WV[u], b.opts);
      const double tc = now() - t0;
      std::printf(
          "  %s head %ld: kappa gpu %.10e cpu %.10e  rel diff sigma_max %.1e sigma_min %.1e"
          " (method accuracy %.1e)  gpu %.3f s (batch) cpu %.3f s\n",
          sc::to_string(m), static_cast<long>(h), g[u].kappa, c.kappa,
          rel(g[u].sigma_max, c.sigma_max), rel(g[u].sigma_min, c.sigma_min), c.accuracy, tg, tc);
    }
  }
  std::mt19937_64 gen(8);
  std::vector<Mat<double>> w;
  for (int i = 0; i < 24; ++i) w.push_back(randn(768, 64, gen, 1.0 / std::sqrt(768.0)));
  const auto r = scc::kappa_batched(ctx, w);
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i)
    worst = std::max(worst, rel(r[i].kappa, sc::kappa(w[i]).kappa));
  std::printf("  kappa of 24 blocks 768 x 64: worst rel diff vs CPU %.2e\n", worst);
}

void head(scc::Context& ctx) {
  std::printf("== kappa(J) of one ViT-B head (N = 197, D = 768, d = 64), double; goal <= 10 s\n");
  const auto b = layer(197, 768, 64, 1, 9);
  for (auto m : {sc::JacobianKappaMethod::Qr, sc::JacobianKappaMethod::Gram}) {
    const double t0 = now();
    const auto r = scc::kappa_jacobian_batched(ctx, b, opts(m));
    const double t = now() - t0;
    std::printf("  route %s: %.3f s (%s)\n", sc::to_string(m), t,
                t <= 10 ? "within goal" : "OVER GOAL");
    print(sc::to_string(m), r[0]);
  }
  std::printf("  device workspace held: %.2f GiB\n",
              static_cast<double>(ctx.workspace_bytes()) / (1024.0 * 1024.0 * 1024.0));
}

void layer12(scc::Context& ctx) {
  std::printf("== kappa(J) of the 12 heads of a ViT-B layer, batched, qr route; goal <= 30 s\n");
  const auto b = layer(197, 768, 64, 12, 10);
  const double t0 = now();
  const auto r = scc::kappa_jacobian_batched(ctx, b, opts(sc::JacobianKappaMethod::Qr));
  const double t = now() - t0;
  double smax = 0, smin = std::numeric_limits<double>::infinity();
  for (const auto& x : r) {
    smax = std::max(smax, x.sigma_max);
    smin = std::min(smin, x.sigma_min);
  }
  std::printf(
      "  12 heads: %.3f s (%s); layer kappa = max sigma_max / min sigma_min = %.6e "
      "(MATH.md §8)\n",
      t, t <= 30 ? "within goal" : "OVER GOAL", smax / smin);
  for (size_t h = 0; h < r.size(); ++h)
    std::printf("  head %2zu kappa = %.6e  accuracy %.1e  %s\n", h, r[h].kappa, r[h].accuracy,
                sc::to_string(r[h].info));
}

void weights(scc::Context& ctx) {
  std::printf("== kappa of the 144 W_Q/W_K/W_V head blocks of ViT-B (768 x 64); goal <= 1 s\n");
  std::mt19937_64 g(11);
  std::vector<Mat<double>> w;
  for (int i = 0; i < 144; ++i) w.push_back(randn(768, 64, g, 1.0 / std::sqrt(768.0)));
  (void)scc::kappa_batched(ctx, std::vector<Mat<double>>(w.begin(), w.begin() + 4));  // warm-up
  double t0 = now();
  const auto r = scc::kappa_batched(ctx, w);
  const double t = now() - t0;
  t0 = now();
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i)
    worst = std::max(worst, rel(r[i].kappa, sc::kappa(w[i]).kappa));
  const double tc = now() - t0;
  std::printf("  GPU %.3f s (%s), CPU %.3f s; worst rel diff of kappa vs CPU %.2e\n", t,
              t <= 1 ? "within goal" : "OVER GOAL", tc, worst);
  t0 = now();
  const auto e = scc::exact_correction_batched(ctx, w);
  const double te = now() - t0;
  double kmax = 0;
  for (const auto& x : e) kmax = std::max(kmax, x.kappa_after);
  std::printf(
      "  exact correction (Theorem 3.5) of all 144: %.3f s; max kappa(W + C) = %.6f (<= 2)\n", te,
      kmax);
}

}  // namespace

int main(int argc, char** argv) {
  if (scc::device_count() == 0) {
    std::printf("no CUDA device: skipped\n");
    return 0;
  }
  std::vector<std::string> parts(argv + 1, argv + argc);
  if (parts.empty()) parts = {"accuracy", "head", "layer", "weights"};
  try {
    scc::Context ctx(0);
    std::printf("GPU: %s\n", ctx.device_name().c_str());
    for (const auto& p : parts) {
      const double t0 = now();
      if (p == "accuracy")
        accuracy(ctx);
      else if (p == "head")
        head(ctx);
      else if (p == "layer")
        layer12(ctx);
      else if (p == "weights")
        weights(ctx);
      else {
        std::fprintf(stderr, "bench_cuda: unknown part '%s' (accuracy, head, layer, weights)\n",
                     p.c_str());
        return 2;
      }
      std::printf("  [%s done in %.2f s]\n", p.c_str(), now() - t0);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
