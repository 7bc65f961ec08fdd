// spectral_cond::io: atomic file writes (POSIX).
//
// A writer never leaves a half-written file where a reader could find it: the bytes go to a
// temporary file in the target's directory, which is flushed, fsync'ed and put in place of the
// target in one step. On Linux that file has no name until then (O_TMPFILE, then linkat), so
// that nothing, not even SIGKILL, leaves a partial file behind; elsewhere it is
// `path + ".tmp.XXXXXX"`, removed on any error and, once install_signal_cleanup() (files.hpp)
// has run, on every catchable signal that ends the process. The target is left as it was on
// any failure. The target must be absent or a
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

/// A name beside `target` that no file has: `target + ".tmp.XXXXXX"`, created (O_EXCL) and
/// registered for the signal handler before it exists, so that no signal can leave it behind.
/// Returns the open descriptor; `name` and `slot` receive the name and the signal slot.
inline int create_named_temp(const std::string& target, const void* salt, std::string& name,
                             int& slot) {
  static const char alphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::uint64_t state = static_cast<std::uint64_t>(::getpid()) * 0x9E3779B97F4A7C15ULL ^
                        reinterpret_cast<std::uintptr_t>(salt) ^
                        static_cast<std::uint64_t>(std::clock());
  int fd = -1, err = 0;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    std::string candidate = target + ".tmp.";
    for (int k = 0; k < 6; ++k) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      candidate += alphabet[(state >> 33) % (sizeof(alphabet) - 1)];
    }
    slot = register_temp(candidate);
    fd = ::open(candidate.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    err = errno;
    if (fd >= 0) {
      name = candidate;
    } else {
      unregister_temp(slot);
      slot = -1;
      if (err != EEXIST) break;
    }
  }
  if (fd < 0)
    throw IoError(target + ": cannot create a temporary file in " + parent_directory(target) +
                  ": " + errno_str(err));
  return fd;
}

/// The temporary file of one atomic write; removed unless committed; closes its stream.
///
/// On Linux it is an unnamed file (open with O_TMPFILE in the target's directory): it has no
/// name until commit() links it in, so that nothing whatever ends the process (SIGKILL, a
/// file-size limit, a power cut) can leave a partial file behind. Where the file system has no
/// O_TMPFILE it is a named file beside the target, removed on errors, on exceptions and on the
/// catchable signals (install_signal_cleanup, files.hpp).
class TempFile {
 public:
  explicit TempFile(const std::string& target) : target_(target) {
    int fd = -1;
#ifdef O_TMPFILE
    fd = ::open(parent_directory(target).c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
#endif
    if (fd < 0) fd = create_named_temp(target, this, path_, slot_);
    file_ = ::fdopen(fd, "wb");
    if (file_ == nullptr) {
      const int e = errno;
      ::close(fd);
      discard();
      throw IoError(target + ": cannot open a temporary file in " + parent_directory(target) +
                    ": " + errno_str(e));
    }
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (file_ != nullptr) std::fclose(file_);
    if (!committed_) discard();
  }

  std::FILE* stream() const {
    return file_;
  }

  /// Flushes, fsyncs and puts the file in place of the target; throws IoError on any failure.
  void commit() {
    errno = 0;
    if (std::fflush(file_) != 0 || std::ferror(file_) != 0) fail("write failed");
    const int fd = ::fileno(file_);
    if (::fchmod(fd, new_file_mode(target_)) != 0) fail("cannot set permissions");
    if (::fsync(fd) != 0) fail("fsync failed");
    check_output_target(target_);  // still replaceable (nothing became a link or an input)
    if (path_.empty()) link_unnamed(fd);
    std::FILE* f = file_;
    file_ = nullptr;
    if (std::fclose(f) != 0) fail("close failed");
    if (!path_.empty() && std::rename(path_.c_str(), target_.c_str()) != 0)
      fail("cannot rename the temporary file");
    committed_ = true;
    discard();  // the signal slot (the file is the target now)
    // Make the link or rename itself durable; a failure here cannot undo it, so no error.
    const int dfd = ::open(parent_directory(target_).c_str(), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  /// Gives the unnamed file a name: the target itself where there is none yet (one atomic
  /// link), else a temporary name that commit() renames over the target. Where the link is not
  /// possible (no /proc), the bytes are copied into a named temporary file.
  void link_unnamed(int fd) {
    const std::string proc = "/proc/self/fd/" + std::to_string(fd);
    auto link_to = [&](const std::string& name) {
      return ::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, name.c_str(), AT_SYMLINK_FOLLOW) == 0;
    };
    if (link_to(target_)) return;
    if (errno == EEXIST) {
      // A name of ours, made by create_named_temp and replaced by the link (the empty file is
      // removed first: linkat never replaces).
      const int tfd = create_named_temp(target_, this, path_, slot_);
      ::close(tfd);
      if (::unlink(path_.c_str()) == 0 && link_to(path_)) return;
      if (::access(path_.c_str(), F_OK) != 0) {
        discard();
        path_.clear();
      }
    }
    // No link possible: copy the bytes into a named temporary file.
    const int tfd = path_.empty() ? create_named_temp(target_, this, path_, slot_)
                                  : ::open(path_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
    if (tfd < 0) fail("cannot open the temporary file");
    std::vector<char> buf(1 << 16);
    off_t at = 0;
    for (;;) {
      const ssize_t got = ::pread(fd, buf.data(), buf.size(), at);
      if (got < 0) {
        ::close(tfd);
        fail("cannot read back the temporary file");
      }
      if (got == 0) break;
      for (ssize_t put = 0; put < got;) {
        const ssize_t w = ::write(tfd, buf.data() + put, static_cast<std::size_t>(got - put));
        if (w < 0) {
          ::close(tfd);
          fail("write failed");
        }
        put += w;
      }
      at += got;
    }
    const bool ok = ::fchmod(tfd, new_file_mode(target_)) == 0 && ::fsync(tfd) == 0;
    if (::close(tfd) != 0 || !ok) fail("cannot write the temporary file");
  }

  /// Removes the named temporary file (if any, and not yet renamed) and frees its signal slot.
  void discard() {
    if (!committed_ && !path_.empty()) ::unlink(path_.c_str());
    unregister_temp(slot_);
    slot_ = -1;
  }

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
