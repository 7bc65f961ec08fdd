// Assembly of the attention Jacobian and its Gram matrix (MATH.md §3).
//
// (1) attention_jacobian at (N, D, d_k = d_v) = (128, 64, 64), 8192 x 12288 (805 MB in double),
//     against a plain std::fill and a memcpy of a buffer of the same size: MATH.md §3 says
//     assembly is bound by the memory traffic of writing J (goal: within 2x of the fill).
// (2) attention_gram (the structured J J^T of MATH.md §3) against J J^T from the assembled J
//     at (64, 64, 64) (goal: >= 10x faster), with the max relative difference between the two.
//     The baseline is Eigen's SYRK (rankUpdate), half the flops of the GEMM J * J^T.
//
// All buffers are allocated and touched before timing, so page faults are not measured. The
// ratios are printed after the Google Benchmark table.
#include <spectral_cond/jacobian/gram.hpp>
#include <spectral_cond/jacobian/jacobian.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>

namespace sc = spectral_cond;
using sc::Index;
using M = sc::Mat<double>;

namespace {

struct Inputs {
  M X, WQ, WK, WV;
};

Inputs make_inputs(Index N, Index D, Index d, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> z(0.0, 1.0);
  auto randn = [&](Index r, Index c, double s) {
    M m(r, c);
    for (Index k = 0; k < m.size(); ++k) m.data()[k] = s * z(rng);
    return m;
  };
  const double ws = 1.0 / std::sqrt(static_cast<double>(D));
  Inputs in;
  in.X = randn(N, D, 1.0);
  in.WQ = randn(D, d, ws);
  in.WK = randn(D, d, ws);
  in.WV = randn(D, d, ws);
  return in;
}

constexpr Index kN = 128, kD = 64, kd = 64;  // assembly size
constexpr Index kGN = 64;                    // Gram size: (64, 64, 64)

double g_gram_rel_diff = -1;

void BM_AssembleJ(benchmark::State& state) {
  const Inputs in = make_inputs(kN, kD, kd, 1);
  const sc::AttentionOptions<double> opts;
  M J =
      M::Zero(sc::jacobian_rows(kN, kd), sc::jacobian_cols(sc::JacobianBlock::All, kN, kD, kd, kd));
  for (auto _ : state) {
    sc::attention_jacobian<double>(in.X, in.WQ, in.WK, in.WV, opts, sc::JacobianBlock::All, J);
    benchmark::DoNotOptimize(J.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * J.size() * static_cast<int64_t>(sizeof(double)));
}

void BM_FillBuffer(benchmark::State& state) {
  M J =
      M::Zero(sc::jacobian_rows(kN, kd), sc::jacobian_cols(sc::JacobianBlock::All, kN, kD, kd, kd));
  double v = 1.0;
  for (auto _ : state) {
    std::fill(J.data(), J.data() + J.size(), v);
    v += 1.0;
    benchmark::DoNotOptimize(J.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * J.size() * static_cast<int64_t>(sizeof(double)));
}

void BM_MemcpyBuffer(benchmark::State& state) {
  M src = M::Constant(sc::jacobian_rows(kN, kd),
                      sc::jacobian_cols(sc::JacobianBlock::All, kN, kD, kd, kd), 2.0);
  M dst = M::Zero(src.rows(), src.cols());
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), static_cast<size_t>(src.size()) * sizeof(double));
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * src.size() * static_cast<int64_t>(sizeof(double)));
}

void BM_GramStructured(benchmark::State& state) {
  const Inputs in = make_inputs(kGN, kGN, kGN, 2);
  const sc::AttentionOptions<double> opts;
  M G = M::Zero(kGN * kGN, kGN * kGN);
  for (auto _ : state) {
    sc::attention_gram<double>(in.X, in.WQ, in.WK, in.WV, opts, sc::JacobianBlock::All, G);
    benchmark::DoNotOptimize(G.data());
  }
}

void BM_GramFromJ(benchmark::State& state) {
  const Inputs in = make_inputs(kGN, kGN, kGN, 2);
  const sc::AttentionOptions<double> opts;
  const M J = sc::attention_jacobian(in.X, in.WQ, in.WK, in.WV, opts);
  M G = M::Zero(J.rows(), J.rows());
  for (auto _ : state) {
    // Timed: the product only, not the assembly of J. Eigen's SYRK (rankUpdate) does half the
    // flops of the GEMM J * J^T, so the ratio printed below is conservative.
    G.setZero();
    G.selfadjointView<Eigen::Lower>().rankUpdate(J);
    benchmark::DoNotOptimize(G.data());
  }
  G.triangularView<Eigen::StrictlyUpper>() = G.transpose();
  const M Gs = sc::attention_gram(in.X, in.WQ, in.WK, in.WV, opts);
  g_gram_rel_diff = (Gs - G).cwiseAbs().maxCoeff() / G.cwiseAbs().maxCoeff();
}

}  // namespace

BENCHMARK(BM_AssembleJ)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_FillBuffer)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_MemcpyBuffer)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_GramStructured)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_GramFromJ)->Unit(benchmark::kMillisecond)->Iterations(1)->UseRealTime();

namespace {
/// The console table, plus the mean real and CPU time (seconds) of every benchmark.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> seconds, cpu_seconds;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration || r.error_occurred || r.iterations == 0) continue;
      const double n = static_cast<double>(r.iterations);
      seconds[r.run_name.function_name] = r.real_accumulated_time / n;
      cpu_seconds[r.run_name.function_name] = r.cpu_accumulated_time / n;
    }
    ConsoleReporter::ReportRuns(runs);
  }
};
}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  benchmark::Shutdown();
  // Ratios of real time and of CPU time (the second is steadier on a shared machine).
  auto ratio = [&rep](const char* a, const char* b, const char* what, const char* goal) {
    if (!rep.seconds.count(a) || !rep.seconds.count(b)) return;
    std::printf("%-24s = %7.2f real, %7.2f cpu  %s\n", what, rep.seconds[a] / rep.seconds[b],
                rep.cpu_seconds[a] / rep.cpu_seconds[b], goal);
  };
  std::printf("\n== MATH.md §3: Jacobian assembly at (N, D, d) = (128, 64, 64), 805 MB ==\n");
  ratio("BM_AssembleJ", "BM_FillBuffer", "assembly / std::fill", "(goal <= 2)");
  ratio("BM_AssembleJ", "BM_MemcpyBuffer", "assembly / memcpy", "");
  std::printf("== MATH.md §3: Gram without J at (64, 64, 64), G 4096 x 4096 ==\n");
  ratio("BM_GramFromJ", "BM_GramStructured", "(J J^T from J) / gram", "(goal >= 10)");
  if (g_gram_rel_diff >= 0)
    std::printf("max |G_structured - J J^T| / max |J J^T| = %.2e\n", g_gram_rel_diff);
  return 0;
}
