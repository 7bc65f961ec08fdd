// spectral_cond::io: a read-only memory map of a whole file (POSIX), RAII and move-only.
#pragma once

#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/files.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

namespace spectral_cond {
namespace io {

/// A read-only byte range (C++17 stand-in for std::span<const std::uint8_t>).
struct ByteView {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
};

/// Read-only bytes of a file, mapped with mmap(PROT_READ, MAP_PRIVATE). Nothing is read until a
/// page is touched, so mapping a 10 GB shard costs address space, not memory. An empty file maps
/// to (nullptr, 0). Throws IoError naming the file when it cannot be opened, is not a regular
/// file (FIFOs, devices and directories are refused without blocking: files.hpp), or cannot be
/// mapped.
class MappedFile {
 public:
  MappedFile() = default;

  explicit MappedFile(const std::string& path) : path_(path) {
    struct stat st {};
    const int fd = open_input(path, st);  // regular files only; a FIFO never blocks
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        size_ = 0;
        fail("cannot mmap", e);
      }
      data_ = static_cast<const std::uint8_t*>(p);
    }
    ::close(fd);  // the mapping keeps the file alive
  }

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& o) noexcept
      : path_(std::move(o.path_)),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  MappedFile& operator=(MappedFile&& o) noexcept {
    if (this != &o) {
      unmap();
      path_ = std::move(o.path_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~MappedFile() { unmap(); }

  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const std::string& path() const { return path_; }
  ByteView view() const { return {data_, size_}; }

 private:
  [[noreturn]] void fail(const char* what, int err = errno) const {
    throw IoError(path_ + ": " + what + ": " + std::strerror(err));
  }
  void unmap() noexcept {
    if (data_ != nullptr) ::munmap(const_cast<std::uint8_t*>(data_), size_);
    data_ = nullptr;
    size_ = 0;
  }

  std::string path_;
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace io
}  // namespace spectral_cond
