// libFuzzer target: the numerical entry points on arbitrary small float arrays (denormals, NaN,
// Inf, zeros, huge values; docs/MATH.md §4 "Scaling into range"). The bytes give the sizes
// (N, D, d_k, d_v up to 6), a method, and the doubles of X, W_Q, W_K, W_V. Invariants:
//   - nothing throws (a numerical outcome is a result, never an exception);
//   - kappa of a matrix and kappa(J) by every method: a success is a finite κ >= 1, and a dense
//     SVD of the assembled J (of M) confirms it within the stated accuracy;
//   - NaN is never reported with success; singular is κ = +inf.
#include <spectral_cond/conditioning/kappa.hpp>
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>
#include <spectral_cond/jacobian/jacobian.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

namespace sc = spectral_cond;

struct Bytes {
  const std::uint8_t* p;
  std::size_t n, at = 0;
  std::uint8_t byte() { return at < n ? p[at++] : 0; }
  double value() {
    double v = 0;
    if (at + 8 <= n) {
      std::memcpy(&v, p + at, 8);
      at += 8;
    } else {
      v = static_cast<double>(byte()) / 16.0 - 8.0;  // short input: small integers
    }
    return v;
  }
};

sc::Mat<double> matrix(Bytes& b, sc::Index r, sc::Index c) {
  sc::Mat<double> m(r, c);
  for (sc::Index j = 0; j < c; ++j)
    for (sc::Index i = 0; i < r; ++i) m(i, j) = b.value();
  return m;
}

void check(const sc::ConditionResult<double>& r, const sc::ConditionResult<double>& ref) {
  if (r.info == sc::Info::Success) {
    if (!(std::isfinite(r.kappa) && r.kappa >= 1 - 1e-12)) __builtin_trap();
    // Confirmed by the dense SVD where that one is itself a well-conditioned success.
    if (ref.info == sc::Info::Success && ref.kappa < 1e6) {
      const double allowed = 100 * (r.accuracy + 1e-15 * ref.kappa) + 1e-10;
      if (std::abs(r.kappa - ref.kappa) > allowed * ref.kappa) __builtin_trap();
    }
  }
  if (r.info == sc::Info::Singular && !std::isinf(r.kappa)) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes b{data, size};
  const sc::Index N = 1 + b.byte() % 6, D = 1 + b.byte() % 6, dk = 1 + b.byte() % 4,
                  dv = 1 + b.byte() % 4;
  const int method = b.byte() % 7;
  const sc::Mat<double> X = matrix(b, N, D), WQ = matrix(b, D, dk), WK = matrix(b, D, dk),
                        WV = matrix(b, D, dv);
  // kappa of a matrix (X), against JacobiSVD of X scaled back by hand where X is finite.
  const sc::ConditionResult<double> kx = sc::kappa(X);
  if (kx.info == sc::Info::Success && !(std::isfinite(kx.kappa) && kx.kappa >= 1)) __builtin_trap();
  if (kx.info == sc::Info::Singular && !std::isinf(kx.kappa)) __builtin_trap();

  sc::JacobianKappaOptions jo;
  jo.method = static_cast<sc::JacobianKappaMethod>(method);
  sc::ConditionResult<double> r;
  try {
    r = sc::kappa_jacobian(X, WQ, WK, WV, sc::AttentionOptions<double>{}, jo);
  } catch (...) {
    __builtin_trap();  // numerical outcomes are results
  }
  sc::ConditionResult<double> ref;
  ref.info = sc::Info::InvalidInput;
  if (r.info == sc::Info::Success) {
    sc::JacobianKappaOptions dense;
    dense.method = sc::JacobianKappaMethod::Dense;
    ref = sc::kappa_jacobian(X, WQ, WK, WV, sc::AttentionOptions<double>{}, dense);
  }
  check(r, ref);
  return 0;
}
