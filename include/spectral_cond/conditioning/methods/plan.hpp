// spectral_cond: which κ(J) method `auto` runs, as a pure function of the block's shape and the
// options (MATH.md §12, "auto"): the accurate methods (dense, matfree, lobpcg, qr) ranked by
// their estimated time, those whose estimated memory exceeds the budget left out, and the order
// in which the others are tried when the first declines. gram is never chosen: it squares J,
// and its ε κ² is an estimate, not a bound the method earns.
//
// The estimates count floating-point operations and bytes from the shapes alone, with two
// measured rates: dense factorisations of order thousands (Cholesky, QR, SVD) run near 25
// GFlop/s on one core of the reference machine, the small products of an iteration near 7
// GFlop/s (bench/python/bench_auto.py measures both and the choices they lead to). matfree's
// iteration count cannot be known in advance: 500, the upper part of what was measured on
// LayerNorm'd heads (111 to 533 iterations, N = 64 to 197; 343 to 729 at N = 768 to 1024).
#pragma once

#include "spectral_cond/conditioning/methods/options.hpp"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond {

/// The sizes that decide the plan: N tokens, width D, head widths d_k, d_v.
struct KappaShape {
  Index N = 0, D = 0, d_k = 0, d_v = 0;
  Index rows() const { return N * d_v; }
  Index cols() const { return D * (2 * d_k + d_v); }
  bool wide() const { return rows() <= cols(); }
};

/// One method's estimated cost.
struct MethodCost {
  JacobianKappaMethod method = JacobianKappaMethod::Auto;
  double flops = 0;     ///< floating-point operations, to the order of magnitude
  double seconds = 0;   ///< flops at the measured rates (one core)
  double bytes = 0;     ///< peak memory of the method's own arrays
  bool fits = false;    ///< bytes within the memory budget
  bool applies = true;  ///< false for matfree and lobpcg on a tall J (they decline it)
};

/// What `auto` runs: `order[0]` first, the others in turn while they decline.
struct KappaPlan {
  std::vector<MethodCost> order;     ///< the candidates, cheapest first (empty: nothing fits)
  std::vector<MethodCost> left_out;  ///< accurate methods over the memory budget
  std::string why;                   ///< the choice in words, for the result's note
};

namespace detail {

inline constexpr double kDenseRate = 25e9;  ///< flop/s of large dense factorisations
inline constexpr double kSmallRate = 7e9;   ///< flop/s of an iteration's small products
inline constexpr double kMatfreeIterations = 500;

/// Flops of one product with J and one with J^T (MATH.md §2) on compressed inputs of width r.
inline double product_flops(const KappaShape& s) {
  const double N = static_cast<double>(s.N), r = static_cast<double>(std::min(s.N, s.D));
  const double dk = static_cast<double>(s.d_k), dv = static_cast<double>(s.d_v);
  return 2 * (2 * N * r * (2 * dk + dv) + 4 * N * N * (dk + dv) + 3 * N * N);
}

}  // namespace detail

/// The estimated cost of an accurate method on a block of this shape (see the header).
inline MethodCost estimate_cost(JacobianKappaMethod m, const KappaShape& s,
                                const JacobianKappaOptions& jo) {
  const double rows = static_cast<double>(s.rows()), cols = static_cast<double>(s.cols());
  const double N = static_cast<double>(s.N), dv = static_cast<double>(s.d_v);
  const double r = static_cast<double>(std::min(s.N, s.D));
  const double reduced_cols = r * static_cast<double>(2 * s.d_k + s.d_v);
  MethodCost c;
  c.method = m;
  switch (m) {
    case JacobianKappaMethod::Dense: {  // J, then its SVD
      const double small = std::min(rows, cols), big = std::max(rows, cols);
      c.flops = 4 * small * small * big + rows * cols * N;
      c.bytes = 8 * (2 * rows * cols + 4 * small * small);
      c.seconds = c.flops / detail::kDenseRate;
      break;
    }
    case JacobianKappaMethod::Qr: {  // QR of the compressed J~ (rows x r (2 d_k + d_v))
      const double small = std::min(rows, reduced_cols), big = std::max(rows, reduced_cols);
      c.flops = 2 * small * small * big;
      // R, and one streamed block of J~'s columns (QrKappaOptions::block_cols: 128 MiB, clamped
      // to 256..4096 columns).
      const double block = std::clamp(16.0 * 1024 * 1024 / std::max(rows, 1.0), 256.0, 4096.0);
      c.bytes = 8 * (small * small + rows * std::min(block, reduced_cols));
      c.seconds = c.flops / detail::kDenseRate;
      break;
    }
    case JacobianKappaMethod::Lobpcg: {  // J J^T formed and factored, a few dozen iterations
      c.applies = s.wide();
      c.flops = rows * rows * rows / 3 + rows * rows * (N + static_cast<double>(s.d_k)) +
                50 * (8 * rows * rows + 4 * detail::product_flops(s));
      c.bytes = 8 * 2 * rows * rows;
      c.seconds = c.flops / detail::kDenseRate;
      break;
    }
    case JacobianKappaMethod::Matfree: {  // channel blocks, a coarse level, ~500 iterations
      c.applies = s.wide();
      // The coarse level: matfree_coarse modes plus S's null modes (at least N - r of them),
      // d_v channels each; its Galerkin matrix is formed, factored and inverted once.
      const double k = static_cast<double>(jo.matfree_coarse) + std::max(0.0, N - r);
      const double kd = k * dv;
      const double setup = dv * N * N * (r + static_cast<double>(s.d_k)) + dv * N * N * N +
                           (jo.matfree_coarse > 0 ? kd * kd * kd + kd * kd * N : 0.0);
      const double iteration = 2 * detail::product_flops(s) + 4 * dv * N * N + 4 * kd * kd;
      c.flops = setup + detail::kMatfreeIterations * iteration;
      c.seconds =
          setup / detail::kDenseRate + detail::kMatfreeIterations * iteration / detail::kSmallRate;
      // The coarse level is left out by matfree itself where it would not fit (matfree.hpp).
      c.bytes = 8 * (2 * dv * N * N + N * dv * r + 3 * N * N);
      const double coarse = jo.matfree_coarse > 0 ? 8 * 2 * kd * kd : 0.0;
      if (c.bytes + coarse <= static_cast<double>(jo.resolved_memory_budget())) c.bytes += coarse;
      break;
    }
    default:
      break;
  }
  c.fits = c.bytes <= static_cast<double>(jo.resolved_memory_budget());
  return c;
}

/// The plan of `auto` for this shape (see the header): dense while J has at most
/// jo.dense_max_entries entries (it is then the cheapest and the reference); otherwise matfree,
/// lobpcg and qr that apply and fit the memory budget, cheapest first. `available` restricts the
/// candidates to the methods a backend has (the GPU: matfree and qr; no dense there).
inline KappaPlan plan_kappa_jacobian(const KappaShape& s, const JacobianKappaOptions& jo,
                                     const std::vector<JacobianKappaMethod>& available = {
                                         JacobianKappaMethod::Dense, JacobianKappaMethod::Matfree,
                                         JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Qr}) {
  auto has = [&available](JacobianKappaMethod m) {
    return std::find(available.begin(), available.end(), m) != available.end();
  };
  KappaPlan p;
  std::ostringstream why;
  why.precision(3);
  const double entries = static_cast<double>(s.rows()) * static_cast<double>(s.cols());
  if (has(JacobianKappaMethod::Dense) && entries <= static_cast<double>(jo.dense_max_entries)) {
    const MethodCost c = estimate_cost(JacobianKappaMethod::Dense, s, jo);
    if (!c.fits) {
      p.left_out.push_back(c);
      why << "auto found no method within the memory budget of "
          << static_cast<double>(jo.resolved_memory_budget()) << " bytes: dense needs ~" << c.bytes;
      p.why = why.str();
      return p;
    }
    p.order.push_back(c);
    why << "auto chose dense: J has " << s.rows() * s.cols() << " <= " << jo.dense_max_entries
        << " entries";
    p.why = why.str();
    return p;
  }
  for (JacobianKappaMethod m :
       {JacobianKappaMethod::Matfree, JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Qr}) {
    if (!has(m)) continue;
    const MethodCost c = estimate_cost(m, s, jo);
    if (!c.applies) continue;
    (c.fits ? p.order : p.left_out).push_back(c);
  }
  std::stable_sort(p.order.begin(), p.order.end(),
                   [](const MethodCost& a, const MethodCost& b) { return a.seconds < b.seconds; });
  if (p.order.empty()) {
    why << "auto found no accurate method within the memory budget of "
        << static_cast<double>(jo.resolved_memory_budget()) << " bytes";
  } else {
    why << "auto chose " << to_string(p.order[0].method) << " by estimated time (";
    for (std::size_t i = 0; i < p.order.size(); ++i)
      why << (i ? ", " : "") << to_string(p.order[i].method) << " ~" << p.order[i].seconds << " s";
    why << ")";
  }
  for (const MethodCost& c : p.left_out)
    why << "; " << to_string(c.method) << " left out: ~" << c.bytes
        << " bytes exceed the memory budget of "
        << static_cast<double>(jo.resolved_memory_budget());
  if (!s.wide()) why << "; J is tall (N d_v > D (2 d_k + d_v)): qr shows its rank";
  p.why = why.str();
  return p;
}

}  // namespace spectral_cond
