// Builds against the installed package: find_package(spectral_cond CONFIG REQUIRED).
#include <spectral_cond/spectral_cond.hpp>

#include <iostream>

int main() {
  using M = Eigen::MatrixXd;
  const M X = M::Random(5, 4), WQ = M::Random(4, 3), WK = M::Random(4, 3), WV = M::Random(4, 2);
  const M A = spectral_cond::attention(X, WQ, WK, WV);
  const bool ok = A.rows() == 5 && A.cols() == 2 && A.allFinite();
  std::cout << "consumer: A is " << A.rows() << " x " << A.cols() << (ok ? ", ok\n" : ", BAD\n");
  return ok ? 0 : 1;
}
