// spectral_cond::io: the rules every file the readers open and every file the writers replace
// obey (POSIX).
//
// Inputs: open_input() opens without blocking (a FIFO would otherwise wait forever for a
// writer), refuses anything that is not a regular file (FIFOs, devices, sockets, directories)
// and records the file's identity (device, inode) in a process-wide list.
// Outputs: check_output_target() refuses a target that exists and is not a regular file (a
// symbolic link, a directory, a device node, a FIFO), a target in a directory that does not
// exist, and a target that is the same file as any input opened so far or named by the caller
// (same path, a hard link or a symbolic link to it: compared by device and inode).
// Temporary files: registered while they exist, so that install_signal_cleanup()'s handler can
// remove them when a catchable signal ends the process (install_signal_cleanup names them).
#pragma once

#include <spectral_cond/io/error.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace spectral_cond {
namespace io {

/// What a file that is not a regular file is, for messages: "a directory", "a FIFO", "a
/// character device", "a block device", "a socket", "a symbolic link" (for lstat's mode), else
/// "not a regular file". `m` is the st_mode of stat or lstat.
inline const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "not a regular file";
}

namespace detail {

using io::file_kind;  // the readers' name for it

struct FileId {
  dev_t dev;
  ino_t ino;
};

/// Whether check_output_target also refuses every input opened so far (protect_inputs()).
inline std::atomic<bool>& inputs_protected() {
  static std::atomic<bool> on{false};
  return on;
}

/// Identities of every input opened by open_input (or registered by note_input).
inline std::vector<FileId>& input_ids() {
  static std::vector<FileId> ids;
  return ids;
}
inline std::mutex& input_ids_mutex() {
  static std::mutex m;
  return m;
}

/// Temporary files to remove on a fatal signal: fixed slots, written before they are used, so
/// that the handler reads them without locks or allocation (async-signal-safe).
inline constexpr int kTempSlots = 16;
inline constexpr std::size_t kTempPathMax = 4096;
struct TempSlot {
  std::atomic<int> used{0};
  char path[kTempPathMax];
};
inline TempSlot* temp_slots() {
  static TempSlot slots[kTempSlots];
  return slots;
}

/// Registers `path`; returns its slot, or -1 when it is too long or every slot is taken (the
/// file is then removed on errors and exceptions, but not on signals).
inline int register_temp(const std::string& path) {
  if (path.size() + 1 > kTempPathMax) return -1;
  TempSlot* s = temp_slots();
  for (int i = 0; i < kTempSlots; ++i) {
    int expected = 0;
    if (s[i].used.load() == 0 && s[i].used.compare_exchange_strong(expected, 2)) {
      std::memcpy(s[i].path, path.c_str(), path.size() + 1);
      s[i].used.store(1);  // complete: the handler may use it
      return i;
    }
  }
  return -1;
}
inline void unregister_temp(int slot) {
  if (slot >= 0 && slot < kTempSlots) temp_slots()[slot].used.store(0);
}

extern "C" inline void remove_temps_and_reraise(int sig) {
  TempSlot* s = temp_slots();
  for (int i = 0; i < kTempSlots; ++i)
    if (s[i].used.load() == 1) ::unlink(s[i].path);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace detail

/// Removes registered temporary files when a signal whose default action ends the process
/// arrives (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGXFSZ, SIGXCPU, SIGALRM, SIGVTALRM,
/// SIGPROF, SIGUSR1, SIGUSR2), then lets the signal end the process as it would have. Call once,
/// early in main(). (SIGKILL cannot be caught: on Linux atomic writes use unnamed temporary
/// files, atomic_file.hpp, which it cannot leave behind.)
inline void install_signal_cleanup() {
  struct sigaction sa {};
  sa.sa_handler = detail::remove_temps_and_reraise;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGXFSZ, SIGXCPU, SIGALRM, SIGVTALRM,
                  SIGPROF, SIGUSR1, SIGUSR2})
    ::sigaction(sig, &sa, nullptr);
}

/// From now on, check_output_target refuses to write over any input this process has opened
/// (by device and inode: the same file, a hard link or a symbolic link to it). The tool turns
/// this on in main(); a library user who reads and writes the same file on purpose leaves it off.
inline void protect_inputs(bool on = true) {
  detail::inputs_protected().store(on);
}

/// Records `st`'s file as an input (refused as an output once protect_inputs() is on).
inline void note_input(const struct stat& st) {
  std::lock_guard<std::mutex> lock(detail::input_ids_mutex());
  for (const auto& id : detail::input_ids())
    if (id.dev == st.st_dev && id.ino == st.st_ino) return;
  detail::input_ids().push_back({st.st_dev, st.st_ino});
}

/// Records the file at `path` as an input when it exists (following symbolic links).
inline void note_input(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) note_input(st);
}

/// Opens `path` read-only without blocking, checks that it is a regular file and records it as
/// an input. Returns the descriptor (blocking mode restored) and fills `st`. Throws IoError
/// "<path>: ..." naming what the file is when it is not a regular file.
inline int open_input(const std::string& path, struct stat& st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    throw IoError(path + ": cannot open: " + std::strerror(e));
  }
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw IoError(path + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(path + ": " + detail::file_kind(st.st_mode) + ", not a regular file");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  note_input(st);
  return fd;
}

/// Throws IoError("<out>: ...") unless `out` may be written by replacing it: it does not exist
/// (and its directory does) or it is a regular file that is neither one of `inputs` nor, once
/// protect_inputs() is on, an input opened so far (compared by device and inode, so hard and
/// symbolic links count).
inline void check_output_target(const std::string& out,
                                const std::vector<std::string>& inputs = {}) {
  if (out.empty()) throw IoError("(empty path): cannot write a file with an empty name");
  for (const std::string& in : inputs)
    if (in == out) throw IoError(out + ": refusing to overwrite an input file");
  struct stat st {};
  if (::lstat(out.c_str(), &st) != 0) {
    if (errno != ENOENT) {
      const int e = errno;
      throw IoError(out + ": cannot use as output: " + std::strerror(e));
    }
    const auto slash = out.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "."
                            : slash == 0               ? "/"
                                                       : out.substr(0, slash);
    struct stat ds {};
    if (::stat(dir.c_str(), &ds) != 0 || !S_ISDIR(ds.st_mode))
      throw IoError(out + ": cannot write: the directory " + dir + " does not exist");
    return;
  }
  if (!S_ISREG(st.st_mode))
    throw IoError(out + ": is " + std::string(detail::file_kind(st.st_mode)) +
                  "; outputs replace only regular files (remove it or choose another name)");
  for (const std::string& in : inputs) {
    struct stat is {};
    if (::stat(in.c_str(), &is) == 0 && is.st_dev == st.st_dev && is.st_ino == st.st_ino)
      throw IoError(out + ": refusing to overwrite an input file (" + in + ")");
  }
  if (!detail::inputs_protected().load()) return;
  std::lock_guard<std::mutex> lock(detail::input_ids_mutex());
  for (const auto& id : detail::input_ids())
    if (id.dev == st.st_dev && id.ino == st.st_ino)
      throw IoError(out + ": refusing to overwrite an input file (the same file, or a link to it)");
}

}  // namespace io
}  // namespace spectral_cond
