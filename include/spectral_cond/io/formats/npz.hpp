// spectral_cond::io: a defensive reader for NumPy's .npz archives (numpy.savez: STORED members,
// numpy.savez_compressed: DEFLATE members), each member a .npy file parsed by parse_npy.
//
// The zip structure is checked before any member is decoded: the end-of-central-directory
// record is searched for in the last 64 KiB + 22 bytes only and must account for the rest of the
// file; ZIP64 records and extra fields (numpy always writes ZIP64 local headers) are read and
// checked; every central entry lies inside the central directory, every local header and member
// inside the file and before the central directory, members do not overlap, the local header
// agrees with the central one, only STORED and DEFLATE are accepted, encrypted and multi-disk
// archives are rejected, stored sizes must agree, inflation stops at the declared size, and the
// CRC-32 is verified. Member names must end in ".npy" and be unique. Failures throw IoError with
// one line naming the file (and the member).
#pragma once

#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/formats/npy.hpp>
#include <spectral_cond/io/mapped_file.hpp>

#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace spectral_cond {
namespace io {

/// One member of a zip archive, as the central directory describes it (sizes after ZIP64).
struct NpzMember {
  std::string name;          ///< the stored name, e.g. "W_q.npy"
  std::uint16_t method = 0;  ///< 0 STORED, 8 DEFLATE
  std::uint32_t crc32 = 0;
  std::uint64_t compressed = 0;    ///< bytes of member data in the archive
  std::uint64_t uncompressed = 0;  ///< bytes of the .npy file
  std::uint64_t local_offset = 0;  ///< local header position
  std::uint64_t data_offset = 0;   ///< first byte of member data (after the local header)
};

namespace detail {

/// Little-endian reads at p + off that are checked against the buffer's end by the caller.
inline std::uint64_t zip_le(const std::uint8_t* p, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = n; i-- > 0;) v = (v << 8) | p[i];
  return v;
}

/// The zip structure of an .npz archive or of a PyTorch checkpoint (pytorch.hpp). `label` names
/// the format in messages; with npy_members, every member must be a .npy file.
class ZipReader {
 public:
  ZipReader(const std::uint8_t* data, std::size_t size, const std::string& name,
            const char* label = "npz", bool npy_members = true)
      : p_(data), n_(size), name_(name), label_(label), npy_members_(npy_members) {}

  std::vector<NpzMember> members() {
    std::uint64_t cd_off = 0, cd_size = 0, count = 0, cd_end_limit = 0;
    find_directory(cd_off, cd_size, count, cd_end_limit);
    std::vector<NpzMember> out;
    std::set<std::string> names;
    std::uint64_t pos = cd_off;
    const std::uint64_t cd_end = cd_off + cd_size;
    for (std::uint64_t k = 0; k < count; ++k) {
      if (cd_end - pos < 46 || u32(pos) != 0x02014b50U)
        fail("central directory entry " + std::to_string(k) + " is truncated or malformed");
      NpzMember m;
      const auto flags = u16(pos + 8);
      m.method = static_cast<std::uint16_t>(u16(pos + 10));
      m.crc32 = u32(pos + 16);
      m.compressed = u32(pos + 20);
      m.uncompressed = u32(pos + 24);
      const std::uint64_t nlen = u16(pos + 28), elen = u16(pos + 30), clen = u16(pos + 32);
      const auto disk = u16(pos + 34);
      m.local_offset = u32(pos + 42);
      if (cd_end - pos - 46 < nlen + elen + clen)
        fail("central directory entry " + std::to_string(k) + " runs past the directory");
      m.name.assign(reinterpret_cast<const char*>(p_ + pos + 46), static_cast<std::size_t>(nlen));
      read_zip64_extra(pos + 46 + nlen, elen, m, disk, m.name);
      pos += 46 + nlen + elen + clen;
      check_member(m, flags, names);
      read_local_header(m, cd_off);
      out.push_back(m);
    }
    check_no_overlap(out);
    return out;
  }

  /// The bytes of a stored member in place, or of a deflated one inflated into `buf`.
  ByteView member_bytes(const NpzMember& m, std::vector<std::uint8_t>& buf) const {
    if (m.data_offset > n_ || m.compressed > n_ - m.data_offset)
      fail(m.name, "member data lies outside the archive");
    const std::uint8_t* src = p_ + m.data_offset;
    ByteView out{src, static_cast<std::size_t>(m.compressed)};
    if (m.method == 8) {
      inflate_raw(m, src, buf);
      out = {buf.data(), buf.size()};
    }
    const std::uint32_t crc = crc32_of(out.data, out.size);
    if (crc != m.crc32) fail(m.name, "CRC-32 mismatch (data corrupted)");
    return out;
  }

  /// The first min(want, m.uncompressed) bytes of a member's .npy file, inflating no more than
  /// that (a stored member is copied). The CRC is not checked: only member_bytes can.
  std::vector<std::uint8_t> member_prefix(const NpzMember& m, std::uint64_t want) const {
    if (m.data_offset > n_ || m.compressed > n_ - m.data_offset)
      fail(m.name, "member data lies outside the archive");
    want = std::min(want, m.uncompressed);
    const std::uint8_t* src = p_ + m.data_offset;
    if (m.method == 0) return std::vector<std::uint8_t>(src, src + want);
    std::vector<std::uint8_t> out(static_cast<std::size_t>(want));
    z_stream zs{};
    if (inflateInit2(&zs, -15) != Z_OK) fail(m.name, "zlib inflateInit2 failed");
    std::uint64_t in_left = m.compressed, got = 0;
    int rc = Z_OK;
    while (got < want && rc != Z_STREAM_END) {
      if (zs.avail_in == 0 && in_left > 0) {
        zs.next_in = const_cast<Bytef*>(src + (m.compressed - in_left));
        zs.avail_in = static_cast<uInt>(std::min<std::uint64_t>(in_left, 1u << 20));
        in_left -= zs.avail_in;
      }
      zs.next_out = out.data() + got;
      zs.avail_out = static_cast<uInt>(std::min<std::uint64_t>(want - got, 1u << 20));
      const uInt before = zs.avail_out;
      rc = inflate(&zs, Z_NO_FLUSH);
      got += before - zs.avail_out;
      if (rc != Z_OK && rc != Z_STREAM_END) {
        inflateEnd(&zs);
        fail(m.name, rc == Z_BUF_ERROR ? "deflate stream truncated" : "corrupt deflate stream");
      }
    }
    inflateEnd(&zs);
    if (got < want) fail(m.name, "inflates to fewer bytes than declared");
    return out;
  }

  [[noreturn]] void fail(const std::string& msg) const {
    throw IoError(name_ + ": " + label_ + ": " + msg);
  }
  [[noreturn]] void fail(const std::string& member, const std::string& msg) const {
    throw IoError(name_ + ": " + label_ + ": member " + quote(member) + ": " + msg);
  }

 private:
  std::uint64_t u16(std::uint64_t off) const { return zip_le(p_ + off, 2); }
  std::uint32_t u32(std::uint64_t off) const {
    return static_cast<std::uint32_t>(zip_le(p_ + off, 4));
  }
  std::uint64_t u64(std::uint64_t off) const { return zip_le(p_ + off, 8); }

  void find_directory(std::uint64_t& cd_off, std::uint64_t& cd_size, std::uint64_t& count,
                      std::uint64_t& cd_end_limit) {
    if (n_ < 22) fail("not a zip archive (" + std::to_string(n_) + " bytes)");
    // The EOCD is 22 bytes plus a comment of at most 65535 bytes that must reach the file's end.
    const std::uint64_t lowest = n_ - 22 > 65535 ? n_ - 22 - 65535 : 0;
    std::uint64_t eocd = n_;
    for (std::uint64_t at = n_ - 22 + 1; at-- > lowest;) {
      if (u32(at) == 0x06054b50U && at + 22 + u16(at + 20) == n_) {
        eocd = at;
        break;
      }
    }
    if (eocd == n_) fail("not a zip archive (no end-of-central-directory record)");
    if (u16(eocd + 4) != 0 || u16(eocd + 6) != 0 || u16(eocd + 8) != u16(eocd + 10))
      fail("multi-disk archives are not supported");
    count = u16(eocd + 10);
    cd_size = u32(eocd + 12);
    cd_off = u32(eocd + 16);
    cd_end_limit = eocd;
    // ZIP64: a locator right before the EOCD points to the ZIP64 end record.
    if (eocd >= 20 && u32(eocd - 20) == 0x07064b50U) {
      const std::uint64_t rec = u64(eocd - 20 + 8);
      if (u32(eocd - 20 + 4) != 0 || u32(eocd - 20 + 16) > 1)
        fail("multi-disk archives are not supported");
      if (rec > eocd - 20 || eocd - 20 - rec < 56 || u32(rec) != 0x06064b50U)
        fail("ZIP64 end-of-central-directory record missing or malformed");
      if (u32(rec + 16) != 0 || u32(rec + 20) != 0 || u64(rec + 24) != u64(rec + 32))
        fail("multi-disk archives are not supported");
      count = u64(rec + 32);
      cd_size = u64(rec + 40);
      cd_off = u64(rec + 48);
      cd_end_limit = rec;
    } else if (count == 0xFFFF || cd_size == 0xFFFFFFFFU || cd_off == 0xFFFFFFFFU) {
      fail("ZIP64 sizes without a ZIP64 end-of-central-directory locator");
    }
    if (cd_off > cd_end_limit || cd_size > cd_end_limit - cd_off)
      fail("central directory [" + std::to_string(cd_off) + ", +" + std::to_string(cd_size) +
           ") lies outside the file");
    if (count > cd_size / 46)
      fail("central directory too small for " + std::to_string(count) + " entries");
    if (count == 0) fail(npy_members_ ? "empty archive: not an npz" : "empty archive");
  }

  /// Replaces 0xFFFFFFFF sizes and offset by the ZIP64 extra field's 64-bit values.
  void read_zip64_extra(std::uint64_t at, std::uint64_t len, NpzMember& m, std::uint64_t disk,
                        const std::string& member) const {
    const bool need_u = m.uncompressed == 0xFFFFFFFFU, need_c = m.compressed == 0xFFFFFFFFU,
               need_o = m.local_offset == 0xFFFFFFFFU;
    const std::uint64_t end = at + len;
    bool found = false;
    while (end - at >= 4) {
      const std::uint64_t id = u16(at), sz = u16(at + 2);
      if (end - at - 4 < sz) fail(member, "extra field runs past its header");
      if (id == 0x0001 && !found) {
        found = true;
        std::uint64_t q = at + 4;
        auto take = [&](bool need, std::uint64_t& v) {
          if (!need) return;
          if (at + 4 + sz - q < 8) fail(member, "ZIP64 extra field too short");
          v = u64(q);
          q += 8;
        };
        take(need_u, m.uncompressed);
        take(need_c, m.compressed);
        take(need_o, m.local_offset);
      }
      at += 4 + sz;
    }
    if ((need_u || need_c || need_o) && !found) fail(member, "ZIP64 sizes without a ZIP64 field");
    if (disk != 0 && disk != 0xFFFF) fail(member, "member on another disk");
  }

  void check_member(const NpzMember& m, std::uint64_t flags, std::set<std::string>& names) const {
    if (npy_members_ && (m.name.size() < 5 || m.name.compare(m.name.size() - 4, 4, ".npy") != 0))
      fail(m.name, "not a .npy member: not an npz archive");
    if (m.name.find('\0') != std::string::npos) fail(m.name, "name contains NUL");
    if (!names.insert(m.name).second) fail(m.name, "duplicate member");
    if ((flags & 0x41U) != 0) fail(m.name, "encrypted members are not supported");
    if (m.method != 0 && m.method != 8)
      fail(m.name, "compression method " + std::to_string(m.method) +
                       " is not supported (STORED or DEFLATE only)");
    if (m.method == 0 && m.compressed != m.uncompressed)
      fail(m.name, "stored member with compressed size " + std::to_string(m.compressed) +
                       " != uncompressed size " + std::to_string(m.uncompressed));
    // DEFLATE expands at most ~1032:1; a larger claim is a lie (or a bomb).
    if (m.method == 8 && m.uncompressed / 1032 > m.compressed + 1)
      fail(m.name, "uncompressed size " + std::to_string(m.uncompressed) + " impossible for " +
                       std::to_string(m.compressed) + " deflated bytes");
  }

  void read_local_header(NpzMember& m, std::uint64_t cd_off) const {
    const std::uint64_t o = m.local_offset;
    if (o > cd_off || cd_off - o < 30 || u32(o) != 0x04034b50U)
      fail(m.name, "local header at " + std::to_string(o) + " missing or malformed");
    const std::uint64_t flags = u16(o + 6), method = u16(o + 8);
    const std::uint64_t nlen = u16(o + 26), elen = u16(o + 28);
    if (cd_off - o - 30 < nlen + elen) fail(m.name, "local header runs into the directory");
    if (std::string(reinterpret_cast<const char*>(p_ + o + 30), static_cast<std::size_t>(nlen)) !=
        m.name)
      fail(m.name, "local header names a different member");
    if (method != m.method) fail(m.name, "local and central compression methods differ");
    if ((flags & 0x08U) == 0) {  // sizes are in the local header (else in a data descriptor)
      NpzMember l = m;
      l.compressed = u32(o + 18);
      l.uncompressed = u32(o + 22);
      l.local_offset = 0;
      read_zip64_extra(o + 30 + nlen, elen, l, 0, m.name);
      if (l.compressed != m.compressed || l.uncompressed != m.uncompressed ||
          u32(o + 14) != m.crc32)
        fail(m.name, "local and central headers disagree on sizes or CRC");
    }
    m.data_offset = o + 30 + nlen + elen;
    if (m.compressed > cd_off - m.data_offset)
      fail(m.name, "data [" + std::to_string(m.data_offset) + ", +" + std::to_string(m.compressed) +
                       ") runs into the central directory");
  }

  void check_no_overlap(std::vector<NpzMember> ms) const {
    std::sort(ms.begin(), ms.end(), [](const NpzMember& a, const NpzMember& b) {
      return a.local_offset < b.local_offset;
    });
    for (std::size_t i = 1; i < ms.size(); ++i)
      if (ms[i].local_offset < ms[i - 1].data_offset + ms[i - 1].compressed)
        fail(ms[i].name, "overlaps member " + quote(ms[i - 1].name));
  }

  void inflate_raw(const NpzMember& m, const std::uint8_t* src,
                   std::vector<std::uint8_t>& buf) const {
    constexpr std::uint64_t kChunk = std::uint64_t{1} << 20;
    buf.clear();
    z_stream zs{};
    if (inflateInit2(&zs, -15) != Z_OK) fail(m.name, "zlib inflateInit2 failed");
    std::uint64_t in_left = m.compressed;
    int rc = Z_OK;
    while (rc != Z_STREAM_END) {
      if (zs.avail_in == 0 && in_left > 0) {
        zs.next_in = const_cast<Bytef*>(src + (m.compressed - in_left));
        zs.avail_in = static_cast<uInt>(std::min(in_left, kChunk));
        in_left -= zs.avail_in;
      }
      const std::size_t have = buf.size();
      // Grow toward the declared size only; one extra byte detects a longer stream.
      const std::uint64_t room = std::min(kChunk, m.uncompressed + 1 - have);
      buf.resize(have + static_cast<std::size_t>(room));
      zs.next_out = buf.data() + have;
      zs.avail_out = static_cast<uInt>(room);
      rc = inflate(&zs, Z_NO_FLUSH);
      buf.resize(buf.size() - zs.avail_out);
      if (rc != Z_OK && rc != Z_STREAM_END) {
        inflateEnd(&zs);
        fail(m.name, rc == Z_BUF_ERROR ? "deflate stream truncated" : "corrupt deflate stream");
      }
      if (buf.size() > m.uncompressed) {
        inflateEnd(&zs);
        fail(m.name,
             "inflates to more than the declared " + std::to_string(m.uncompressed) + " bytes");
      }
    }
    const bool rest = zs.avail_in != 0 || in_left != 0;
    inflateEnd(&zs);
    if (rest) fail(m.name, "bytes after the end of the deflate stream");
    if (buf.size() != m.uncompressed)
      fail(m.name, "inflates to " + std::to_string(buf.size()) + " bytes, declared " +
                       std::to_string(m.uncompressed));
  }

  static std::uint32_t crc32_of(const std::uint8_t* p, std::size_t n) {
    uLong c = crc32(0L, Z_NULL, 0);
    while (n > 0) {
      const auto k = static_cast<uInt>(std::min<std::size_t>(n, std::size_t{1} << 30));
      c = crc32(c, p, k);
      p += k;
      n -= k;
    }
    return static_cast<std::uint32_t>(c);
  }

  const std::uint8_t* p_;
  std::uint64_t n_;
  std::string name_;
  std::string label_;
  bool npy_members_ = true;
};

}  // namespace detail

/// Lists the members of an .npz archive held in memory and checks the zip structure (see the
/// top of this file); `name` labels messages. Throws IoError.
inline std::vector<NpzMember> parse_npz_directory(const std::uint8_t* data, std::size_t size,
                                                  const std::string& name) {
  return detail::ZipReader(data, size, name).members();
}

/// Decodes one member of an archive held in memory (inflating it if needed, checking its CRC)
/// and parses it with parse_npy; messages name "<name>: member '<member>'".
inline NpyArray read_npz_member(const std::uint8_t* data, std::size_t size, const std::string& name,
                                const NpzMember& m) {
  detail::ZipReader z(data, size, name);
  std::vector<std::uint8_t> buf;
  const ByteView b = z.member_bytes(m, buf);
  return parse_npy(b.data, b.size, name + ": member " + detail::quote(m.name));
}

/// The .npy header of one member, checked as parse_npy checks it (the data size against the
/// member's declared size), inflating only the header's bytes: a member's shape costs at most
/// kNpyMaxHeaderBytes of memory whatever its size.
inline detail::NpyHeader read_npz_member_header(const std::uint8_t* data, std::size_t size,
                                                const std::string& name, const NpzMember& m) {
  detail::ZipReader z(data, size, name);
  const std::string label = name + ": member " + detail::quote(m.name);
  const std::vector<std::uint8_t> pre = z.member_prefix(m, 12);
  const detail::NpyPreamble p = detail::parse_npy_preamble(pre.data(), m.uncompressed, label);
  const std::vector<std::uint8_t> head = z.member_prefix(m, p.header_offset + p.header_len);
  detail::NpyHeader h =
      detail::NpyHeaderParser(reinterpret_cast<const char*>(head.data()) + p.header_offset,
                              p.header_len, label)
          .parse();
  detail::check_npy_data_size(h, m.uncompressed - p.header_offset - p.header_len, label);
  return h;
}

/// A memory-mapped .npz archive. The directory is read and checked on open; members are
/// decoded on request.
class NpzFile {
 public:
  explicit NpzFile(const std::string& path)
      : map_(path), members_(parse_npz_directory(map_.data(), map_.size(), path)) {}

  const std::string& path() const { return map_.path(); }
  /// Array names (member names without ".npy"), in archive order.
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const auto& m : members_) n.push_back(m.name.substr(0, m.name.size() - 4));
    return n;
  }
  const std::vector<NpzMember>& members() const { return members_; }
  bool contains(const std::string& name) const { return find(name) != nullptr; }

  /// The checked .npy header of array `name`, inflating only the header (see
  /// read_npz_member_header).
  detail::NpyHeader header(const std::string& name) const {
    const NpzMember* m = find(name);
    if (m == nullptr) throw IoError(path() + ": npz: no array " + detail::quote(name));
    return read_npz_member_header(map_.data(), map_.size(), path(), *m);
  }

  /// The data of array `name` exactly as stored after its .npy header (its own dtype and byte
  /// order), inflated (or copied, for a stored member) into `out`, with its header in `h`: one
  /// buffer of the member's size, never its values as doubles.
  void stored_data(const std::string& name, std::vector<std::uint8_t>& out,
                   detail::NpyHeader& h) const {
    const NpzMember* m = find(name);
    if (m == nullptr) throw IoError(path() + ": npz: no array " + detail::quote(name));
    detail::ZipReader z(map_.data(), map_.size(), path());
    std::vector<std::uint8_t> buf;
    const ByteView b = z.member_bytes(*m, buf);
    const std::size_t off =
        detail::npy_data_offset(b.data, b.size, path() + ": member " + detail::quote(m->name), h);
    if (buf.empty()) {
      out.assign(b.data + off, b.data + off + h.data_bytes);
    } else {
      buf.erase(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(off));
      buf.resize(h.data_bytes);
      out.swap(buf);
    }
  }

  /// The array `name` ("W" or "W.npy"); IoError naming the file and array when absent.
  NpyArray array(const std::string& name) const {
    const NpzMember* m = find(name);
    if (m == nullptr) throw IoError(path() + ": npz: no array " + detail::quote(name));
    return read_npz_member(map_.data(), map_.size(), path(), *m);
  }

 private:
  const NpzMember* find(const std::string& name) const {
    if (by_name_.size() != members_.size())
      for (std::size_t i = 0; i < members_.size(); ++i) by_name_.emplace(members_[i].name, i);
    for (const std::string& n : {name + ".npy", name}) {
      auto it = by_name_.find(n);
      if (it != by_name_.end()) return &members_[it->second];
    }
    return nullptr;
  }

  MappedFile map_;
  std::vector<NpzMember> members_;
  mutable std::map<std::string, std::size_t> by_name_;  // member name -> index, built once
};

}  // namespace io
}  // namespace spectral_cond
