// spectral_cond::io: the one exception type of the checkpoint readers and writers.
#pragma once

#include <stdexcept>

namespace spectral_cond {
namespace io {

/// A file could not be read or written, or its contents are malformed. The message is one line
/// and names the file (and the tensor or member, where one is concerned).
struct IoError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace io
}  // namespace spectral_cond
