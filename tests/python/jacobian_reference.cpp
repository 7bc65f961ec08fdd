// The library side of the CLI's bit-for-bit test (test_cli_jacobian.py): reads X, W_Q, W_K, W_V
// with io::read_npy, calls attention_jacobian or attention_gram directly, writes with
// io::write_npy. No CLI code is shared, so the test checks the tool's option handling
// (defaults, scale, mask, block, gram) and its output against the library itself.
//
//   sc_jacobian_reference X WQ WK WV SCALE|default none|causal all|q|k|v|x 0|1 OUT
#include <spectral_cond/io/formats/npy.hpp>
#include <spectral_cond/jacobian/gram.hpp>
#include <spectral_cond/jacobian/jacobian.hpp>

#include <cstdlib>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  using namespace spectral_cond;
  if (argc != 10) {
    std::cerr << "usage: sc_jacobian_reference X WQ WK WV SCALE|default MASK BLOCK GRAM OUT\n";
    return 2;
  }
  const Mat<double> X = io::read_npy(argv[1]).to_matrix();
  const Mat<double> WQ = io::read_npy(argv[2]).to_matrix();
  const Mat<double> WK = io::read_npy(argv[3]).to_matrix();
  const Mat<double> WV = io::read_npy(argv[4]).to_matrix();
  AttentionOptions<double> opts;
  if (std::string(argv[5]) != "default") opts.scale = std::strtod(argv[5], nullptr);
  opts.mask = std::string(argv[6]) == "causal" ? MaskKind::Causal : MaskKind::None;
  const std::string b = argv[7];
  const JacobianBlock block = b == "q"   ? JacobianBlock::Q
                              : b == "k" ? JacobianBlock::K
                              : b == "v" ? JacobianBlock::V
                              : b == "x" ? JacobianBlock::X
                                         : JacobianBlock::All;
  const Mat<double> out = std::string(argv[8]) == "1"
                              ? attention_gram(X, WQ, WK, WV, opts, block)
                              : attention_jacobian(X, WQ, WK, WV, opts, block);
  io::write_npy(argv[9], out);
  return 0;
}
