// The C++ side of bench/python/bench_binding.py: kappa_jacobian on X, W_Q, W_K, W_V read from
// .npy files, timed as the best of `repeats` calls (the file reading is not timed), so that the
// Python binding's overhead on the same call can be measured against it.
//   kappa_jacobian_timing X.npy WQ.npy WK.npy WV.npy METHOD THREADS REPEATS
#include <spectral_cond/io/formats/npy.hpp>
#include <spectral_cond/spectral_cond.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  namespace sc = spectral_cond;
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s X.npy WQ.npy WK.npy WV.npy METHOD THREADS REPEATS\n", argv[0]);
    return 2;
  }
  const sc::Mat<double> X = sc::io::read_npy(argv[1]).to_matrix();
  const sc::Mat<double> WQ = sc::io::read_npy(argv[2]).to_matrix();
  const sc::Mat<double> WK = sc::io::read_npy(argv[3]).to_matrix();
  const sc::Mat<double> WV = sc::io::read_npy(argv[4]).to_matrix();
  sc::JacobianKappaOptions jo;
  jo.method = sc::parse_jacobian_kappa_method(argv[5]);
  jo.qr.threads = static_cast<unsigned>(std::stoul(argv[6]));
  const int repeats = std::atoi(argv[7]);
  const sc::AttentionOptions<double> opts;
  double best = 1e300, kappa = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const sc::ConditionResult<double> res = sc::kappa_jacobian<double>(X, WQ, WK, WV, opts, jo);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
    kappa = res.kappa;
  }
  std::printf("{\"seconds\": %.9f, \"kappa\": %.17g}\n", best, kappa);
  return 0;
}
