// spectral_cond::io: atomic file writes (POSIX).
//
// A writer never leaves a half-written file where a reader could find it: the bytes go to a
// temporary file in the target's directory (`path + ".tmp.XXXXXX"`, made by mkstemp), which is
// flushed, fsync'ed and renamed over the target. On any error the temporary file is removed
// and the target is left as it was; so it is when SIGINT, SIGTERM, SIGHUP or SIGQUIT ends the
// process, once install_signal_cleanup() (files.hpp) has run. The target must be absent or a
// regular file that is not an input (check_output_target, files.hpp): a symbolic link, a
// device node, a FIFO or a directory is never replaced.
#pragma once

#include "spectral_cond/io/error.hpp"
#include "spectral_cond/io/files.hpp"
#include "spectral_cond/io/paths.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace spectral_cond::io {

namespace detail {

inline std::string errno_str(int err) {
  return std::strerror(err);
}

/// Permissions for a new file: those of the existing target, else 0666 minus the umask (read
/// from /proc/self/status where it is available, so the process umask is never changed).
inline mode_t new_file_mode(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode))
    return static_cast<mode_t>(st.st_mode & 07777);
  mode_t mask = 022;
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "Umask:") {
      unsigned long value = 0;
      if (status >> std::oct >> value) mask = static_cast<mode_t>(value & 0777);
      break;
    }
    status.ignore(4096, '\n');
  }
  return static_cast<mode_t>(0666 & ~mask);
}

/// Removes the temporary file unless released; closes its stream.
class TempFile {
 public:
  explicit TempFile(const std::string& target) : target_(target) {
    // The name is registered for the signal handler before the file exists, so that no signal
    // can leave it behind; O_EXCL makes the name ours.
    static const char alphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::uint64_t state = static_cast<std::uint64_t>(::getpid()) * 0x9E3779B97F4A7C15ULL ^
                          reinterpret_cast<std::uintptr_t>(this) ^
                          static_cast<std::uint64_t>(std::clock());
    int fd = -1, err = 0;
    for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
      std::string name = target + ".tmp.";
      for (int k = 0; k < 6; ++k) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        name += alphabet[(state >> 33) % (sizeof(alphabet) - 1)];
      }
      slot_ = register_temp(name);
      fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      err = errno;
      if (fd >= 0) {
        path_ = name;
      } else {
        unregister_temp(slot_);
        slot_ = -1;
        if (err != EEXIST) break;
      }
    }
    if (fd < 0)
      throw IoError(target + ": cannot create a temporary file in " + parent_directory(target) +
                    ": " + errno_str(err));
    file_ = ::fdopen(fd, "wb");
    if (file_ == nullptr) {
      const int e = errno;
      ::close(fd);
      ::unlink(path_.c_str());
      unregister_temp(slot_);
      throw IoError(target + ": cannot open the temporary file " + path_ + ": " + errno_str(e));
    }
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (file_ != nullptr) std::fclose(file_);
    if (!committed_) ::unlink(path_.c_str());
    unregister_temp(slot_);
  }

  std::FILE* stream() const { return file_; }

  /// Flushes, fsyncs, closes and renames over the target; throws IoError on any failure.
  void commit() {
    errno = 0;
    if (std::fflush(file_) != 0 || std::ferror(file_) != 0) fail("write failed");
    if (::fchmod(::fileno(file_), new_file_mode(target_)) != 0) fail("cannot set permissions");
    if (::fsync(::fileno(file_)) != 0) fail("fsync failed");
    std::FILE* f = file_;
    file_ = nullptr;
    if (std::fclose(f) != 0) fail("close failed");
    check_output_target(target_);  // still replaceable (nothing became a link or an input)
    if (std::rename(path_.c_str(), target_.c_str()) != 0) fail("cannot rename the temporary file");
    committed_ = true;
    // Make the rename itself durable; a failure here cannot undo it, so it is not an error.
    const int dfd = ::open(parent_directory(target_).c_str(), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    const int err = errno;
    throw IoError(target_ + ": " + what + (err != 0 ? ": " + errno_str(err) : std::string()));
  }

  std::string target_, path_;
  std::FILE* file_ = nullptr;
  bool committed_ = false;
  int slot_ = -1;
};

}  // namespace detail

/// Writes `path` atomically. `write` fills the stream of a temporary file in the same directory
/// (it may throw; IoError is the expected type); the file is then flushed, fsync'ed and renamed
/// over `path`. On any error, including an exception from `write`, the temporary file is
/// removed, `path` is untouched and the exception propagates (IoError for I/O failures).
/// Refused (IoError, before anything is written) when `path` may not be replaced:
/// check_output_target (a link, a special file, a directory, an input file).
inline void atomic_write(const std::string& path, const std::function<void(std::FILE*)>& write) {
  check_output_target(path);
  detail::TempFile tmp(path);
  write(tmp.stream());
  tmp.commit();
}

/// Writes `size` bytes at `data` to `path` atomically (see atomic_write).
inline void atomic_write_bytes(const std::string& path, const void* data, std::size_t size) {
  atomic_write(path, [&](std::FILE* f) {
    if (size > 0 && std::fwrite(data, 1, size, f) != size)
      throw IoError(path + ": write failed: " + detail::errno_str(errno));
  });
}

}  // namespace spectral_cond::io
