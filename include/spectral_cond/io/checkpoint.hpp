// One read-only view over the checkpoint formats the library reads (docs/checkpoints.md):
//
//   safetensors  a .safetensors file, a sharded *.safetensors.index.json, or a directory holding
//                one of them (io::Checkpoint). Shards are mapped on first use only.
//   npz          a NumPy .npz archive (numpy.savez or savez_compressed); array name = tensor name.
//   npy-dir      a directory of .npy files; file name without ".npy" = tensor name.
//
// A reader lists every tensor's name, and the shape and dtype of those that layout detection may
// look at (attention_candidate()); it hands out one tensor at a time as a double matrix, checked
// finite, so that a caller holds only the tensors of the layer it is working on. Every error is
// an IoError naming the file and the tensor.
#pragma once

#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/layouts.hpp>
#include <spectral_cond/io/npy.hpp>
#include <spectral_cond/io/npz.hpp>
#include <spectral_cond/io/safetensors.hpp>

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace spectral_cond {
namespace io {

enum class CheckpointFormat { Safetensors, Npz, NpyDir };

inline const char* to_string(CheckpointFormat k) {
  switch (k) {
    case CheckpointFormat::Safetensors:
      return "safetensors";
    case CheckpointFormat::Npz:
      return "npz";
    case CheckpointFormat::NpyDir:
      return "npy-dir";
  }
  return "unknown";
}

/// True for the names a layout of detect_layers can match (MATH.md §8): only these tensors'
/// shapes are needed to find the attention layers, so only their shards are opened.
inline bool attention_candidate(const std::string& name) {
  static const char* suffixes[] = {"qkv.weight",    "in_proj_weight", "c_attn.weight",
                                   "query.weight",  "key.weight",     "value.weight",
                                   "q_proj.weight", "k_proj.weight",  "v_proj.weight"};
  for (const char* s : suffixes)
    if (detail::ends_with(name, s)) return true;
  return false;
}

/// Maps a .npy descr to the safetensors dtype a corrected tensor is written back in.
inline Dtype dtype_of_descr(const std::string& descr) {
  if (descr == "<f2") return Dtype::F16;
  if (descr == "<f4") return Dtype::F32;
  return Dtype::F64;
}

namespace detail {

/// The header of a .npy file held in memory (checked exactly as parse_npy checks it).
inline detail::NpyHeader npy_header(const std::uint8_t* data, std::size_t size,
                                    const std::string& name) {
  const detail::NpyPreamble pre = detail::parse_npy_preamble(data, size, name);
  detail::NpyHeader h =
      detail::NpyHeaderParser(reinterpret_cast<const char*>(data) + pre.header_offset,
                              pre.header_len, name)
          .parse();
  detail::check_npy_data_size(h, size - pre.header_offset - pre.header_len, name);
  return h;
}

}  // namespace detail

/// A checkpoint in any of the accepted formats (see the top of this file). Open one with
/// open_checkpoint(path).
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path) : path_(path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw IoError(path + ": cannot open: no such file");
    if (S_ISDIR(st.st_mode) && has_npy_files(path)) {
      open_npy_dir(path);
    } else if (!S_ISDIR(st.st_mode) && detail::ends_with(path, ".npz")) {
      open_npz(path);
    } else {
      kind_ = CheckpointFormat::Safetensors;
      ckpt_ = std::make_unique<Checkpoint>(path);
      for (const std::string& n : ckpt_->names()) names_.push_back(n);
    }
  }

  CheckpointFormat format() const { return kind_; }
  /// The path as given on the command line.
  const std::string& path() const { return path_; }
  /// The directory a config.json is looked for in.
  std::string directory() const {
    if (kind_ == CheckpointFormat::NpyDir) return path_;
    if (kind_ == CheckpointFormat::Safetensors) return detail::dir_of(ckpt_->path());
    return detail::dir_of(path_);
  }
  /// The safetensors checkpoint, or nullptr for npz / npy-dir sources.
  const Checkpoint* checkpoint() const { return ckpt_.get(); }

  /// Every tensor name, sorted.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const {
    return std::binary_search(names_.begin(), names_.end(), name);
  }

  /// Names and shapes for detect_layers: the shape of every attention_candidate() tensor,
  /// an empty shape for the others (never looked at, and their shards are not opened).
  std::vector<NamedShape> layout_view() const {
    std::vector<NamedShape> out;
    for (const std::string& n : names_) {
      NamedShape s;
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
  Dtype dtype(const std::string& name) const {
    if (ckpt_) return ckpt_->info(name).dtype;
    return dtype_of_descr(entry(name).descr);
  }

  /// The file that holds `name` (for messages): the shard, the .npz or the .npy file.
  std::string file_of(const std::string& name) const {
    if (ckpt_) return ckpt_->shard_for(name).path();
    if (kind_ == CheckpointFormat::Npz) return path_;
    return entry(name).file;
  }

  /// The 2-D tensor `name` as a double matrix (entry (i, j) = T[i, j]). Throws IoError naming
  /// the file and tensor when it is not 2-D, not floating point, or holds NaN or Inf.
  Mat<double> matrix(const std::string& name) const {
    Mat<double> m;
    if (ckpt_) {
      const TensorInfo& t = ckpt_->info(name);
      if (t.shape.size() != 2)
        throw IoError(file_of(name) + ": tensor " + detail::quote(name) + " has shape " +
                      detail::shape_string(t.shape) + ", expected a 2-D matrix");
      m = ckpt_->matrix<double>(name);
    } else {
      const NpyArray a = array(name);
      if (a.ndim() != 2)
        throw IoError(file_of(name) + ": tensor " + detail::quote(name) + " has shape " +
                      a.shape_string() + ", expected a 2-D matrix");
      m = a.to_matrix();
    }
    for (Index j = 0; j < m.cols(); ++j)
      for (Index i = 0; i < m.rows(); ++i)
        if (!std::isfinite(m(i, j)))
          throw IoError(file_of(name) + ": tensor " + detail::quote(name) +
                        " has a NaN or Inf entry at [" + std::to_string(i) + ", " +
                        std::to_string(j) + "]");
    return m;
  }

  /// An npz / npy-dir tensor of any rank (not for safetensors sources, which copy bytes).
  NpyArray array(const std::string& name) const {
    if (kind_ == CheckpointFormat::Npz) return npz_->array(name);
    const Entry& e = entry(name);
    const MappedFile f(e.file);
    return parse_npy(f.data(), f.size(), e.file);
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
        if (detail::ends_with(e->d_name, ".npy")) found = true;
      ::closedir(d);
    }
    return found;
  }

  const Entry& entry(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) throw IoError(path_ + ": no tensor " + detail::quote(name));
    return it->second;
  }

  void open_npy_dir(const std::string& dir) {
    kind_ = CheckpointFormat::NpyDir;
    std::vector<std::string> files;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string n = e->d_name;
        if (detail::ends_with(n, ".npy") && n.size() > 4) files.push_back(n);
      }
      ::closedir(d);
    }
    std::sort(files.begin(), files.end());
    for (const std::string& f : files) {
      const std::string p = detail::join_path(dir, f);
      const MappedFile m(p);
      const detail::NpyHeader h = detail::npy_header(m.data(), m.size(), p);
      const std::string name = f.substr(0, f.size() - 4);
      entries_[name] = Entry{h.shape, h.descr, p};
      names_.push_back(name);
    }
  }

  void open_npz(const std::string& p) {
    kind_ = CheckpointFormat::Npz;
    npz_ = std::make_unique<NpzFile>(p);
    for (const NpzMember& m : npz_->members()) {
      const std::string name = m.name.substr(0, m.name.size() - 4);
      // Only the member's header is read (and, compressed, inflated): never its data.
      const detail::NpyHeader h = npz_->header(name);
      entries_[name] = Entry{h.shape, h.descr, p};
      names_.push_back(name);
    }
    std::sort(names_.begin(), names_.end());
  }

  std::string path_;
  CheckpointFormat kind_ = CheckpointFormat::Safetensors;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<NpzFile> npz_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> names_;
};

/// Opens the checkpoint at `path`: a directory of .npy files, an .npz archive, or a safetensors
/// file, sharded index or directory holding one. Throws IoError naming the path.
inline CheckpointReader open_checkpoint(const std::string& path) {
  return CheckpointReader(path);
}

}  // namespace io
}  // namespace spectral_cond
