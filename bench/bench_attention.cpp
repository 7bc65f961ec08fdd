// Forward, JVP and VJP of single-head attention (MATH.md §2) at (N, D, d) = (64, 64, 64),
// (197, 768, 64) and (512, 512, 64). Prints, from the same run: time, achieved GFLOP/s against
// the machine's GEMM rate, and the forward pass against the time of its own matrix products
// (goal: within 2x).
#include <spectral_cond/spectral_cond.hpp>

#include "bench_common.hpp"

#include <cstdio>

namespace sc = spectral_cond;
using M = sc::Mat<double>;

namespace {

struct Size {
  long N, D, d;
};
const Size kSizes[] = {{64, 64, 64}, {197, 768, 64}, {512, 512, 64}};

struct Inputs {
  M X, WQ, WK, WV, G, dWQ, dWK, dWV, dX;
  explicit Inputs(const Size& s) {
    std::mt19937_64 rng(7);
    const double ws = 1.0 / std::sqrt(static_cast<double>(s.D));
    X = sc_bench::randn<M>(s.N, s.D, rng);
    WQ = sc_bench::randn<M>(s.D, s.d, rng, ws);
    WK = sc_bench::randn<M>(s.D, s.d, rng, ws);
    WV = sc_bench::randn<M>(s.D, s.d, rng, ws);
    G = sc_bench::randn<M>(s.N, s.d, rng);
    dWQ = sc_bench::randn<M>(s.D, s.d, rng);
    dWK = sc_bench::randn<M>(s.D, s.d, rng);
    dWV = sc_bench::randn<M>(s.D, s.d, rng);
    dX = sc_bench::randn<M>(s.N, s.D, rng);
  }
};

double flops_forward(const Size& s) {
  const double N = static_cast<double>(s.N), D = static_cast<double>(s.D),
               d = static_cast<double>(s.d);
  return 2 * N * D * 3 * d + 2 * N * N * d * 2;
}
double flops_jvp(const Size& s) {  // all four tangents
  const double N = static_cast<double>(s.N), D = static_cast<double>(s.D),
               d = static_cast<double>(s.d);
  return 2 * 2 * N * D * 3 * d + 2 * 2 * N * N * d + 2 * 2 * N * N * d;
}
double flops_vjp(const Size& s) {
  const double N = static_cast<double>(s.N), D = static_cast<double>(s.D),
               d = static_cast<double>(s.d);
  return 2 * N * N * d * 4 + 2 * N * D * 3 * d * 2;
}

void BM_forward(benchmark::State& st, Size s) {
  Inputs in(s);
  sc::AttentionOptions<double> opts;
  sc::AttentionCache<double> cache;
  for (auto _ : st) {
    sc::attention_forward<double>(in.X, in.WQ, in.WK, in.WV, opts, cache);
    benchmark::DoNotOptimize(cache.A.data());
  }
}

// The forward pass's matrix products alone (Q, K, V, Q K^T, P V), no softmax, no checks.
void BM_forward_products(benchmark::State& st, Size s) {
  Inputs in(s);
  M Q(s.N, s.d), K(s.N, s.d), V(s.N, s.d), P(s.N, s.N), A(s.N, s.d);
  for (auto _ : st) {
    Q.noalias() = in.X * in.WQ;
    K.noalias() = in.X * in.WK;
    V.noalias() = in.X * in.WV;
    P.noalias() = Q * K.transpose();
    A.noalias() = P * V;
    benchmark::DoNotOptimize(A.data());
  }
}

void BM_jvp(benchmark::State& st, Size s) {
  Inputs in(s);
  sc::AttentionOptions<double> opts;
  sc::AttentionCache<double> cache;
  sc::attention_forward<double>(in.X, in.WQ, in.WK, in.WV, opts, cache);
  sc::AttentionWorkspace<double> ws;
  M dA(s.N, s.d);
  for (auto _ : st) {
    sc::attention_jvp<double>(in.X, in.WQ, in.WK, in.WV, cache, in.dWQ, in.dWK, in.dWV, in.dX, ws,
                              dA);
    benchmark::DoNotOptimize(dA.data());
  }
}

void BM_vjp(benchmark::State& st, Size s) {
  Inputs in(s);
  sc::AttentionOptions<double> opts;
  sc::AttentionCache<double> cache;
  sc::attention_forward<double>(in.X, in.WQ, in.WK, in.WV, opts, cache);
  sc::AttentionWorkspace<double> ws;
  M gQ(s.D, s.d), gK(s.D, s.d), gV(s.D, s.d), gX(s.N, s.D);
  for (auto _ : st) {
    sc::attention_vjp<double>(in.X, in.WQ, in.WK, in.WV, cache, in.G, ws, gQ, gK, gV, gX);
    benchmark::DoNotOptimize(gX.data());
  }
}

// The machine's GEMM rate: an Eigen double GEMM of comparable size (512 x 512 x 512).
void BM_gemm(benchmark::State& st) {
  std::mt19937_64 rng(1);
  const M a = sc_bench::randn<M>(512, 512, rng), b = sc_bench::randn<M>(512, 512, rng);
  M c(512, 512);
  for (auto _ : st) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
}

std::string name(const char* what, const Size& s) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s/N=%ld/D=%ld/d=%ld", what, s.N, s.D, s.d);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::RegisterBenchmark("gemm/512", BM_gemm)->Unit(benchmark::kMillisecond);
  for (const Size& s : kSizes) {
    benchmark::RegisterBenchmark(name("forward", s).c_str(), BM_forward, s)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(name("forward_products", s).c_str(), BM_forward_products, s)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(name("jvp", s).c_str(), BM_jvp, s)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(name("vjp", s).c_str(), BM_vjp, s)->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  sc_bench::CollectingReporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  const double gemm_s = rep.seconds("gemm/512");
  if (gemm_s <= 0) return 0;
  const double gemm_rate = 2.0 * 512 * 512 * 512 / gemm_s / 1e9;
  std::printf("\nmachine GEMM rate (Eigen, double, 512^3): %.2f GFLOP/s\n", gemm_rate);
  std::printf("%-22s %10s %10s %10s %9s %9s %9s %14s\n", "size", "fwd ms", "jvp ms", "vjp ms",
              "fwd %gemm", "jvp %gemm", "vjp %gemm", "fwd/products");
  for (const Size& s : kSizes) {
    const double f = rep.seconds(name("forward", s)), p = rep.seconds(name("forward_products", s));
    const double j = rep.seconds(name("jvp", s)), v = rep.seconds(name("vjp", s));
    if (f <= 0 || p <= 0 || j <= 0 || v <= 0) continue;
    char sz[32];
    std::snprintf(sz, sizeof sz, "(%ld, %ld, %ld)", s.N, s.D, s.d);
    std::printf("%-22s %10.3f %10.3f %10.3f %8.0f%% %8.0f%% %8.0f%% %13.2fx %s\n", sz, f * 1e3,
                j * 1e3, v * 1e3, 100 * flops_forward(s) / f / 1e9 / gemm_rate,
                100 * flops_jvp(s) / j / 1e9 / gemm_rate, 100 * flops_vjp(s) / v / 1e9 / gemm_rate,
                f / p, f / p <= 2.0 ? "(goal <= 2x: met)" : "(goal <= 2x: NOT met)");
  }
  return 0;
}
