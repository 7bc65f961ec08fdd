// The λ advisor's cost (MATH.md §17, issue "Choosing λ"): advise_head on a grid of 8 λ x 3
// placements (fused, per_head, packed) against 24 independent kappa_jacobian calls on the same
// 24 corrected weight triples, on one head of a ViT-B-shaped layer (N = 197, D = 768, d = 64,
// head 5 of 12; LayerNorm'd tokens, W ~ N(0, 0.02²), the initialisation of ViT-B). The target is
// a ratio of at most 0.5; both sides run in this process, one after the other, with the same
// BLAS threads (OPENBLAS_NUM_THREADS, 1 unless set).
//   bench_advisor                 the ViT-B shape (minutes)
//   bench_advisor --small         N = 65, D = 192, d = 16 (seconds), to check the program
//   ... --detail                  also every point: method, iterations, seconds, κ(J) both ways
#include <spectral_cond/conditioning/advisor.hpp>
#include <spectral_cond/core/random.hpp>

#include "bench_common.hpp"

#include <cstdio>
#include <cstring>
#include <vector>

using namespace spectral_cond;

namespace {

struct Shape {
  Index N = 197, D = 768, d = 64, heads = 12, head = 5;
};

struct Instance {
  Mat<double> X, WQ, WK, WV;
};

Instance make(const Shape& s) {
  Rng rng(2025);  // MATH.md §16
  Instance in;
  in.X.resize(s.N, s.D);
  for (Index i = 0; i < in.X.size(); ++i) in.X.data()[i] = rng.normal();
  for (Index i = 0; i < s.N; ++i) {
    in.X.row(i).array() -= in.X.row(i).mean();
    in.X.row(i) /= std::sqrt(in.X.row(i).squaredNorm() / static_cast<double>(s.D));
  }
  for (Mat<double>* W : {&in.WQ, &in.WK, &in.WV}) {
    W->resize(s.D, s.d);
    for (Index i = 0; i < W->size(); ++i) W->data()[i] = 0.02 * rng.normal();
  }
  return in;
}

AdviceOptions grid() {
  AdviceOptions o;
  o.lambdas = {0, 0.25, 0.5, 1, 2, 3, 5, 10};
  o.placements = {parse_placement("fused"), parse_placement("per_head"), parse_placement("packed")};
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  if (argc > 1 && std::strcmp(argv[1], "--small") == 0) s = Shape{65, 192, 16, 12, 5};
  const Instance in = make(s);
  const AdviceOptions o = grid();
  const HeadPosition pos{s.head, s.heads, 0};
  const AttentionOptions<double> ao;

  // The advisor on the whole grid.
  auto t0 = sc_bench::Clock::now();
  const HeadAdvice a = advise_head(in.X, in.WQ, in.WK, in.WV, ao, pos, o);
  const double t_grid = sc_bench::since(t0);

  // 24 independent κ(J) calls on the same corrected weights.
  t0 = sc_bench::Clock::now();
  std::size_t calls = 0;
  std::vector<ConditionResult<double>> independent;
  for (const CorrectionPlacement& p : o.placements)
    for (const double l : o.lambdas) {
      const auto w = corrected_head_weights(in.WQ, in.WK, in.WV, p, pos, l);
      const ConditionResult<double> r = kappa_jacobian<double>(in.X, w[0], w[1], w[2], ao);
      benchmark::DoNotOptimize(r.kappa);
      independent.push_back(r);
      ++calls;
    }
  const double t_calls = sc_bench::since(t0);

  // The diagnostics and the bound without hypothesis alone, on the grid's distinct points.
  t0 = sc_bench::Clock::now();
  for (const CorrectionPlacement& p : o.placements)
    for (const double l : o.lambdas) {
      const auto w = corrected_head_weights(in.WQ, in.WK, in.WV, p, pos, l);
      const Mat<double> P = attention_forward(in.X, w[0], w[1], w[2], ao).P;
      benchmark::DoNotOptimize(attention_diagnostics(in.X, w[0], w[1], w[2], ao, P).norms);
      benchmark::DoNotOptimize(hypothesis_free_bound(in.X, w[0], w[1], w[2], ao, P).bound);
    }
  const double t_diag = sc_bench::since(t0);

  if (argc > 2 && std::strcmp(argv[2], "--detail") == 0)
    for (std::size_t i = 0; i < a.points.size(); ++i) {
      const AdvicePoint& p = a.points[i];
      const ConditionResult<double>& r = independent[i];
      std::printf(
          "  %-9s %5.2f  grid: %-8.8s it %4lld %7.3f s kappa %.6g | alone: %-8.8s it %4lld "
          "kappa %.6g\n",
          p.placement.c_str(), p.lambda, p.J.method.c_str(), static_cast<long long>(p.J.iterations),
          p.seconds, p.J.kappa, r.method.c_str(), static_cast<long long>(r.iterations), r.kappa);
    }

  std::size_t computed = 0;
  for (const AdvicePoint& p : a.points) computed += p.same_as < 0 ? 1 : 0;
  std::printf(
      "advisor: head %lld of a (N %lld, D %lld, d %lld) layer, %zu grid points (%zu "
      "computed)\n",
      static_cast<long long>(s.head), static_cast<long long>(s.N), static_cast<long long>(s.D),
      static_cast<long long>(s.d), a.points.size(), computed);
  std::printf("  advise_head, whole grid      %9.2f s\n", t_grid);
  std::printf("  %zu independent kappa(J) calls %9.2f s\n", calls, t_calls);
  std::printf("  of which diagnostics + bound  %9.2f s (timed alone, all 24 points)\n", t_diag);
  std::printf("  ratio grid / calls           %9.3f (target <= 0.5)\n", t_grid / t_calls);
  std::printf("  recommendation: %s\n", a.best.reason.c_str());
  return 0;
}
