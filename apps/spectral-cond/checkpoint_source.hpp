// spectral-cond: one read-only view over the three checkpoint formats the tool accepts
// (docs/checkpoints.md):
//
//   safetensors  a .safetensors file, a sharded *.safetensors.index.json, or a directory holding
//                one of them (io::Checkpoint). Shards are mapped on first use only.
//   npz          a NumPy .npz archive (numpy.savez or savez_compressed); array name = tensor name.
//   npy-dir      a directory of .npy files; file name without ".npy" = tensor name.
//
// A source lists every tensor's name, and the shape and dtype of those that layout detection may
// look at (attention_candidate()); it hands out one tensor at a time as a double matrix, checked
// finite, so that a command holds only the tensors of the layer it is working on. Every error
// names the file and the tensor (exit code 2).
#pragma once

#include "cli.hpp"

#include <spectral_cond/io/layouts.hpp>
#include <spectral_cond/io/npy.hpp>
#include <spectral_cond/io/npz.hpp>
#include <spectral_cond/io/safetensors.hpp>

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace spectral_cond::cli {

enum class SourceKind { Safetensors, Npz, NpyDir };

inline const char* to_string(SourceKind k) {
  switch (k) {
    case SourceKind::Safetensors:
      return "safetensors";
    case SourceKind::Npz:
      return "npz";
    case SourceKind::NpyDir:
      return "npy-dir";
  }
  return "unknown";
}

/// True for the names a layout of io::detect_layers can match (MATH.md §8): only these tensors'
/// shapes are needed to find the attention layers, so only their shards are opened.
inline bool attention_candidate(const std::string& name) {
  static const char* suffixes[] = {"qkv.weight",    "in_proj_weight", "c_attn.weight",
                                   "query.weight",  "key.weight",     "value.weight",
                                   "q_proj.weight", "k_proj.weight",  "v_proj.weight"};
  for (const char* s : suffixes)
    if (io::detail::ends_with(name, s)) return true;
  return false;
}

/// Maps a .npy descr to the safetensors dtype a corrected tensor is written back in.
inline io::Dtype dtype_of_descr(const std::string& descr) {
  if (descr == "<f2") return io::Dtype::F16;
  if (descr == "<f4") return io::Dtype::F32;
  return io::Dtype::F64;
}

namespace detail_src {

/// The header of a .npy file held in memory (checked exactly as parse_npy checks it).
inline io::detail::NpyHeader npy_header(const std::uint8_t* data, std::size_t size,
                                        const std::string& name) {
  const io::detail::NpyPreamble pre = io::detail::parse_npy_preamble(data, size, name);
  io::detail::NpyHeader h =
      io::detail::NpyHeaderParser(reinterpret_cast<const char*>(data) + pre.header_offset,
                                  pre.header_len, name)
          .parse();
  io::detail::check_npy_data_size(h, size - pre.header_offset - pre.header_len, name);
  return h;
}

}  // namespace detail_src

/// A checkpoint in any of the accepted formats (see the top of this file).
class CheckpointSource {
 public:
  explicit CheckpointSource(const std::string& path) : path_(path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw BadInput(path + ": cannot open: no such file");
    if (S_ISDIR(st.st_mode) && has_npy_files(path)) {
      open_npy_dir(path);
    } else if (!S_ISDIR(st.st_mode) && io::detail::ends_with(path, ".npz")) {
      open_npz(path);
    } else {
      kind_ = SourceKind::Safetensors;
      ckpt_ = std::make_unique<io::Checkpoint>(path);
      for (const std::string& n : ckpt_->names()) names_.push_back(n);
    }
  }

  SourceKind kind() const { return kind_; }
  /// The path as given on the command line.
  const std::string& path() const { return path_; }
  /// The directory a config.json is looked for in.
  std::string directory() const {
    if (kind_ == SourceKind::NpyDir) return path_;
    if (kind_ == SourceKind::Safetensors) return io::detail::dir_of(ckpt_->path());
    return io::detail::dir_of(path_);
  }
  /// The safetensors checkpoint, or nullptr for npz / npy-dir sources.
  const io::Checkpoint* checkpoint() const { return ckpt_.get(); }

  /// Every tensor name, sorted.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const {
    return std::binary_search(names_.begin(), names_.end(), name);
  }

  /// Names and shapes for io::detect_layers: the shape of every attention_candidate() tensor,
  /// an empty shape for the others (never looked at, and their shards are not opened).
  std::vector<io::NamedShape> layout_view() const {
    std::vector<io::NamedShape> out;
    for (const std::string& n : names_) {
      io::NamedShape s;
      s.name = n;
      if (attention_candidate(n)) s.shape = shape(n);
      out.push_back(std::move(s));
    }
    return out;
  }

  std::vector<std::int64_t> shape(const std::string& name) const {
    if (ckpt_) return ckpt_->info(name).shape;
    return entry(name).shape;
  }

  /// The dtype a corrected tensor is written back in.
  io::Dtype dtype(const std::string& name) const {
    if (ckpt_) return ckpt_->info(name).dtype;
    return dtype_of_descr(entry(name).descr);
  }

  /// The file that holds `name` (for messages): the shard, the .npz or the .npy file.
  std::string file_of(const std::string& name) const {
    if (ckpt_) return ckpt_->shard_for(name).path();
    if (kind_ == SourceKind::Npz) return path_;
    return entry(name).file;
  }

  /// The 2-D tensor `name` as a double matrix (entry (i, j) = T[i, j]). Throws BadInput naming
  /// the file and tensor when it is not 2-D, not floating point, or holds NaN or Inf.
  Mat<double> matrix(const std::string& name) const {
    Mat<double> m;
    if (ckpt_) {
      const io::TensorInfo& t = ckpt_->info(name);
      if (t.shape.size() != 2)
        throw BadInput(file_of(name) + ": tensor " + io::detail::quote(name) + " has shape " +
                       io::detail::shape_string(t.shape) + ", expected a 2-D matrix");
      m = ckpt_->matrix<double>(name);
    } else {
      const io::NpyArray a = array(name);
      if (a.ndim() != 2)
        throw BadInput(file_of(name) + ": tensor " + io::detail::quote(name) + " has shape " +
                       a.shape_string() + ", expected a 2-D matrix");
      m = a.to_matrix();
    }
    for (Index j = 0; j < m.cols(); ++j)
      for (Index i = 0; i < m.rows(); ++i)
        if (!std::isfinite(m(i, j)))
          throw BadInput(file_of(name) + ": tensor " + io::detail::quote(name) +
                         " has a NaN or Inf entry at [" + std::to_string(i) + ", " +
                         std::to_string(j) + "]");
    return m;
  }

  /// An npz / npy-dir tensor of any rank (not for safetensors sources, which copy bytes).
  io::NpyArray array(const std::string& name) const {
    if (kind_ == SourceKind::Npz) return npz_->array(name);
    const Entry& e = entry(name);
    const io::MappedFile f(e.file);
    return io::parse_npy(f.data(), f.size(), e.file);
  }

 private:
  struct Entry {
    std::vector<std::int64_t> shape;
    std::string descr;
    std::string file;
  };

  static bool has_npy_files(const std::string& dir) {
    bool found = false;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d))
        if (io::detail::ends_with(e->d_name, ".npy")) found = true;
      ::closedir(d);
    }
    return found;
  }

  const Entry& entry(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) throw BadInput(path_ + ": no tensor " + io::detail::quote(name));
    return it->second;
  }

  void open_npy_dir(const std::string& dir) {
    kind_ = SourceKind::NpyDir;
    std::vector<std::string> files;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string n = e->d_name;
        if (io::detail::ends_with(n, ".npy") && n.size() > 4) files.push_back(n);
      }
      ::closedir(d);
    }
    std::sort(files.begin(), files.end());
    for (const std::string& f : files) {
      const std::string p = io::detail::join_path(dir, f);
      const io::MappedFile m(p);
      const io::detail::NpyHeader h = detail_src::npy_header(m.data(), m.size(), p);
      const std::string name = f.substr(0, f.size() - 4);
      entries_[name] = Entry{h.shape, h.descr, p};
      names_.push_back(name);
    }
  }

  void open_npz(const std::string& p) {
    kind_ = SourceKind::Npz;
    npz_ = std::make_unique<io::NpzFile>(p);
    for (const io::NpzMember& m : npz_->members()) {
      const std::string name = m.name.substr(0, m.name.size() - 4);
      // Only the member's header is read (and, compressed, inflated): never its data.
      const io::detail::NpyHeader h = npz_->header(name);
      entries_[name] = Entry{h.shape, h.descr, p};
      names_.push_back(name);
    }
    std::sort(names_.begin(), names_.end());
  }

  std::string path_;
  SourceKind kind_ = SourceKind::Safetensors;
  std::unique_ptr<io::Checkpoint> ckpt_;
  std::unique_ptr<io::NpzFile> npz_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> names_;
};

/// The numbers of a --layers or --jacobian-heads value ("0,3,5-7"), kept as ranges: a range
/// is never expanded, so "0-50000000" costs two numbers, and it is checked against what exists
/// before any loop over it (require_within).
class IndexSelection {
 public:
  IndexSelection() = default;

  /// Parses `spec` (empty: everything); `flag` names the option in messages. Throws BadInput.
  static IndexSelection parse(const std::string& spec, const std::string& flag) {
    IndexSelection out;
    out.flag_ = flag;
    if (spec.empty()) return out;
    auto number = [&](const std::string& s) -> std::int64_t {
      if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos)
        throw BadInput(flag + ": '" + spec + "' is not a list like 0,3,5-7");
      return std::stoll(s);
    };
    std::size_t start = 0;
    while (start <= spec.size()) {
      const std::size_t comma = std::min(spec.find(',', start), spec.size());
      const std::string part = spec.substr(start, comma - start);
      const std::size_t dash = part.find('-');
      if (dash == std::string::npos) {
        const std::int64_t a = number(part);
        out.ranges_.push_back({a, a});
      } else {
        const std::int64_t a = number(part.substr(0, dash)), b = number(part.substr(dash + 1));
        if (b < a) throw BadInput(flag + ": range '" + part + "' is decreasing");
        out.ranges_.push_back({a, b});
      }
      start = comma + 1;
    }
    return out;
  }

  bool empty() const { return ranges_.empty(); }
  /// True when `i` is selected (always, for an empty selection).
  bool contains(std::int64_t i) const {
    if (ranges_.empty()) return true;
    for (const auto& r : ranges_)
      if (r.first <= i && i <= r.second) return true;
    return false;
  }
  /// Throws BadInput("<flag>: there is no <what> i ...") unless every selected number is one of
  /// `available` (sorted). Costs O(|available| x ranges), whatever the ranges span.
  void require_within(const std::vector<std::int64_t>& available, const std::string& what,
                      const std::string& where) const {
    std::vector<std::int64_t> avail = available;
    avail.erase(std::unique(avail.begin(), avail.end()), avail.end());
    for (const auto& r : ranges_) {
      const auto lo = std::lower_bound(avail.begin(), avail.end(), r.first);
      const auto hi = std::upper_bound(avail.begin(), avail.end(), r.second);
      const auto have = static_cast<std::uint64_t>(hi - lo);
      if (have == static_cast<std::uint64_t>(r.second - r.first) + 1) continue;
      std::int64_t missing = r.first;  // the first selected number that does not exist
      for (auto it = lo; it != hi && *it == missing; ++it) ++missing;
      throw BadInput(where + ": " + flag_ + ": there is no " + what + " " +
                     std::to_string(missing) + " (there are " + std::to_string(available.size()) +
                     ")");
    }
  }

 private:
  std::string flag_ = "--layers";
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges_;
};

}  // namespace spectral_cond::cli
