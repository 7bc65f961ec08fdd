// The attention core on a built-in default: a seeded layer, its output, and its gradients
// checked against central finite differences and the adjoint identity (MATH.md §2).
#include <spectral_cond/spectral_cond.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace sc = spectral_cond;
using M = sc::Mat<double>;

int main() {
  const sc::Index N = 8, D = 16, dk = 4, dv = 4;
  sc::Rng rng(42);  // the library's portable generator: the same numbers with any compiler
  const M X = rng.normal_matrix(N, D);
  const double ws = 1.0 / std::sqrt(static_cast<double>(D));
  const M WQ = rng.normal_matrix(D, dk, ws), WK = rng.normal_matrix(D, dk, ws),
          WV = rng.normal_matrix(D, dv, ws);
  sc::AttentionOptions<double> opts;
  opts.mask = sc::MaskKind::Causal;
  const auto cache = sc::attention_forward(X, WQ, WK, WV, opts);
  std::printf(
      "spectral_cond attention demo: N=%ld D=%ld d_k=%ld d_v=%ld, c=1/sqrt(d_k)=%.4f, causal\n",
      static_cast<long>(N), static_cast<long>(D), static_cast<long>(dk), static_cast<long>(dv),
      cache.scale);
  std::printf("output A (first 3 rows):\n");
  for (sc::Index i = 0; i < 3; ++i) {
    for (sc::Index j = 0; j < dv; ++j) std::printf("  % .6f", cache.A(i, j));
    std::printf("\n");
  }
  const M G = rng.normal_matrix(N, dv);
  const auto g = sc::attention_vjp<double>(X, WQ, WK, WV, cache, G);
  const sc::AttentionTangents<double> t{rng.normal_matrix(D, dk), rng.normal_matrix(D, dk),
                                        rng.normal_matrix(D, dv), rng.normal_matrix(N, D)};
  const M jvp = sc::attention_jvp<double>(X, WQ, WK, WV, cache, t);
  const char* names[4] = {"W_Q", "W_K", "W_V", "X"};
  const M* tans[4] = {&t.dWQ, &t.dWK, &t.dWV, &t.dX};
  const M* grads[4] = {&g.dWQ, &g.dWK, &g.dWV, &g.dX};
  bool ok = true;
  std::printf("gradient checks (VJP vs central differences of <G, A>):\n");
  for (int w = 0; w < 4; ++w) {
    auto f = [&](double s) {
      const M Xs = w == 3 ? M(X + s * *tans[3]) : X;
      const M Q = w == 0 ? M(WQ + s * *tans[0]) : WQ, K = w == 1 ? M(WK + s * *tans[1]) : WK;
      const M V = w == 2 ? M(WV + s * *tans[2]) : WV;
      return (sc::attention(Xs, Q, K, V, opts).array() * G.array()).sum();
    };
    const double h = 1e-5, fd = (f(h) - f(-h)) / (2 * h);
    const double an = (grads[w]->array() * tans[w]->array()).sum();
    const double rel = std::abs(fd - an) / std::max(std::abs(an), 1e-300);
    ok = ok && rel < 1e-6;
    std::printf("  dL/d%-3s  analytic % .10e  finite-diff % .10e  rel.err %.1e\n", names[w], an, fd,
                rel);
  }
  double rhs = 0;
  for (int w = 0; w < 4; ++w) rhs += (grads[w]->array() * tans[w]->array()).sum();
  const double lhs = (jvp.array() * G.array()).sum();
  const double adj = std::abs(lhs - rhs) / std::abs(lhs);
  ok = ok && adj < 1e-12;
  std::printf("adjoint identity <JVP(v), G> = <v, VJP(G)>: %.15e vs %.15e (rel %.1e)\n", lhs, rhs,
              adj);
  std::printf("%s\n", ok ? "all checks passed" : "CHECK FAILED");
  return ok ? 0 : 1;
}
