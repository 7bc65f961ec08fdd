// One read-only view over the checkpoint formats the library reads (docs/checkpoints.md):
//
//   safetensors  a .safetensors file, a sharded *.safetensors.index.json, or a directory holding
//                one of them (io::Checkpoint). Shards are mapped on first use only.
//   npz          a NumPy .npz archive (numpy.savez or savez_compressed); array name = tensor name.
//   npy-dir      a directory of .npy files; file name without ".npy" = tensor name.
//   pytorch      a torch.save checkpoint (.bin, .pt, .pth; zip or legacy format), read by a
//                restricted unpickler that never runs code (io/formats/pytorch.hpp), or a sharded
//                one (pytorch_model.bin.index.json), its shards opened on first use and checked
//                against the index both ways, as for safetensors.
//   gguf         a llama.cpp GGUF file (io/formats/gguf.hpp), quantized tensors dequantized; for
//                architecture "llama" the converter's Q/K row permutation is undone.
//
// A file's format is found from its first bytes, never from its name alone (io/formats/detect.hpp);
// a directory is searched for safetensors, then pytorch_model.bin (or exactly one .bin/.pt/.pth),
// then exactly one .gguf, then exactly one .npz, then .npy files.
//
// A reader lists every tensor's name, and the shape and dtype of those that layout detection may
// look at (attention_candidate()); it hands out one tensor at a time as a double matrix, checked
// finite, so that a caller holds only the tensors of the layer it is working on. Every error is
// an IoError naming the file and the tensor.
#pragma once

#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/formats/detect.hpp>
#include <spectral_cond/io/formats/gguf.hpp>
#include <spectral_cond/io/formats/npy.hpp>
#include <spectral_cond/io/formats/npz.hpp>
#include <spectral_cond/io/formats/pytorch.hpp>
#include <spectral_cond/io/formats/safetensors.hpp>
#include <spectral_cond/io/layouts/detect.hpp>
#include <spectral_cond/io/paths.hpp>

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace spectral_cond {
namespace io {

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
  detail::NpyHeader h;
  (void)detail::npy_data_offset(data, size, name, h);
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
    if (S_ISDIR(st.st_mode)) {
      open_directory(path);
      return;
    }
    const CheckpointFormat f = detail::sniff_format(path);
    // An index names its shards: a PyTorch one (pytorch_model.bin.index.json) is read here, a
    // safetensors one by io::Checkpoint.
    if (f == CheckpointFormat::Safetensors && has_suffix(path, ".bin.index.json"))
      open_pytorch_index(path);
    else
      open_file(path, f);
  }

  CheckpointFormat format() const { return kind_; }
  /// The path as given on the command line.
  const std::string& path() const { return path_; }
  /// The directory a config.json is looked for in.
  std::string directory() const {
    if (kind_ == CheckpointFormat::NpyDir) return path_;
    if (kind_ == CheckpointFormat::Safetensors) return parent_directory(ckpt_->path());
    if (kind_ == CheckpointFormat::Pytorch)
      return parent_directory(pt_ ? pt_->path() : pt_index_path_);
    if (kind_ == CheckpointFormat::Gguf) return parent_directory(gguf_->path());
    return parent_directory(path_);
  }
  /// The safetensors checkpoint, or nullptr for other sources.
  const Checkpoint* checkpoint() const { return ckpt_.get(); }
  /// The PyTorch checkpoint, or nullptr for other sources and for a sharded one.
  const PytorchFile* pytorch() const { return pt_.get(); }
  /// The PyTorch file (the single one, or the shard, opened now) that holds `name`; nullptr for
  /// other sources.
  const PytorchFile* pytorch_for(const std::string& name) const {
    if (pt_) return pt_.get();
    if (kind_ != CheckpointFormat::Pytorch) return nullptr;
    return &pt_shard_for(name);
  }
  /// The GGUF file, or nullptr for other sources.
  const GgufFile* gguf() const { return gguf_.get(); }

  /// Opens every shard now (headers only, no tensor data) and checks the index against each: a
  /// bad shard is an error at the start, naming it, even one holding no tensor that is read.
  void open_all_shards() const {
    if (ckpt_) ckpt_->open_all();
    for (const auto& kv : pt_index_.weight_map) (void)pt_shard_for(kv.first);
  }

  /// Every tensor name, sorted.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const {
    return std::binary_search(names_.begin(), names_.end(), name);
  }

  /// Names and shapes for detect_layers: the shape of every attention_candidate() tensor (or,
  /// with a --map, every tensor it matches), an empty shape for the others (never looked at,
  /// and their shards are not opened).
  std::vector<NamedShape> layout_view(const LayerMap* map = nullptr) const {
    std::vector<NamedShape> out;
    out.reserve(names_.size());
    const bool mapped = map && !map->empty();
    for (const std::string& n : names_) {
      NamedShape s;
      s.name = n;
      if (mapped ? map_candidate(*map, n) : attention_candidate(n)) s.shape = shape(n);
      out.push_back(std::move(s));
    }
    return out;
  }

  std::vector<std::int64_t> shape(const std::string& name) const {
    if (ckpt_) return ckpt_->info(name).shape;
    if (const PytorchFile* pt = pytorch_for(name)) return pt->info(name).shape;
    if (gguf_) return gguf_->info(name).shape;
    return entry(name).shape;
  }

  /// npz / npy-dir array `name`'s data as stored, when that is already its safetensors encoding
  /// (row-major, little-endian): true with the bytes in `out`, one buffer of the array's size.
  /// False for a Fortran-order array (use array() and re-encode it).
  bool stored_bytes(const std::string& name, std::vector<std::uint8_t>& out) const {
    const Entry& e = entry(name);
    if (e.descr.empty() || e.descr[0] != '<' || (e.fortran && e.shape.size() > 1)) return false;
    detail::NpyHeader h;
    if (kind_ == CheckpointFormat::Npz) {
      npz_->stored_data(name, out, h);
    } else {
      const MappedFile f(e.file);
      const std::size_t off = detail::npy_data_offset(f.data(), f.size(), e.file, h);
      out.assign(f.data() + off, f.data() + off + h.data_bytes);
    }
    return true;
  }

  /// The tensor's dtype (for npz / npy-dir sources, the one a corrected tensor is written in).
  Dtype dtype(const std::string& name) const {
    if (ckpt_) return ckpt_->info(name).dtype;
    if (const PytorchFile* pt = pytorch_for(name)) return pt->info(name).dtype;
    if (gguf_) {  // a quantized tensor is read as its dequantized values: F32 is their dtype
      const GgmlType t = gguf_->info(name).type;
      return t == GgmlType::F64    ? Dtype::F64
             : t == GgmlType::F16  ? Dtype::F16
             : t == GgmlType::BF16 ? Dtype::BF16
                                   : Dtype::F32;
    }
    return dtype_of_descr(entry(name).descr);
  }

  /// The file that holds `name` (for messages): the shard, the .npz or the .npy file.
  std::string file_of(const std::string& name) const {
    if (ckpt_) return ckpt_->shard_for(name).path();
    if (const PytorchFile* pt = pytorch_for(name)) return pt->path();
    if (gguf_) return gguf_->path();
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
    } else if (const PytorchFile* pt = pytorch_for(name)) {
      const PytorchTensor& t = pt->info(name);
      if (t.shape.size() != 2)
        throw IoError(file_of(name) + ": tensor " + detail::quote(name) + " has shape " +
                      detail::shape_string(t.shape) + ", expected a 2-D matrix");
      m = pt->matrix(name);
    } else if (gguf_) {
      m = in_hf_row_order(*gguf_, name, gguf_->matrix(name));
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

  /// The 1-D tensor `name` (a bias) as a double vector. Throws IoError naming the file and
  /// tensor when it is not 1-D, not floating point, or holds NaN or Inf. For GGUF architecture
  /// "llama", attn_q / attn_k biases are put back in Hugging Face order as their weights' rows.
  Vec<double> vector(const std::string& name) const {
    const std::vector<std::int64_t> s = shape(name);
    if (s.size() != 1)
      throw IoError(file_of(name) + ": tensor " + detail::quote(name) + " has shape " +
                    detail::shape_string(s) + ", expected a 1-D vector");
    Vec<double> v;
    if (ckpt_) {
      v = ckpt_->matrix<double>(name).col(0);
    } else if (const PytorchFile* pt = pytorch_for(name)) {
      v = pt->matrix(name).col(0);
    } else if (gguf_) {
      const std::vector<double> x = gguf_->values(name);
      v = in_hf_row_order(*gguf_, name,
                          Eigen::Map<const Mat<double>>(x.data(), static_cast<Index>(x.size()), 1))
              .col(0);
    } else {
      const NpyArray a = array(name);
      v = Eigen::Map<const Vec<double>>(a.data.data(), static_cast<Index>(a.data.size()));
    }
    for (Index i = 0; i < v.size(); ++i)
      if (!std::isfinite(v(i)))
        throw IoError(file_of(name) + ": tensor " + detail::quote(name) +
                      " has a NaN or Inf entry at [" + std::to_string(i) + "]");
    return v;
  }

  /// An npz / npy-dir tensor of any rank (not for safetensors or PyTorch sources, whose bytes
  /// are copied: Checkpoint::bytes, PytorchFile::bytes).
  NpyArray array(const std::string& name) const {
    if (ckpt_ || kind_ == CheckpointFormat::Pytorch || gguf_)
      throw IoError(path_ + ": array() reads npz and npy sources only (tensor " +
                    detail::quote(name) + ")");
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
    bool fortran = false;
  };

  static bool has_npy_files(const std::string& dir) {
    bool found = false;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d))
        if (has_suffix(e->d_name, ".npy")) found = true;
      ::closedir(d);
    }
    return found;
  }

  const Entry& entry(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) throw IoError(path_ + ": no tensor " + detail::quote(name));
    return it->second;
  }

  void open_file(const std::string& p, CheckpointFormat f) {
    kind_ = f;
    switch (f) {
      case CheckpointFormat::Npz:
        open_npz(p);
        return;
      case CheckpointFormat::Pytorch:
        pt_ = std::make_unique<PytorchFile>(p);
        names_ = pt_->names();
        return;
      case CheckpointFormat::Safetensors:
        ckpt_ = std::make_unique<Checkpoint>(p);
        names_ = ckpt_->names();
        return;
      case CheckpointFormat::Gguf:
        gguf_ = std::make_unique<GgufFile>(p);
        names_ = gguf_->names();
        std::sort(names_.begin(), names_.end());
        return;
      case CheckpointFormat::NpyDir:
        break;
    }
    open_npy_dir(p);
  }

  /// The files of a directory with one of the suffixes, sorted.
  static std::vector<std::string> files_with(const std::string& dir,
                                             std::initializer_list<const char*> suffixes) {
    std::vector<std::string> out;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string n = e->d_name;
        for (const char* s : suffixes)
          if (has_suffix(n, s) && n.size() > std::strlen(s)) {
            out.push_back(n);
            break;
          }
      }
      ::closedir(d);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  void open_directory(const std::string& dir) {
    if (has_npy_files(dir)) return open_npy_dir(dir);
    const std::vector<std::string> st =
        files_with(dir, {".safetensors", ".safetensors.index.json"});
    if (!st.empty()) return open_file(dir, CheckpointFormat::Safetensors);
    const std::string bin = join_path(dir, "pytorch_model.bin");
    if (is_regular_file(bin)) return open_file(bin, detail::sniff_format(bin));
    if (is_regular_file(bin + ".index.json")) return open_pytorch_index(bin + ".index.json");
    for (const auto& group : {files_with(dir, {".bin", ".pt", ".pth"}), files_with(dir, {".gguf"}),
                              files_with(dir, {".npz"})}) {
      if (group.size() == 1) {
        const std::string f = join_path(dir, group[0]);
        return open_file(f, detail::sniff_format(f));
      }
      if (group.size() > 1)
        throw IoError(dir + ": the directory holds " + std::to_string(group.size()) +
                      " candidate files (" + group[0] + ", " + group[1] +
                      (group.size() > 2 ? ", ..." : "") + "): pass one of them");
    }
    throw IoError(dir + ": the directory holds no checkpoint; looked for " +
                  detail::kSupportedFormats);
  }

  void open_pytorch_index(const std::string& p) {
    kind_ = CheckpointFormat::Pytorch;
    pt_index_path_ = p;
    pt_index_ = detail::read_shard_index(p);
    pt_shards_.resize(pt_index_.shard_paths.size());
    for (const auto& kv : pt_index_.weight_map) names_.push_back(kv.first);
  }

  const PytorchFile& pt_shard_for(const std::string& name) const {
    auto it = pt_index_.weight_map.find(name);
    if (it == pt_index_.weight_map.end())
      throw IoError(pt_index_path_ + ": no tensor " + detail::quote(name));
    const std::size_t k = it->second;
    std::lock_guard<std::mutex> lock(*pt_mutex_);  // shards open lazily, as io::Checkpoint's do
    if (!pt_shards_[k]) {
      const std::string& sp = pt_index_.shard_paths[k];
      if (detail::sniff_format(sp) != CheckpointFormat::Pytorch)
        throw IoError(sp + ": a shard of " + pt_index_path_ + " that is not a PyTorch checkpoint");
      auto f = std::make_unique<PytorchFile>(sp);
      detail::check_shard(pt_index_, k, f->names(), pt_index_path_);
      pt_shards_[k] = std::move(f);
    }
    return *pt_shards_[k];
  }

  void open_npy_dir(const std::string& dir) {
    kind_ = CheckpointFormat::NpyDir;
    std::vector<std::string> files;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string n = e->d_name;
        if (has_suffix(n, ".npy") && n.size() > 4) files.push_back(n);
      }
      ::closedir(d);
    }
    std::sort(files.begin(), files.end());
    for (const std::string& f : files) {
      const std::string p = join_path(dir, f);
      const MappedFile m(p);
      const detail::NpyHeader h = detail::npy_header(m.data(), m.size(), p);
      const std::string name = f.substr(0, f.size() - 4);
      entries_[name] = Entry{h.shape, h.descr, p, h.fortran_order};
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
      entries_[name] = Entry{h.shape, h.descr, p, h.fortran_order};
      names_.push_back(name);
    }
    std::sort(names_.begin(), names_.end());
  }

  std::string path_;
  CheckpointFormat kind_ = CheckpointFormat::Safetensors;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<NpzFile> npz_;
  std::unique_ptr<PytorchFile> pt_;
  // A sharded PyTorch checkpoint (pytorch_model.bin.index.json): its index, and each shard
  // opened on first use and checked against it.
  std::string pt_index_path_;
  detail::ShardIndex pt_index_;
  mutable std::vector<std::unique_ptr<PytorchFile>> pt_shards_;
  std::unique_ptr<std::mutex> pt_mutex_ = std::make_unique<std::mutex>();
  std::unique_ptr<GgufFile> gguf_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> names_;
};

/// Opens the checkpoint at `path`: a safetensors file, sharded index or directory holding one, a
/// PyTorch checkpoint, an .npz archive or a directory of .npy files (see the top of this file).
/// Throws IoError naming the path.
inline CheckpointReader open_checkpoint(const std::string& path) {
  return CheckpointReader(path);
}

}  // namespace io
}  // namespace spectral_cond
